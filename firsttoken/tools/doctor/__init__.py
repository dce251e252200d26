"""firsttoken doctor: where a server's TTFT goes and the one change per cause, from its /metrics
(and /stats).

    from firsttoken.tools.doctor import doctor_from_texts, format_report
    report = doctor_from_texts(metrics_text, stats_dict_or_None)
    print(format_report(report)); report.to_dict()

Modules: observe (Prometheus text + /stats -> Observation; firsttoken, vLLM and llama.cpp names),
rules (Observation -> ranked Findings), report (Report, text and JSON), fetch (HTTP, --probe).
"""

from __future__ import annotations

from firsttoken.tools.doctor.observe import Observation, observe
from firsttoken.tools.doctor.report import Report, doctor_from_texts, format_report
from firsttoken.tools.doctor.rules import Finding, KVSizing, Thresholds, diagnose

__all__ = ["Finding", "KVSizing", "Observation", "Report", "Thresholds", "diagnose", "doctor_from_texts",
           "format_report", "observe"]  # fmt: skip
