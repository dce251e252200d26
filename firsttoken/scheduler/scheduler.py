"""The scheduler: one loop, one token budget per step, lanes as policy.

Tokens, not phases: a request is ``num_computed_tokens`` chasing ``num_tokens``. Each step:
  1. every running request that is decoding gets its one token;
  2. the short lane's prefills (running first, then admissions) take what they want of the budget;
  3. the long lane gets at most ``long_step_tokens`` of work, and only in steps without short prefill work,
     unless it has been held back ``long_max_wait_steps`` steps in a row (aging: long is never starved).
Long-lane work counts vision-tower work too: an image is encoded a few units per step (the model family's split,
e.g. one block per unit, each costing its token-equivalent against the same budget), so a short request never
waits for someone else's whole encode, only for one step.
``scheduling="fcfs"`` is the seed's starting point: one FIFO queue, whole-prompt prefills, whole-image encodes.

KV admission: with ``kv_admission="whole-prompt"`` a request starts only when blocks for its whole prompt plus
``decode_reserve_tokens`` are free, so no prefill is ever evicted halfway; "optimistic" admits when the next
chunk fits. When a decode's growth still runs the pool dry, the most recently admitted running request that holds no
promise (a decoder under whole-prompt admission; anyone under optimistic) is preempted by recompute, never swapped,
and counted with its cause; if there is none, the growing request itself. A request admitted whole-prompt is never
preempted before its prefill completes. No tensors here: everything is ints and lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from firsttoken.batch import (
    EncoderWork,
    NewRequest,
    RunnerOutput,
    ScheduledBatch,
    ScheduledChunk,
)
from firsttoken.config import CacheConfig, SchedulerConfig
from firsttoken.kv.block_manager import KVCacheManager
from firsttoken.kv.prefix_cache import ImageSpan, compute_block_hashes
from firsttoken.scheduler.budget import TokenBudget
from firsttoken.scheduler.encoder_cache import EncoderCacheManager
from firsttoken.scheduler.lanes import FCFS, LONG, SHORT, LaneQueues, route_lane
from firsttoken.scheduler.request import Request, RequestStatus
from firsttoken.types import AdmissionVerdict, FinishReason, ImageItem


@dataclass
class _Step:
    """What the step being built has collected so far."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    encoder_work: list[EncoderWork] = field(default_factory=list)
    worked_hashes: set[str] = field(default_factory=set)  # images advanced this step
    finishing_hashes: set[str] = field(default_factory=set)  # images whose last unit runs this step
    scheduled_ids: set[str] = field(default_factory=set)  # requests with a chunk or encoder work in this step
    has_long_work: bool = False

    @property
    def has_prefill(self) -> bool:
        return any(not c.is_decode for c in self.chunks)


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
        self.waiting = LaneQueues(config)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every live request, waiting or running
        self.num_steps = 0
        self.num_preemptions = 0
        self.preemptions_by_reason: dict[str, int] = {}
        self.num_short_delayed_by_long = 0  # short requests that waited a whole step while long work ran
        self.long_wait_steps = 0  # consecutive steps the long lane had work but was held back
        self._preempted: list[str] = []
        self._new: list[NewRequest] = []  # first admissions since the last batch: the runner's first sight
        self._finished_ids: list[str] = []  # requests the runner holds state for that finished since

    # ---- requests in and out -------------------------------------------------------------------------
    def check_admission(self, num_prompt_tokens: int, num_pending: int = 0) -> AdmissionVerdict:
        """May a request of this size queue? Cheap and side-effect free (the API asks before decoding images).
        num_pending: requests already promised a place in this prompt's lane but not yet queued here."""
        lane = route_lane(num_prompt_tokens, self.config)
        need = min(num_prompt_tokens + self.config.decode_reserve_tokens, self.max_model_len)
        if self.kv.blocks_needed(need) > self.kv.num_blocks or num_prompt_tokens >= self.max_model_len:
            return AdmissionVerdict(
                False, lane, "never_fits",
                f"the prompt has {num_prompt_tokens} tokens; with the {self.config.decode_reserve_tokens}-token "
                f"decode reserve it can never fit this server's KV cache ({self.kv.num_blocks * self.block_size} "
                f"tokens) or context ({self.max_model_len}); shorten the text or send fewer/smaller images",
                400,
            )
        depth = len(self.waiting.queues[lane]) + num_pending
        if depth >= self.config.max_queued_requests:
            return AdmissionVerdict(
                False, lane, "queue_full",
                f"the {lane} lane already has {depth} requests waiting (limit {self.config.max_queued_requests}); "
                "retry later",
                429,
            )
        return AdmissionVerdict.ok(lane)

    def add(self, request: Request) -> None:
        request.lane = route_lane(request.num_prompt_tokens, self.config)
        request.arrival_step = self.num_steps
        self.requests[request.request_id] = request
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
        self.requests.pop(request.request_id, None)
        self.kv.free(request.request_id)
        self.encoder_cache.release_all(request.request_id)
        if request.sent_to_runner:
            self._finished_ids.append(request.request_id)

    @property
    def has_work(self) -> bool:
        return bool(len(self.waiting) or self.running)

    @property
    def has_releases(self) -> bool:
        """Finished requests whose runner state one more batch must release."""
        return bool(self._finished_ids)

    # ---- one step ------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = TokenBudget(self.config.max_batched_tokens)
        step = _Step()
        for req in [r for r in self.running if _is_decoding(r)]:
            if req.status == RequestStatus.RUNNING and budget.remaining > 0:
                self._schedule_tokens(req, 1, budget, step)
        if self.config.scheduling == "fcfs":
            self._serve_lane(FCFS, budget, step, whole_prompt=True)
        else:
            short_work = self._serve_lane(SHORT, budget, step, whole_prompt=False)
            self._serve_long_lane(budget, step, held_by_short=short_work)
        self._count_short_delays(step)
        preempted, self._preempted = tuple(self._preempted), []
        new, self._new = tuple(self._new), []
        finished, self._finished_ids = tuple(self._finished_ids), []
        self.num_steps += int(bool(step.chunks or step.encoder_work))
        return ScheduledBatch(
            new, tuple(step.chunks), tuple(step.encoder_work), self.encoder_cache.pop_freed(), preempted, finished
        )

    def update(self, batch: ScheduledBatch, result: RunnerOutput) -> None:
        """Follow what the runner reports it did: encoder units actually run, images it holds nothing for, and
        the chunks it ran (a failed or skipped chunk computed nothing; it is scheduled again or its request is
        finished by the engine)."""
        for work in batch.encoder_work:
            h = work.content_hash
            if h in result.encoder_progress:
                self.encoder_cache.record_progress(h, result.encoder_progress[h])
        for h in result.discarded_encoder_hashes:
            self.encoder_cache.reset(h)
        for chunk in batch.chunks:
            rid = chunk.request_id
            if rid not in result.failed and rid not in result.skipped_request_ids and rid in self.requests:
                self._on_chunk_done(self.requests[rid], chunk)

    def _on_chunk_done(self, req: Request, chunk: ScheduledChunk) -> None:
        """KV for the chunk is written: publish full blocks, release images the prefill has passed."""
        req.num_computed_tokens = chunk.end
        if req.block_hashes:
            self.kv.cache_blocks(req.request_id, req.block_hashes, min(chunk.end, req.num_prompt_tokens))
        for im in req.images:
            if im.end <= chunk.end:
                self.encoder_cache.release(req.request_id, im.content_hash)

    # ---- lanes ---------------------------------------------------------------------------------------
    def _serve_long_lane(self, budget: TokenBudget, step: _Step, held_by_short: bool) -> None:
        has_work = bool(self.waiting.queues[LONG]) or any(
            r.lane == LONG and not _is_decoding(r) for r in self.running
        )
        if not has_work:
            self.long_wait_steps = 0
            return
        aging = self.long_wait_steps >= self.config.long_max_wait_steps
        if held_by_short and not aging:
            self.long_wait_steps += 1
            return
        share = self.config.long_step_tokens
        if self.config.long_step_tokens_idle is not None and self._short_lane_idle():
            share = self.config.long_step_tokens_idle  # nobody short to protect this step
        share = share if aging else min(share, budget.remaining)
        long_budget = TokenBudget(share)
        if self._serve_lane(LONG, long_budget, step, whole_prompt=False):
            self.long_wait_steps = 0
            budget.remaining = max(0, budget.remaining - long_budget.used)
        else:
            self.long_wait_steps += 1

    def _short_lane_idle(self) -> bool:
        return not self.waiting.queues[SHORT] and not any(
            r.lane == SHORT and not _is_decoding(r) for r in self.running
        )

    def _serve_lane(self, lane: str, budget: TokenBudget, step: _Step, whole_prompt: bool) -> bool:
        """Prefill work of one lane: running prefills first, then admissions. True if anything was scheduled."""
        before = len(step.chunks) + len(step.encoder_work)
        for req in [r for r in self.running if r.lane == lane and not _is_decoding(r)]:
            if req.request_id not in step.scheduled_ids and req.status == RequestStatus.RUNNING:
                if budget.remaining <= 0 and not (whole_prompt and not step.has_prefill):
                    break
                self._prefill(req, budget, step, whole_prompt)
        queue = self.waiting.queues[lane]
        while queue and len(self.running) < self.config.max_num_seqs:
            if budget.remaining <= 0 and not (whole_prompt and not step.has_prefill):
                break
            if whole_prompt and step.has_prefill and queue[0].num_tokens > budget.remaining:
                break  # the seed's serial prefill: one whole prompt per step, more only if they fit beside it
            req = queue[0]
            if not self._admit(req, budget, whole_prompt):
                break  # head of the lane waits for KV; the wait shows as queue time
            self._prefill(req, budget, step, whole_prompt)
        return len(step.chunks) + len(step.encoder_work) > before

    # ---- admission and prefill -----------------------------------------------------------------------
    def _admit(self, req: Request, budget: TokenBudget, whole_prompt: bool) -> bool:
        if req.block_hashes is None and self.kv.enable_prefix_caching:
            spans = [ImageSpan(im.content_hash, im.offset, im.num_tokens) for im in req.images]
            req.block_hashes = compute_block_hashes(req.prompt_token_ids, self.block_size, spans)
        max_cached = req.num_prompt_tokens - 1  # at least one token is computed, to sample from
        if self.config.kv_admission == "whole-prompt":
            want = min(req.num_tokens + self.config.decode_reserve_tokens, self.max_model_len)
        else:
            cached = self.kv.num_cached_prefix_tokens(req.block_hashes or [], max_cached)
            first_chunk = req.num_tokens - cached if whole_prompt else max(budget.remaining, 1)
            want = min(cached + first_chunk, req.num_tokens)
        if not self.kv.can_allocate(want, req.block_hashes, max_cached):
            return False
        num_cached = self.kv.allocate(req.request_id, want, req.block_hashes, max_cached)
        if num_cached is None:
            return False
        self.waiting.remove(req)
        if not req.sent_to_runner:
            er = req.engine_request
            self._new.append(NewRequest(req.request_id, er.prompt_token_ids, er.images, er.mrope_positions,
                                        er.mrope_delta, er.sampling))
            req.sent_to_runner = True
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        req.count("num_cached_prompt_tokens", max(0, num_cached - req.stats.num_cached_prompt_tokens))
        self.running.append(req)
        return True

    def _prefill(self, req: Request, budget: TokenBudget, step: _Step, whole_prompt: bool) -> None:
        start = req.num_computed_tokens
        wanted = req.num_tokens - start
        end = start + (wanted if whole_prompt else min(wanted, budget.remaining))
        for index, im in req.images_in(start, end):
            if not self._encoder_ready_for(req, index, im, budget, step, all_units=whole_prompt or req.lane == SHORT):
                end = im.offset
                break
        if req.num_prompt_tokens >= self.config.long_prompt_threshold:
            step.has_long_work = True
        if not whole_prompt:
            end = min(end, start + budget.remaining)
        if end > start:
            self._schedule_tokens(req, end - start, budget, step)

    def _encoder_ready_for(
        self, req: Request, index: int, im: ImageItem, budget: TokenBudget, step: _Step, all_units: bool
    ) -> bool:
        """Make sure the image's embeddings exist by the time this step's chunks run; schedule encoder units
        if needed. False when the image is still incomplete after this step (the chunk must stop before it)."""
        h = im.content_hash
        if not self.encoder_cache.is_pinned_by(req.request_id, h):
            if self.encoder_cache.acquire(req.request_id, h, im.num_tokens, len(im.encoder_units)):
                req.count("num_encoder_cache_hits")
        if self.encoder_cache.is_ready(h) and h not in step.worked_hashes:
            return True
        if h in step.finishing_hashes:
            return True
        if h in step.worked_hashes:
            return False  # another request advanced it this step and it is not done yet
        start = self.encoder_cache.units_done(h)
        costs = [u.cost_tokens for u in im.encoder_units[start:]]
        num_units = len(costs) if all_units else max(1, _units_within(costs, budget.remaining))
        budget.take(sum(costs[:num_units]))
        finishes = num_units >= len(costs)  # progress is recorded from the runner's report, in update()
        step.encoder_work.append(EncoderWork(req.request_id, index, h, start, num_units, finishes))
        step.worked_hashes.add(h)
        step.scheduled_ids.add(req.request_id)
        req.stamp("first_scheduled_s")
        if finishes:
            step.finishing_hashes.add(h)
        return finishes

    def _schedule_tokens(self, req: Request, num_new: int, budget: TokenBudget, step: _Step) -> None:
        if not self._ensure_blocks(req, req.num_computed_tokens + num_new, step):
            return
        budget.take(num_new)
        start = req.num_computed_tokens
        step.scheduled_ids.add(req.request_id)
        step.chunks.append(
            ScheduledChunk(
                request_id=req.request_id,
                context_len=start,
                num_new_tokens=num_new,
                block_table=tuple(self.kv.block_table(req.request_id)),
                sample=start + num_new == req.num_tokens,
                is_decode=_is_decoding(req),
            )
        )
        req.stamp("first_scheduled_s")

    def _ensure_blocks(self, req: Request, num_tokens: int, step: _Step) -> bool:
        """Grow req's block table to num_tokens; when the pool is dry, preempt a victim (see _pick_victim) until
        it fits. The preemption is labelled by its cause: the growth of a decode or of a prefill chunk (only
        optimistic admission lets a prefill grow). False when req itself was the victim."""
        cause = "decode_growth" if _is_decoding(req) else "prefill_growth"
        while self.kv.allocate(req.request_id, num_tokens) is None:
            victim = self._pick_victim(req, step)
            self._preempt(victim, cause)
            if victim is req:
                return False
        return True

    def _pick_victim(self, req: Request, step: _Step) -> Request:
        """The latest-admitted running request that has no work in this step (the runner will write its blocks)
        and whose blocks were not promised: under whole-prompt admission a prefill in progress owns its whole
        prompt's blocks and is never the victim. Else the growing request itself."""
        promised = self.config.kv_admission == "whole-prompt"
        for other in reversed(self.running):
            if other is req or other.request_id in step.scheduled_ids:
                continue
            if promised and not _is_decoding(other):
                continue
            return other
        return req

    def _preempt(self, req: Request, reason: str) -> None:
        """Recompute, never swap: drop its KV, keep its tokens, send it to the front of its lane."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        self.encoder_cache.release_all(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.count("num_preemptions")
        self.num_preemptions += 1
        self.preemptions_by_reason[reason] = self.preemptions_by_reason.get(reason, 0) + 1
        self._preempted.append(req.request_id)
        self.waiting.appendleft(req)

    def _count_short_delays(self, step: _Step) -> None:
        """The harmful event the seed saw: a short request that sat out a whole step while long work ran."""
        threshold = self.config.long_prompt_threshold
        for req in self.waiting:
            if req.num_prompt_tokens < threshold and req.arrival_step <= self.num_steps and step.has_long_work:
                if not req.delayed_by_long:
                    req.delayed_by_long = True
                    self.num_short_delayed_by_long += 1

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        self.encoder_cache.check_invariants()


def _units_within(costs: list[int], budget: int) -> int:
    """How many of the leading units fit in ``budget`` tokens."""
    total = 0
    for i, cost in enumerate(costs):
        total += cost
        if total > budget:
            return i
    return len(costs)


def _is_decoding(req: Request) -> bool:
    return bool(req.output_token_ids) and req.num_computed_tokens == req.num_tokens - 1
