"""Metrics as plain data: what one engine step did and how one request went. Exporters read these;
nothing on the hot path imports prometheus_client."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class StepStats:
    step: int
    start_s: float  # monotonic
    duration_s: float  # schedule + execute + update
    # what the step-cost model predicted before it ran (None: not fitted yet)
    predicted_s: float | None
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_images_encoded: int
    encoder_s: float
    num_preempted: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int


@dataclass(frozen=True)
class FinishedRequest:
    """One finished request: its outcome, sizes and timeline report (Timeline.to_dict())."""

    request_id: str
    outcome: str  # stop | length | abort | error
    num_prompt_tokens: int
    num_image_tokens: int
    num_images: int  # images and video grids (vision items)
    num_output_tokens: int
    lane: str
    timings: dict[str, float | int | None]
    num_videos: int = 0


class StatsObserver(Protocol):
    """Receives metrics data from the engine thread. Must be cheap and must not raise."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_finished(self, request: FinishedRequest) -> None: ...


class NullObserver:
    def on_step(self, stats: StepStats) -> None:
        pass

    def on_finished(self, request: FinishedRequest) -> None:
        pass


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state read at scrape / /stats time: live gauges and the engine's own cumulative
    counters (the API layer fills it from EngineStats; exporters read only this)."""

    kv_blocks_used: int
    kv_blocks_total: int
    num_running: int
    num_queued_by_lane: dict[str, int]
    encoder_cache_bytes: int
    preemptions_by_reason: dict[str, int]
    # short-lane requests that sat out a whole step while long work ran
    num_short_delayed_by_long: int
    encoder_cache_hits: int
    encoder_cache_misses: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    cost_model: dict[str, float] = field(default_factory=dict)  # step-cost coefficients by term
    # term -> steps, max
    cost_model_coverage: dict[str, dict[str, float]] = field(default_factory=dict)
    step_time_target_s: float | None = None
    itl_target_s: float | None = None
    # images class -> the predicted TTFT's learnt factor
    ttft_bias: dict[str, float] = field(default_factory=dict)
    block_size: int = 16  # tokens per KV block
    num_encoder_interrupts: int = 0  # steps whose long-lane encoder work a short arrival cut short
    # sized ("throughput" | "bounded") -> steps, wall_s, at_throughput_s of the steps in which only
    # the long lane had prefill work (EngineStats.long_lane_only)
    long_lane_only: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def kv_usage_ratio(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
