"""What an operator sees of the scheduler: its part of ``EngineStats`` (/v1/engine/stats, /metrics,
doctor), and why a request got no work."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from firsttoken.scheduler.cost_model import prefill_chunk
from firsttoken.scheduler.request import Request
from firsttoken.types import EngineStats

LONG_LANE_SIZES = ("throughput", "bounded")  # how a long-lane-only step was sized (pacing.py)


@dataclass
class LongLaneTime:
    """Steps in which the long lane had prefill work and the short lane none, by how they were
    sized: their count, wall seconds and priced work (the cost model's seconds for what they ran, no
    per-step constant). What that work would take in throughput steps is
    ``work x (1 + per-step constant / a throughput chunk's price)``: the lane's speed alone; wall
    above it is the lane running below its throughput (doctor's ``long_lane`` finding)."""

    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LONG_LANE_SIZES, 0))
    wall_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LONG_LANE_SIZES, 0.0))
    work_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LONG_LANE_SIZES, 0.0))

    def record(self, throughput: bool, wall_s: float, work_s: float) -> None:
        sized = LONG_LANE_SIZES[0] if throughput else LONG_LANE_SIZES[1]
        self.steps[sized] += 1
        self.wall_s[sized] += wall_s
        self.work_s[sized] += max(work_s, 0.0)

    def report(self, per_step_s: float, chunk_s: float | None) -> dict[str, dict[str, float]]:
        """sized -> {steps, wall_s, at_throughput_s} (``chunk_s``: a throughput chunk's priced
        seconds; None before the cost model prices one: at_throughput_s is then the work alone)."""
        factor = 1.0 + per_step_s / chunk_s if chunk_s else 1.0
        return {
            k: {
                "steps": self.steps[k],
                "wall_s": self.wall_s[k],
                "at_throughput_s": self.work_s[k] * factor,
            }
            for k in LONG_LANE_SIZES
        }


# s: Scheduler (not imported: scheduler.py imports this module)
def scheduler_stats(s) -> EngineStats:
    """Everything but the runner's part (encoder bytes held, images encoded)."""
    kv, enc, cost = s.kv, s.encoder_cache, s.cost_model
    return EngineStats(
        kv_blocks_total=kv.num_blocks,
        kv_blocks_used=kv.num_used_blocks,
        kv_blocks_cached=kv.num_cached_blocks,
        kv_blocks_free=kv.num_free_blocks,
        block_size=kv.block_size,
        num_running=len(s.running),
        num_waiting=len(s.waiting),
        num_steps=s.num_steps,
        num_preemptions=s.num_preemptions,
        max_model_len=s.max_model_len,
        num_waiting_by_lane=s.waiting.depths(),
        preemptions_by_reason=dict(s.preemptions_by_reason),
        num_short_delayed_by_long=s.waiting.num_short_delayed_by_long,
        num_encoder_interrupts=s.encoder.num_interrupts,
        encoder_cache_hits=enc.num_hits,
        encoder_cache_misses=enc.num_misses,
        cost_model=cost.fit().as_dict() if cost.is_fitted else {},
        cost_model_coverage=cost.coverage,
        step_time_target_s=_finite_or_none(s.pacing.step_time_target()),
        itl_target_s=_finite_or_none(s.pacing.itl_bound()),
        ttft_bias=s.admission.ttft_bias.as_dict(),
        prefix_cache_hit_tokens=kv.num_prefix_hit_tokens,
        prefix_cache_query_tokens=kv.num_prefix_query_tokens,
        long_lane_only=_long_lane_only(s),
    )


def _long_lane_only(s) -> dict[str, dict[str, float]]:  # s: Scheduler
    cost = s.cost_model
    if not cost.is_fitted:
        return s.long_lane_time.report(0.0, None)
    chunk_s = cost.work_s(prefill_chunk(s.pacing.throughput_chunk_tokens(), 0, True))
    return s.long_lane_time.report(float(cost.coef[0]), chunk_s)


def wait_reason(s, req: Request) -> str:  # s: Scheduler
    """Why a live request got no work in the last schedule() (StepDraft.wait_reason)."""
    lane_of = lambda rid: s.requests[rid].lane if rid in s.requests else None  # noqa: E731
    return s.last_step.wait_reason(
        req, len(s.running) >= s.config.max_num_seqs, s.waiting.queues[req.lane], lane_of
    )


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None
