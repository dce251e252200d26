"""Autoscaling a pool of engine replicas on queued requests: Ray Serve's controller calls
``QueuedRequestsPolicy`` every control-loop tick with what the replicas reported
(``EngineReplica.record_autoscaling_stats``: requests waiting in the engine and requests running,
aggregated over the look-back window) and what waits at the handles (requests the router could not
place: every replica at its capacity). Serve applies the bounds (``--replicas MIN:MAX``) and the
delays (``--upscale-delay``, ``--downscale-delay``) to what it returns.

    queued  = waiting in every replica's engine + waiting at the handles
    up      when queued > target x replicas: enough replicas that each has at most ``target`` queued
            (``--autoscale-target-queued``), assuming new replicas take the new arrivals
    down    by one, when nothing is queued and the replicas left would still run what runs now
            (running <= (replicas - 1) x --max-num-seqs)
    else    as many as now

Queued requests, not requests in flight, are what costs TTFT: a request waiting behind a replica's
prefill work is the one whose first token is late, while a replica decoding many requests at once is
doing its job. Nothing here imports Ray; the policy reads the context by attribute.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# replica metric: requests in its engine's queue (admitted, no prefill scheduled yet)
NUM_WAITING = "num_waiting"
# replica metric: requests its engine is running (prefilling or decoding)
NUM_RUNNING = "num_running"


def desired_replicas(
    current: int, queued: float, running: float, target_queued: float, max_num_seqs: int
) -> int:
    """How many replicas the pool should have, before Serve's bounds and delays (see the module's
    table). Serve scales a pool up from zero replicas itself, without asking the policy."""
    if queued > target_queued * current:
        return math.ceil(queued / target_queued)
    if queued <= 0 and current > 1 and running <= (current - 1) * max_num_seqs:
        return current - 1
    return current


class QueuedRequestsPolicy:
    """Ray Serve custom autoscaling policy
    (``AutoscalingPolicy(policy_function=QueuedRequestsPolicy, policy_kwargs= ...)``: Serve makes
    one per deployment and calls it with an ``AutoscalingContext`` each tick)."""

    def __init__(self, target_queued: float, max_num_seqs: int) -> None:
        if not target_queued > 0:
            raise ValueError("target_queued must be > 0")
        self.target_queued = float(target_queued)
        self.max_num_seqs = int(max_num_seqs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
        waiting = sum(metrics.get(NUM_WAITING, {}).values())
        running = sum(metrics.get(NUM_RUNNING, {}).values())
        at_handles = ctx.total_queued_requests or 0.0
        desired = desired_replicas(
            ctx.current_num_replicas,
            waiting + at_handles,
            running,
            self.target_queued,
            self.max_num_seqs,
        )
        return desired, {}
