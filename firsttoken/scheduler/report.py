"""What an operator sees of the scheduler: its part of ``EngineStats`` (/v1/engine/stats, /metrics, doctor), and
why a request got no work."""

from __future__ import annotations

import math
from firsttoken.scheduler.request import Request
from firsttoken.types import EngineStats


def scheduler_stats(s) -> EngineStats:  # s: Scheduler (not imported: scheduler.py imports this module)
    """Everything but the runner's part (encoder bytes held, images encoded)."""
    kv, enc, cost = s.kv, s.encoder_cache, s.cost_model
    return EngineStats(
        kv_blocks_total=kv.num_blocks, kv_blocks_used=kv.num_used_blocks, kv_blocks_cached=kv.num_cached_blocks,
        kv_blocks_free=kv.num_free_blocks, block_size=kv.block_size, num_running=len(s.running),
        num_waiting=len(s.waiting), num_steps=s.num_steps, num_preemptions=s.num_preemptions,
        max_model_len=s.max_model_len, num_waiting_by_lane=s.waiting.depths(),
        preemptions_by_reason=dict(s.preemptions_by_reason),
        num_short_delayed_by_long=s.waiting.num_short_delayed_by_long,
        num_encoder_interrupts=s.encoder.num_interrupts, encoder_cache_hits=enc.num_hits,
        encoder_cache_misses=enc.num_misses, cost_model=cost.fit().as_dict() if cost.is_fitted else {},
        cost_model_coverage=cost.coverage, step_time_target_s=_finite_or_none(s.pacing.step_time_target()),
        itl_target_s=_finite_or_none(s.pacing.itl_bound()), ttft_bias=s.admission.ttft_bias.as_dict(),
        prefix_cache_hit_tokens=kv.num_prefix_hit_tokens, prefix_cache_query_tokens=kv.num_prefix_query_tokens,
    )


def wait_reason(s, req: Request) -> str:  # s: Scheduler
    """Why a live request got no work in the last schedule() (StepDraft.wait_reason)."""
    lane_of = lambda rid: s.requests[rid].lane if rid in s.requests else None  # noqa: E731
    return s.last_step.wait_reason(req, len(s.running) >= s.config.max_num_seqs, s.waiting.queues[req.lane], lane_of)


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None
