"""doctor reads preemption reasons as causes (the scheduler labels them so): only a prefill's own growth means
optimistic admission is on; decode growth under whole-prompt admission asks for memory, not an admission switch."""

from __future__ import annotations

from pathlib import Path

from firsttoken.tools.doctor import doctor_from_texts

KV_CASE = Path(__file__).resolve().parent.parent / "fixtures" / "doctor" / "kv"


def kv_finding(decode_growth: int, prefill_growth: int):
    metrics = (KV_CASE / "metrics.txt").read_text()
    metrics = metrics.replace('firsttoken_preemptions_total{reason="decode_growth"} 0.0',
                              f'firsttoken_preemptions_total{{reason="decode_growth"}} {decode_growth}.0')
    metrics = metrics.replace('firsttoken_preemptions_total{reason="prefill_growth"} 6.0',
                              f'firsttoken_preemptions_total{{reason="prefill_growth"}} {prefill_growth}.0')
    return next(f for f in doctor_from_texts(metrics).findings if f.key == "kv_pressure")


def test_decode_growth_alone_asks_for_memory_not_for_whole_prompt_admission():
    finding = kv_finding(decode_growth=6, prefill_growth=0)
    assert "--kv-admission" not in finding.change
    assert finding.evidence["preemptions_by_reason"] == {"decode_growth": 6.0, "prefill_growth": 0.0}


def test_prefill_growth_means_optimistic_admission_and_asks_for_whole_prompt():
    assert kv_finding(decode_growth=0, prefill_growth=6).change.startswith("--kv-admission whole-prompt")
