"""firsttoken bench: a seeded load generator for any OpenAI-compatible chat server (firsttoken,
vLLM, SGLang).

    from firsttoken.tools.bench import BenchConfig, format_report, run_bench
    report = run_bench(BenchConfig(url="http://127.0.0.1:8000", rate=0.4, num_requests=200))
    print(format_report(report)); report.write_json("run.json")

Modules: config (BenchConfig, flag parsers), workload + images (seeded sessions), sse + client (one
timed stream -> RequestRecord), stats (percentiles, goodput), calibrate (--utilization: a rate from
measured service times), runner (arrivals, run_bench), report (text, plot).
httpx is needed only to run, so the names below load on first use and `firsttoken --help` works
without it.
"""

from __future__ import annotations

import importlib
from typing import Any

from firsttoken.tools.bench.config import BenchConfig, parse_mix, parse_size

_LAZY = {
    "RequestRecord": "client",
    "format_report": "report",
    "plot_report": "report",
    "BenchReport": "runner",
    "arun_bench": "runner",
    "run_bench": "runner",
    "measure_calibration": "runner",
    "Calibration": "calibrate",
    "BenchSummary": "stats",
    "ClassSummary": "stats",
    "Dist": "stats",
}
__all__ = ["BenchConfig", "parse_mix", "parse_size", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"firsttoken.tools.bench.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
