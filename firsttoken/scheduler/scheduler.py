"""The scheduler: each step, running requests first, then waiting ones, into one token budget.

Tokens, not phases: a running request asks for ``num_tokens - num_computed_tokens`` (1 for a decode, the rest
of its prompt for a prefill) and gets ``budget.take(min(wanted, chunk cap))``; chunked prefill falls out of
that. A waiting request is admitted only when the KV pool can hold its whole prompt plus a decode reserve
(whole-prompt admission), so no prefill is ever evicted halfway; if decode growth still runs the pool dry,
the most recently admitted running request is preempted by recompute (it loses the least work in flight and
is the latest arrival, so FCFS order is kept) and counted. No tensors here: everything is ints and lists.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from firsttoken.config import CacheConfig, SchedulerConfig
from firsttoken.engine.request import FinishReason
from firsttoken.kv.block_manager import KVCacheManager
from firsttoken.kv.prefix_cache import ImageSpan, compute_block_hashes
from firsttoken.scheduler.batch import ScheduledBatch, ScheduledChunk
from firsttoken.scheduler.budget import TokenBudget
from firsttoken.scheduler.encoder_cache import EncoderCacheManager
from firsttoken.scheduler.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerCounters:
    num_steps: int
    num_preemptions: int


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        max_model_len: int,
        encoder_capacity_tokens: int,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.encoder_cache = EncoderCacheManager(encoder_capacity_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self._preempted: list[str] = []

    # ---- requests in and out -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Stop a request wherever it is; frees its blocks and encoder pins at once."""
        if request.status == RequestStatus.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv.free(request.request_id)
        self.encoder_cache.release_all(request.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = TokenBudget(self.config.max_batched_tokens)
        chunks: list[ScheduledChunk] = []
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            chunk = self._schedule_running(req, budget)
            if chunk is not None:
                chunks.append(chunk)
        while self.waiting and budget.remaining > 0 and len(self.running) < self.config.max_num_seqs:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break  # head of the queue waits for KV; its wait is queue time
            chunks.append(chunk)
        preempted, self._preempted = tuple(self._preempted), []
        self.num_steps += int(bool(chunks))
        return ScheduledBatch(tuple(chunks), self.encoder_cache.pop_freed(), preempted)

    def on_chunk_done(self, chunk: ScheduledChunk) -> None:
        """KV for the chunk is written: publish full blocks, release images the prefill has passed."""
        req = chunk.request
        req.num_computed_tokens = chunk.end
        if req.block_hashes:
            self.kv.cache_blocks(req.request_id, req.block_hashes, min(chunk.end, req.num_prompt_tokens))
        for im in req.images:
            if im.end <= chunk.end:
                self.encoder_cache.release(req.request_id, im.content_hash)

    # ---- internals -----------------------------------------------------------------------------------
    def _schedule_running(self, req: Request, budget: TokenBudget) -> ScheduledChunk | None:
        wanted = req.num_tokens - req.num_computed_tokens
        num_new = budget.take(wanted)
        if num_new == 0:
            return None
        while self.kv.allocate(req.request_id, req.num_computed_tokens + num_new) is None:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                budget.remaining += num_new
                return None
        return self._chunk(req, num_new)

    def _admit(self, req: Request, budget: TokenBudget) -> ScheduledChunk | None:
        if req.block_hashes is None and self.kv.enable_prefix_caching:
            spans = [ImageSpan(im.content_hash, im.offset, im.num_tokens) for im in req.images]
            req.block_hashes = compute_block_hashes(req.prompt_token_ids, self.block_size, spans)
        reserve_tokens = min(req.num_tokens + self.config.decode_reserve_tokens, self.max_model_len)
        max_cached = req.num_prompt_tokens - 1  # at least one token is computed, to sample from
        if not self.kv.can_allocate(reserve_tokens, req.block_hashes, max_cached):
            return None
        num_cached = self.kv.allocate(req.request_id, reserve_tokens, req.block_hashes, max_cached)
        assert num_cached is not None  # can_allocate said yes and nothing ran in between
        self.waiting.popleft()
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        req.timeline.num_cached_prompt_tokens = max(req.timeline.num_cached_prompt_tokens, num_cached)
        self.running.append(req)
        num_new = budget.take(req.num_tokens - num_cached)
        if num_new == 0:
            return None
        return self._chunk(req, num_new)

    def _chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
        to_encode = []
        for im in req.images_in(start, end):
            if self.encoder_cache.is_pinned_by(req.request_id, im.content_hash):
                continue
            if not self.encoder_cache.acquire(req.request_id, im.content_hash, im.num_tokens):
                to_encode.append(im)
            else:
                req.timeline.num_encoder_cache_hits += 1
        is_decode = bool(req.output_token_ids) and start == req.num_tokens - 1
        return ScheduledChunk(
            request=req,
            context_len=start,
            num_new_tokens=num_new,
            block_table=tuple(self.kv.block_table(req.request_id)),
            encoder_inputs=tuple(to_encode),
            sample=end == req.num_tokens,
            is_decode=is_decode,
        )

    def _preempt(self, req: Request) -> None:
        """Recompute, never swap: drop its KV, keep its tokens, send it to the front of the queue."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        self.encoder_cache.release_all(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.timeline.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted.append(req.request_id)
        self.waiting.appendleft(req)

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        self.encoder_cache.check_invariants()
