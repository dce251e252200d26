"""Per-class and overall statistics over RequestRecords: latency percentiles, throughput, goodput,
errors."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from firsttoken.tools.bench.client import RequestRecord

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class Dist:
    """Seconds. count is the number of samples (requests, or gaps for ITL)."""

    count: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, values: list[float]) -> "Dist":
        if not values:
            return cls(0, None, None, None, None)
        arr = np.asarray(values, dtype=np.float64)
        p50, p95, p99 = (float(v) for v in np.percentile(arr, PERCENTILES))
        return cls(len(values), float(arr.mean()), p50, p95, p99)


@dataclass(frozen=True)
class ClassSummary:
    cls: str
    num_requests: int
    num_ok: int
    errors: dict[str, int]  # "http_400" / "stream_error" / "timeout" ... -> count
    prompt_tokens: int  # summed over requests that reported usage
    completion_tokens: int
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    num_good: int | None  # requests meeting every SLO given (None: no SLO given)
    server_phases: dict[str, Dist]  # usage.firsttoken "*_s" keys -> distribution; {} when absent


@dataclass(frozen=True)
class BenchSummary:
    duration_s: float  # first measured send to last measured completion
    num_requests: int
    num_ok: int
    errors: dict[str, int]
    request_throughput: float  # successful requests / s
    output_throughput: float  # completion tokens / s
    goodput_fraction: float | None  # of all measured requests (errors count as missing the SLO)
    goodput_rate: float | None  # good requests / s
    tokens_from_usage: bool  # False if any request's token count came from counting chunks
    server_timings_seen: bool
    classes: dict[str, ClassSummary]  # per class, plus "all"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: list[RequestRecord], slo_ttft_s: float | None, slo_tpot_s: float | None,
              class_order: list[str] | None = None) -> BenchSummary:
    measured = [r for r in records if not r.warmup]
    names = list(class_order or [])
    names += sorted({r.cls for r in measured} - set(names))
    classes = {
        n: _class_summary(n, [r for r in measured if r.cls == n], slo_ttft_s, slo_tpot_s)
        for n in names
        if any(r.cls == n for r in measured)
    }
    overall = _class_summary("all", measured, slo_ttft_s, slo_tpot_s)
    classes["all"] = overall
    if measured:
        begin = min(r.start_s for r in measured)
        end = max(r.start_s + (r.e2e_s or 0.0) for r in measured)
        duration = max(end - begin, 1e-9)
    else:
        duration = 0.0
    rate = (lambda n: n / duration if duration > 0 else 0.0)
    has_slo = slo_ttft_s is not None or slo_tpot_s is not None
    good = overall.num_good or 0
    return BenchSummary(
        duration_s=duration,
        num_requests=len(measured),
        num_ok=overall.num_ok,
        errors=overall.errors,
        request_throughput=rate(overall.num_ok),
        output_throughput=rate(overall.completion_tokens),
        goodput_fraction=(good / len(measured) if measured else 0.0) if has_slo else None,
        goodput_rate=rate(good) if has_slo else None,
        tokens_from_usage=all(r.tokens_from_usage for r in measured if r.ok),
        server_timings_seen=any(r.server_timings for r in measured),
        classes=classes,
    )


def meets_slo(r: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    """Succeeded, TTFT within its SLO, and TPOT within its SLO (a one-token answer has no TPOT: it
    passes)."""
    if not r.ok or r.ttft_s is None:
        return False
    if slo_ttft_s is not None and r.ttft_s > slo_ttft_s:
        return False
    tpot = r.tpot_s
    return not (slo_tpot_s is not None and tpot is not None and tpot > slo_tpot_s)


def _class_summary(name: str, rs: list[RequestRecord], slo_ttft_s: float | None,
                   slo_tpot_s: float | None) -> ClassSummary:
    ok = [r for r in rs if r.ok]
    errors = dict(sorted(Counter(r.error for r in rs if r.error is not None).items()))
    phases: dict[str, list[float]] = {}
    for r in ok:
        for key, value in (r.server_timings or {}).items():
            if key.endswith("_s") and isinstance(value, (int, float)):
                phases.setdefault(key, []).append(float(value))
    has_slo = slo_ttft_s is not None or slo_tpot_s is not None
    return ClassSummary(
        cls=name,
        num_requests=len(rs),
        num_ok=len(ok),
        errors=errors,
        prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        completion_tokens=sum(r.completion_tokens or 0 for r in ok),
        ttft=Dist.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Dist.of([t for r in ok if (t := r.tpot_s) is not None]),
        itl=Dist.of([g for r in ok for g in r.itl_s]),
        e2e=Dist.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        num_good=sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in rs) if has_slo else None,
        server_phases={k: Dist.of(v) for k, v in phases.items()},
    )
