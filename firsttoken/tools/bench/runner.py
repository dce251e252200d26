"""run_bench: send a seeded workload to an OpenAI-compatible server and summarize what the client
saw.

Arrivals: sessions start as a Poisson process at `rate` (seeded), or back to back, with at most
`concurrency` in flight. Warmup sessions run first, to completion, and are kept in the records
(warmup=True) but not in the statistics. A session's turns run one after another; a failed turn ends
its session. With `utilization`, the rate is calibrated first (calibrate.py): each class is sent
alone a few times, and the run uses U x capacity.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from firsttoken.tools.bench.calibrate import Calibration, calibrate
from firsttoken.tools.bench.client import RequestRecord, send_chat
from firsttoken.metrics.window import IMAGE_CLASSES
from firsttoken.tools.bench.config import BenchConfig
from firsttoken.tools.bench.progress import Progress
from firsttoken.tools.bench.stats import BenchSummary, summarize
from firsttoken.tools.bench.workload import Session, Workload


@dataclass
class BenchReport:
    config: BenchConfig
    workload: dict[str, Any]  # Workload.describe()
    model: str | None
    records: list[RequestRecord]  # every request sent, warmup included, in sending order
    summary: BenchSummary
    started_unix_s: float
    # with config.utilization: what was measured and the rate it set
    calibration: Calibration | None = None

    @property
    def rate(self) -> float | None:
        """The Poisson arrival rate the run used (sessions/s), given or calibrated; None: back to
        back."""
        return self.calibration.rate if self.calibration is not None else self.config.rate

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "workload": self.workload,
            "model": self.model,
            "started_unix_s": self.started_unix_s,
            "rate": self.rate,
            "calibration": None if self.calibration is None else self.calibration.to_dict(),
            "summary": self.summary.to_dict(),
            "records": [r.to_dict() for r in self.records],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def run_bench(
    config: BenchConfig, transport: httpx.AsyncBaseTransport | None = None
) -> BenchReport:
    """Blocking entry point (benchmarks/ scripts); `transport` lets tests talk to an in-process
    app."""
    return asyncio.run(arun_bench(config, transport))


async def arun_bench(
    config: BenchConfig, transport: httpx.AsyncBaseTransport | None = None
) -> BenchReport:
    started_unix = time.time()
    async with _client(config, transport) as client:
        model = config.model or await _first_model(client)
        calibration = None
        run_config = config
        if config.utilization is not None:
            calibration = await calibrate(
                config, lambda probe: _send_workload(probe, client, model)
            )
            if config.progress:
                print(calibration.describe(), file=sys.stderr)
            run_config = replace(config, utilization=None, rate=calibration.rate)
        records = await _send_workload(run_config, client, model)
    order = (
        [name for name, _ in config.mix]
        if config.workload == "seed-mix"
        else (
            ["first", "follow-up"]
            if config.workload == "multiturn"
            else ["text"]
            if config.workload == "text"
            else list(IMAGE_CLASSES)
        )
    )
    summary = summarize(records, config.slo_ttft_s, config.slo_tpot_s, order)
    return BenchReport(
        config, Workload(config).describe(), model, records, summary, started_unix, calibration
    )


def measure_calibration(
    config: BenchConfig, transport: httpx.AsyncBaseTransport | None = None
) -> Calibration:
    """Only the calibration of `config` (its utilization): for scripts that run several servers at
    one rate."""

    async def measure() -> Calibration:
        async with _client(config, transport) as client:
            model = config.model or await _first_model(client)
            return await calibrate(config, lambda probe: _send_workload(probe, client, model))

    return asyncio.run(measure())


def _client(config: BenchConfig, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    timeout = httpx.Timeout(config.timeout_s, connect=min(30.0, config.timeout_s))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(
        base_url=config.base_url, timeout=timeout, limits=limits, transport=transport
    )


async def _send_workload(
    config: BenchConfig, client: httpx.AsyncClient, model: str | None
) -> list[RequestRecord]:
    """Warm-up sessions, then the measured ones, as config's arrivals say; every record, in sending
    order."""
    run = _Run(config, Workload(config), client, model)
    if config.warmup:
        await run.phase(range(config.warmup), warmup=True, progress_label="warmup")
    start = config.warmup
    count = config.num_requests
    indices = range(start, start + count) if count is not None else itertools.count(start)
    await run.phase(indices, warmup=False, progress_label="bench")
    return sorted(run.records, key=lambda r: r.index)


async def _first_model(client: httpx.AsyncClient) -> str | None:
    """The server's first model id, or None (then each body's own "model" is sent)."""
    try:
        resp = await client.get("/v1/models")
        data = resp.json().get("data") or []
        return str(data[0]["id"]) if resp.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


class _Run:
    def __init__(self, config: BenchConfig, workload: Workload, client: httpx.AsyncClient,
                 model: str | None) -> None:
        self.config, self.workload, self.client, self.model = config, workload, client, model
        self.records: list[RequestRecord] = []
        self._next_index = 0
        self._t0 = time.perf_counter()

    async def phase(self, indices: Any, warmup: bool, progress_label: str) -> None:
        c = self.config
        bounded = isinstance(indices, range)
        sessions: dict[int, Session] = {}
        # build every body before the clock starts: image synthesis stays off the timed path
        if bounded:
            if c.progress:
                print(
                    f"{progress_label}: building {len(indices)} sessions (seed {c.seed})",
                    file=sys.stderr,
                )
            sessions = {i: s for i, s in zip(indices, await asyncio.to_thread(
                lambda: [self.workload.session(i) for i in indices]))}
        total = None
        if bounded:
            total = sum(len(s.requests) for s in sessions.values())
        duration = None if warmup else c.duration_s
        progress = Progress(total, progress_label, enabled=c.progress, duration_s=duration)
        concurrency = c.concurrency or (1 if c.rate is None or warmup else None)
        limiter = asyncio.Semaphore(concurrency) if concurrency else None
        rng = np.random.default_rng(c.seed)
        phase_start = time.perf_counter()
        if not warmup:
            self._t0 = phase_start
        next_arrival = 0.0
        tasks: list[asyncio.Task[None]] = []
        for i in indices:
            if duration is not None and time.perf_counter() - phase_start >= duration:
                break
            session = (
                sessions.pop(i) if bounded else await asyncio.to_thread(self.workload.session, i)
            )
            if c.rate is not None and not warmup:
                next_arrival += float(rng.exponential(1.0 / c.rate))
                delay = phase_start + next_arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            if limiter is not None:
                await limiter.acquire()
            tasks.append(asyncio.create_task(self._session(session, warmup, limiter, progress)))
        await asyncio.gather(*tasks)
        progress.close()

    async def _session(self, session: Session, warmup: bool, limiter: asyncio.Semaphore | None,
                       progress: Progress) -> None:
        history: list[dict[str, Any]] = []
        try:
            for turn, req in enumerate(session.requests):
                body = dict(req.body)
                messages = (
                    history + list(body["messages"]) if req.follows else list(body["messages"])
                )
                body["messages"] = messages
                if self.config.model is not None or "model" not in body:
                    # a workload file's own model is kept unless --model is given
                    body["model"] = self.model
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
                record = RequestRecord(
                    self._next_index, session.index, turn, req.cls, req.num_images, warmup, 0.0
                )
                self._next_index += 1
                self.records.append(record)
                await send_chat(self.client, "/v1/chat/completions", body, record, self._t0)
                progress.update(record.ok)
                if not record.ok:
                    break
                history = messages + [{"role": "assistant", "content": record.output_text}]
        finally:
            if limiter is not None:
                limiter.release()
