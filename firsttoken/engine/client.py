"""What the HTTP layer may ask of the engine. The API depends on this protocol only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Protocol

from firsttoken.engine.request import EngineRequest, RequestOutput

if TYPE_CHECKING:
    from firsttoken.scheduler.lanes import AdmissionVerdict


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /stats-style endpoints and tests: is memory back, who is waiting."""

    kv_blocks_total: int
    kv_blocks_used: int  # referenced by a live request
    kv_blocks_cached: int  # unreferenced but holding a reusable prefix (evictable, counted as free)
    kv_blocks_free: int  # total - used
    block_size: int
    num_running: int
    num_waiting: int
    num_steps: int
    num_preemptions: int
    max_model_len: int
    num_waiting_by_lane: dict[str, int] = field(default_factory=dict)
    preemptions_by_reason: dict[str, int] = field(default_factory=dict)
    num_short_delayed_by_long: int = 0  # short requests that sat out a whole step while long work ran
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    encoder_cache_bytes: int = 0
    num_images_encoded: int = 0  # images the vision tower ran for since start (encoder cache misses computed)
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0


class EngineClient(Protocol):
    @property
    def is_alive(self) -> bool: ...

    @property
    def is_draining(self) -> bool:
        """Shutting down: in-flight requests finish, new ones are refused (503) and /health says 503."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and iterate over its outputs; the last one has finished=True.
        Cancelling the iterating task (client disconnect) aborts the request and frees its blocks."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def check_admission(self, num_prompt_tokens: int, request_id: str | None = None) -> "AdmissionVerdict":
        """May a prompt of this size queue now? Asked before any image is decoded; refusals carry a reason
        (a metric label), a client message and an HTTP status (400 never fits, 429 lane queue full). With a
        request_id an admitted request holds its place until generate() or release()."""
        ...

    def release(self, request_id: str) -> None: ...
