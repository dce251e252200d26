"""An arrival rate calibrated to the machine: `--utilization U` instead of a fixed `--rate`.

A fixed rate means different loads on different machines (CPUs differ several-fold in fp32 matmul
speed: docs/runs/notes/machines-and-utilization.md). Calibration measures what this server and
machine take per request, then offers a load relative to that:

    service_c    = mean e2e seconds of one session of class c sent alone (sequential probes after a warm-up)
    capacity_rps = 1 / sum_c(share_c * service_c)      sessions/s the server finishes one at a time
    rate         = U * capacity_rps                    the Poisson arrival rate of the measured run

U = 1 offers sessions as fast as the server finishes them one at a time. Batching lets a server keep
up above that, so U is a machine-relative unit of load, not a saturation point. Classes are the
seed-mix classes with their shares; any other workload is one class named after it ("text",
"multiturn", "file"), measured on its own sessions (a multiturn session's service time is the sum of
its turns).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from firsttoken.tools.bench.client import RequestRecord
from firsttoken.tools.bench.config import BenchConfig

# Probe sessions use their own seed, so their images and text never warm a cache for the measured
# run.
CALIBRATION_SEED_OFFSET = 1_000_003

# Sends a probe config's sessions one at a time (warm-up first) and returns the measured sessions'
# records.
ServiceProbe = Callable[[BenchConfig], Awaitable[list[RequestRecord]]]


@dataclass(frozen=True)
class Calibration:
    utilization: float  # offered load as a fraction of capacity_rps
    shares: dict[str, float]  # class -> fraction of sessions
    service_s: dict[str, float]  # class -> mean e2e seconds of a session sent alone
    num_probes: int  # measured sessions per class (after one warm-up session each)
    capacity_rps: float  # sessions/s: 1 / sum(share * service_s)
    rate: float  # sessions/s: utilization * capacity_rps, the Poisson rate used

    def to_dict(self) -> dict[str, Any]:
        return {"utilization": self.utilization, "shares": self.shares, "service_s": self.service_s,
                "num_probes": self.num_probes, "capacity_rps": self.capacity_rps, "rate": self.rate}

    def describe(self) -> str:
        services = ", ".join(f"{c} {s:.3f} s" for c, s in self.service_s.items())
        return (f"calibrated: unloaded service time (mean e2e of {self.num_probes} sequential sessions) {services}; "
                f"capacity {self.capacity_rps:.4f} sessions/s; utilization {self.utilization:g} -> "
                f"Poisson {self.rate:.4f}/s")


def capacity_rps(shares: dict[str, float], service_s: dict[str, float]) -> float:
    """Sessions/s a server finishes one at a time when a `shares` fraction of sessions takes
    `service_s` each."""
    mean_service_s = sum(share * service_s[cls] for cls, share in shares.items())
    if mean_service_s <= 0:
        raise ValueError("calibration: the measured service times add up to zero")
    return 1.0 / mean_service_s


def class_shares(config: BenchConfig) -> dict[str, float]:
    """Calibration class -> fraction of sessions: the seed-mix classes, else the workload as one
    class."""
    return dict(config.mix) if config.workload == "seed-mix" else {config.workload: 1.0}


def probe_config(config: BenchConfig, cls: str) -> BenchConfig:
    """`config` narrowed to class `cls`, sent one session at a time: one warm-up, then
    calibration_requests."""
    mix = ((cls, 1.0),) if config.workload == "seed-mix" else config.mix
    return replace(
        config,
        mix=mix,
        rate=None,
        utilization=None,
        concurrency=1,
        duration_s=None,
        num_requests=config.calibration_requests,
        warmup=1,
        seed=config.seed + CALIBRATION_SEED_OFFSET,
        slo_ttft_s=None,
        slo_tpot_s=None,
        progress=False,
    )


def session_service_s(records: list[RequestRecord]) -> list[float]:
    """Per measured session, the sum of its requests' e2e seconds (a seed-mix session is one
    request)."""
    per_session: dict[int, float] = {}
    for r in records:
        per_session[r.session] = per_session.get(r.session, 0.0) + (r.e2e_s or 0.0)
    return list(per_session.values())


async def calibrate(config: BenchConfig, probe: ServiceProbe) -> Calibration:
    """Measure each class alone through `probe`, then the rate for config.utilization. Raises
    ValueError when a probe request fails: a service time measured on errors would set a rate for a
    server that is not serving."""
    if config.utilization is None:
        raise ValueError("calibrate needs config.utilization")
    shares = class_shares(config)
    service: dict[str, float] = {}
    for cls in shares:
        records = [r for r in await probe(probe_config(config, cls)) if not r.warmup]
        failed = [r for r in records if not r.ok]
        if failed or not records:
            detail = (
                ", ".join(sorted({f"{r.error}: {(r.error_message or '')[:120]}" for r in failed}))
                or "none sent"
            )
            raise ValueError(
                f"calibration: class {cls}: {len(failed)} of {len(records)} probe requests failed "
                f"({detail})"
            )
        times = session_service_s(records)
        service[cls] = sum(times) / len(times)
    capacity = capacity_rps(shares, service)
    return Calibration(config.utilization, shares, service, config.calibration_requests, capacity,
                       config.utilization * capacity)
