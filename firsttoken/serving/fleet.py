"""The ingress's engine: an ``EngineClient`` (engine/client.py) over pools of engine replicas on Ray
Serve, so the ordinary HTTP app (api/server.py) serves a fleet unchanged: every check the API does
runs at the ingress before a replica is asked, and what comes back is the same stream of
``RequestOutput`` values.

Per request:
1. ``check_admission`` (asked by the input processor once the prompt's length is known from
   tokenization and image headers, before any image is decoded) picks the pool by counted length
   (routing.pool_for) and refuses
   - a prompt no replica can ever hold (400, the engine's own rule over the replicas' KV pool and
     context), and
   - any request when the pool is full (429 with Retry-After): every replica already holds its
     capacity (``max_num_seqs`` running + ``max_queued_per_replica`` waiting). The router never
     sends a replica more than its capacity (serving/router.py), so "in flight from this ingress ==
     replicas x capacity" means every replica is full. An autoscaled pool's bound is its *largest*
     size: what the replicas running now cannot hold waits at Serve's handle, which is the queue its
     autoscaler reads to add replicas (serving/autoscale.py). An admitted request holds its place
     until ``generate`` or ``release``.
2. ``generate`` sends it to the pool's handle with its ``RoutingHints`` (the router picks the
   replica) and streams the outputs. A replica that dies, or answers 503 because its engine stopped,
   before any output reached here: the request is sent again (Serve has dropped the dead replica; up
   to ``MAX_RESENDS`` times). After an output has been passed on, it ends with one retryable 503
   error output instead (never a hang, never a half answer dressed as complete). Closing the stream
   early (client gone) cancels the replica's call, which aborts the request in its engine.
3. ``stats`` is the sum over the fleet, refreshed by ``refresh_forever`` (a ``broadcast`` to every
   replica); the same refresh says whether any replica of each pool answers (``is_alive``, /health).

Threads: ``check_admission`` runs on the preprocessing pools, the rest on the ingress's event loop;
the pools' counts are read and changed under one lock.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

from ray.exceptions import RayActorError

from firsttoken.api.errors import RETRY_AFTER_S
from firsttoken.serving.options import ReplicaCount
from firsttoken.serving.replica import ENGINE_STOPPED, ReplicaFacts, ReplicaReport, error_output
from firsttoken.serving.router import HINTS_KWARG
from firsttoken.serving.routing import pool_for, routing_hints
from firsttoken.types import (
    AdmissionVerdict,
    EngineRequest,
    EngineStats,
    FinishReason,
    PromptWork,
    RequestOutput,
)

log = logging.getLogger("firsttoken.serving")

MAX_RESENDS = 2  # times a request that no replica started is sent again after its replica died
REFRESH_S = 1.0  # how often the fleet's stats are gathered
# a replica that has not answered a fan-out by then counts as not answering
BROADCAST_TIMEOUT_S = 10.0
# an admission place not claimed by generate() within this long is dropped
RESERVATION_TTL_S = 120.0
RETRYABLE = 503  # the status of a request that failed because its replica went away: send it again


@dataclass
class Pool:
    """One pool of engine replicas: its handle and its bound. ``capacity`` = requests one replica
    holds."""

    name: str
    handle: Any  # ray.serve.handle.DeploymentHandle to EngineReplica
    replicas: ReplicaCount
    capacity: int
    num_in_flight: int = 0
    # request id -> monotonic time admitted
    reservations: dict[str, float] = field(default_factory=dict)

    @property
    def limit(self) -> int:
        # an autoscaled pool: its largest size (see above)
        return self.replicas.high * self.capacity

    def num_held(self, now_s: float) -> int:
        for rid in [r for r, t in self.reservations.items() if now_s - t > RESERVATION_TTL_S]:
            # never handed over (client left between preprocessing and submit)
            del self.reservations[rid]
        return self.num_in_flight + len(self.reservations)


class FleetEngineClient:
    def __init__(self, pools: Mapping[str, Pool], facts: ReplicaFacts, long_prompt_threshold: int,
                 decode_reserve_tokens: int) -> None:
        self.pools = dict(pools)
        self.facts = facts
        self.long_prompt_threshold = long_prompt_threshold
        self.decode_reserve_tokens = decode_reserve_tokens
        self._alive = True
        self._lock = threading.Lock()  # guards every Pool's num_in_flight and reservations
        num_blocks = facts.kv_blocks_total * sum(p.replicas.low for p in self.pools.values())
        self._stats = EngineStats(
            num_blocks, 0, 0, num_blocks, facts.block_size, 0, 0, 0, 0, facts.max_model_len
        )
        # (until the first refresh: an idle fleet)

    # ---- EngineClient ----------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._alive

    @property
    def is_draining(self) -> bool:
        return False  # Serve drains the ingress itself on shutdown

    def pool_of(self, num_prompt_tokens: int) -> Pool:
        return self.pools[
            pool_for(num_prompt_tokens, self.long_prompt_threshold, tuple(self.pools))
        ]

    def check_admission(self, work: PromptWork, request_id: str | None = None) -> AdmissionVerdict:
        pool = self.pool_of(work.num_prompt_tokens)
        n = work.num_prompt_tokens
        need = min(n + self.decode_reserve_tokens, self.facts.max_model_len)
        if (
            math.ceil(need / self.facts.block_size) > self.facts.kv_blocks_total
            or n >= self.facts.max_model_len
        ):
            return AdmissionVerdict(
                False, pool.name, "never_fits",
                f"the prompt has {n} tokens; with the {self.decode_reserve_tokens}-token decode reserve it can never "
                f"fit a replica's KV cache ({self.facts.kv_blocks_total * self.facts.block_size} tokens) or context "
                f"({self.facts.max_model_len}); shorten the text or send fewer/smaller images", 400)
        with self._lock:
            now = time.monotonic()
            held = pool.num_held(now)
            if held >= pool.limit:
                return AdmissionVerdict(
                    False,
                    pool.name,
                    "queue_full",
                    f"every replica of the {pool.name} pool is full ({held} requests for {pool.replicas} "
                    f"replicas of {pool.capacity}); retry later",
                    429,
                    retry_after_s=float(RETRY_AFTER_S),
                )
            if request_id is not None:
                pool.reservations[request_id] = now
            return AdmissionVerdict.ok(pool.name)

    def release(self, request_id: str) -> None:
        with self._lock:
            for pool in self.pools.values():
                pool.reservations.pop(request_id, None)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        pool = self.pool_of(request.num_prompt_tokens)
        with self._in_flight(pool, request.request_id):
            hints = routing_hints(request, self.facts.block_size)
            for _ in range(1 + MAX_RESENDS):
                started = False
                stream = pool.handle.options(stream=True).generate.remote(
                    request, **{HINTS_KWARG: hints}
                )
                finished = False
                try:
                    async for out in stream:
                        if not started and _replica_stopped(out):
                            break  # nothing reached the client: send it again
                        started = True
                        finished = out.finished
                        yield out
                        if finished:
                            return
                except RayActorError as exc:  # the replica died or is unreachable
                    log.warning(
                        "replica lost during request %s (%s output passed on): %s",
                        request.request_id,
                        "some" if started else "no",
                        type(exc).__name__,
                    )
                finally:
                    if not finished:
                        # the client left, or we are resending: the replica aborts it
                        stream.cancel()
                if started:  # part of the answer is out: it cannot be sent again
                    yield error_output(request, ENGINE_STOPPED, RETRYABLE)
                    return
            message = "no engine replica could take the request; retry it"
            yield error_output(request, message, RETRYABLE)

    @contextmanager
    def _in_flight(self, pool: Pool, request_id: str) -> Iterator[None]:
        """The request counts in flight against ``pool``'s bound exactly while inside, and its
        admission place is given back on entry: however the body ends (an exception anywhere, the
        consumer cancelled at any await or closing the stream at a yield), the place is free
        again."""
        with self._lock:
            pool.reservations.pop(request_id, None)
            pool.num_in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                pool.num_in_flight -= 1

    async def abort(self, request_id: str) -> None:
        """Nothing to do here: closing ``generate``'s stream cancels the replica's call, which
        aborts it."""

    def stats(self) -> EngineStats:
        return self._stats

    # ---- the fleet's view ------------------------------------------------------------------------
    async def reports(self, method: str) -> list[ReplicaReport]:
        """Every live replica's answer to ``method`` ("stats" or "metrics"); replicas that fail are
        left out."""
        return [r for answers in await self._ask_every_replica(method) for r in answers]

    async def refresh(self) -> None:
        per_pool = await self._ask_every_replica("stats")
        self._alive = all(per_pool)  # every pool has a replica that answers
        reports = [r for answers in per_pool for r in answers]
        if reports:
            self._stats = sum_stats([r.stats for r in reports])

    async def _ask_every_replica(self, method: str) -> list[list[ReplicaReport]]:
        """Per pool, the reports of the replicas that answered ``method`` in time."""
        answers = await asyncio.gather(
            *(
                pool.handle.broadcast(method).results_async(
                    timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True
                )
                for pool in self.pools.values()
            ),
            return_exceptions=True,
        )
        return [
            [r for r in a if isinstance(r, ReplicaReport)] if isinstance(a, list) else []
            for a in answers
        ]

    async def refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("could not refresh the fleet's stats")
            await asyncio.sleep(REFRESH_S)


def _replica_stopped(out: RequestOutput) -> bool:
    return out.finish_reason is FinishReason.ERROR and out.error_status == RETRYABLE


_SAME = frozenset({"block_size", "max_model_len"})  # equal on every replica: kept, not summed


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The fleet as one engine: counts summed, per-key counts summed per key, the shared limits
    kept; the step-cost model and the prediction's bias are per replica and are left out."""
    values: dict[str, Any] = {}
    for f in fields(EngineStats):
        column = [getattr(s, f.name) for s in stats]
        if f.name in _SAME:
            values[f.name] = column[0]
        elif f.name in ("cost_model", "cost_model_coverage", "ttft_bias"):
            values[f.name] = {}
        elif f.name in ("step_time_target_s", "itl_target_s"):
            values[f.name] = None
        elif isinstance(column[0], dict):
            values[f.name] = _sum_counts(column)
        else:
            values[f.name] = sum(column)
    return EngineStats(**values)


def _sum_counts(column: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-key counts summed per key, nested ones (``long_lane_only``: sized -> counts) per leaf."""
    merged: dict[str, Any] = {}
    for d in column:
        for k, v in d.items():
            if isinstance(v, dict):
                merged[k] = _sum_counts([merged.get(k, {}), v])
            else:
                merged[k] = merged.get(k, 0) + v
    return merged
