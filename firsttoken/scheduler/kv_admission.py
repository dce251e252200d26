"""KV admission: the blocks a waiting request must get to start, and whose blocks a growth may take.

Chosen once from ``--kv-admission``. ``whole-prompt``: a request starts only when blocks for its
whole prompt plus ``decode_reserve_tokens`` are free, so no prefill is ever evicted halfway (a
prefill in progress owns its whole prompt's blocks and is never preempted: only decoders are).
``optimistic``: a request starts when its first chunk fits, and anyone running may be preempted.
Preemption itself (scheduler.py) is by recompute, never swap.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from firsttoken.config import SchedulerConfig
from firsttoken.kv.block_manager import KVCacheManager
from firsttoken.scheduler.request import Request


class WholePrompt:
    def __init__(self, config: SchedulerConfig, max_model_len: int) -> None:
        self.reserve = config.decode_reserve_tokens
        self.max_model_len = max_model_len

    def start(self, req: Request, kv: KVCacheManager, first_chunk: int | None) -> int | None:
        """Allocate the blocks ``req`` needs to start (``first_chunk``: the tokens it computes
        first; None: its whole prompt). Returns its prompt tokens found cached, or None when the
        blocks are not free."""
        if kv.enable_prefix_caching:
            req.ensure_block_hashes(kv.block_size)
        max_cached = req.num_prompt_tokens - 1  # at least one token is computed, to sample from
        if req.engine_request.sampling.prompt_logprobs is not None:
            max_cached = 0  # every prompt position is scored, so every one is computed
        want = self._tokens(req, kv, max_cached, first_chunk)
        return kv.allocate(req.request_id, want, req.block_hashes, max_cached)  # None: it did not fit

    def victim(self, running: Sequence[Request], req: Request, busy: Collection[str]) -> Request:
        """Whose blocks ``req``'s growth takes: the latest-admitted running request with no work in
        the step (``busy``: the runner will write theirs) and no promise; else ``req`` itself."""
        for other in reversed(running):
            if (
                other is not req
                and other.request_id not in busy
                and self._may_preempt(other.is_decoding)
            ):
                return other
        return req

    def _tokens(
        self, req: Request, kv: KVCacheManager, max_cached: int, first_chunk: int | None
    ) -> int:
        return min(req.num_tokens + self.reserve, self.max_model_len)

    def _may_preempt(self, decoding: bool) -> bool:
        return decoding


class Optimistic(WholePrompt):
    def _tokens(
        self, req: Request, kv: KVCacheManager, max_cached: int, first_chunk: int | None
    ) -> int:
        cached = kv.num_cached_prefix_tokens(req.block_hashes or [], max_cached)
        return min(
            cached + (req.num_tokens - cached if first_chunk is None else first_chunk),
            req.num_tokens,
        )

    def _may_preempt(self, decoding: bool) -> bool:
        return True


KV_ADMISSIONS = {"whole-prompt": WholePrompt, "optimistic": Optimistic}
