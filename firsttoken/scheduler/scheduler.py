"""The scheduler: one loop, one budget per step, lanes as policy.

Tokens, not phases: a request is ``num_computed_tokens`` chasing ``num_tokens``. Each step
(``schedule``):
  1. every running request that is decoding gets its one token;
  2. the lane policy chosen once from ``--scheduling`` (lanes.py) serves its lanes through
     ``serve_lane``, each lane's running prefills first, then admissions. ``ShortLongLanes``: the
     short lane's prefills take what they want (the step's first short prefill is granted whole: a
     short prompt is one step), then the long lane fills what is left, in its order (deadline or
     least-work), its vision work a few units per step (encoder_plan.py), and runs anyway after
     ``long_max_wait_steps`` steps held back (aging). ``FcfsLanes``, the seed's starting point: one
     FIFO queue, whole-prompt prefills, whole-image encodes.
How long a step may be is pacing.py's (time-bounded steps from the fitted cost model, throughput
steps while only the long lane has prefill work, token budgets when the bound is off); what may
queue and when its first token is due is admission.py's.

How many blocks a request needs to start, and whose a growth may take, is kv_admission.py's; when a
growth runs the pool dry, that victim is preempted by recompute, never swapped, and counted with its
cause. No tensors: ints, lists.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

from firsttoken.batch import RunnerOutput, ScheduledBatch, ScheduledChunk, StepFeatures
from firsttoken.config import CacheConfig, SchedulerConfig
from firsttoken.kv.block_manager import KVCacheManager
from firsttoken.scheduler.admission import Admission, place_work_s, remaining_work_s
from firsttoken.scheduler.budget import StepBudget
from firsttoken.scheduler.cost_model import CostModel
from firsttoken.scheduler.encoder_cache import EncoderCacheManager
from firsttoken.scheduler.encoder_plan import EncoderPlanner
from firsttoken.scheduler.kv_admission import KV_ADMISSIONS
from firsttoken.scheduler.lanes import LONG, SHORT, LaneQueues, lane_policy, long_order
from firsttoken.scheduler.outbox import RunnerOutbox
from firsttoken.scheduler.pacing import Pacing
from firsttoken.scheduler.report import LongLaneTime, scheduler_stats
from firsttoken.scheduler.request import Request, RequestStatus
from firsttoken.scheduler.step import StepDraft, StepReport
from firsttoken.types import AdmissionVerdict, EngineStats, FinishReason, PromptWork


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        max_model_len: int,
        encoder_capacity_tokens: int,
        cost_model: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        calibrating: bool = False,
    ) -> None:
        """``clock``: the engine's (monotonic seconds); the fleet simulator passes its virtual one.
        ``calibrating``: the engine's scratch scheduler while the cost model first learns
        (engine/calibration.py)."""
        self.config = config
        self.clock = clock
        # fed each step's features and wall time (update)
        self.cost_model = cost_model or CostModel()
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(
            num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.kv_admission = KV_ADMISSIONS[config.kv_admission](config, max_model_len)
        self.encoder_cache = EncoderCacheManager(encoder_capacity_tokens)
        self.lanes = lane_policy(config)  # the lane layout: routing and how a step serves the lanes
        self.waiting = LaneQueues(config)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every live request, waiting or running
        self.pacing = Pacing(
            config, self.lanes.time_bounded, self.block_size, self.cost_model, clock, calibrating
        )
        self.admission = Admission(
            config,
            self.kv,
            max_model_len,
            self.cost_model,
            lambda lane: len(self.waiting.queues[lane]),
            self.pacing.step_time_target,
            clock,
        )
        self.encoder = EncoderPlanner(self.encoder_cache, self.cost_model, self.requests)
        # predicted seconds of a request's remaining prefill and encoder work (from ``start``:
        # admission.py)
        self.remaining_work_s = partial(remaining_work_s, self.cost_model, self.encoder_cache)
        place_s = partial(
            place_work_s, self.cost_model, self.encoder_cache, self.kv, self.block_size
        )
        self.long_order = long_order(
            config, lambda: self.cost_model.is_fitted, place_s, self.remaining_work_s
        )
        self.num_steps = 0
        self.num_preemptions = 0
        self.preemptions_by_reason: dict[str, int] = {}
        # what the runner's next batch tells it besides the step's work
        self.outbox = RunnerOutbox()
        self.last_step = StepDraft()  # what the last schedule() built (report.wait_reason reads it)
        # steps while only the long lane had prefill work (report.py)
        self.long_lane_time = LongLaneTime()

    # ---- requests in and out ---------------------------------------------------------------------
    def check_admission(self, work: PromptWork, num_pending: int = 0,
                        pending: tuple[PromptWork, ...] = ()) -> AdmissionVerdict:
        """May a prompt like ``work`` queue now (admission.py)? Any thread may ask."""
        return self.admission.check(work, num_pending, pending)

    def add(self, request: Request) -> None:
        request.lane = self.lanes.route(request.num_prompt_tokens)
        request.arrival_step = self.num_steps
        request.queued_s = self.clock()
        if request.lane == SHORT:
            self.pacing.note_short_prompt(request.num_prompt_tokens)
        elif request.lane == LONG:
            self.long_order.admit(request)
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
        self._release(request)
        self.long_order.forget(request.request_id)
        if request.sent_to_runner:
            self.outbox.finished_ids.append(request.request_id)

    @property
    def has_work(self) -> bool:
        """Live requests to run."""
        return bool(len(self.waiting) or self.running)

    @property
    def needs_step(self) -> bool:
        """Requests to run, or runner state one more batch must release (finished requests, encoder
        outputs)."""
        return self.has_work or bool(self.outbox.finished_ids or self.encoder_cache.has_freed)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        decoding = [r for r in self.running if r.is_decoding]
        long_only = self._long_lane_only()
        budget, throughput = self.pacing.step_budget(decoding, long_only=long_only)
        step = StepDraft(throughput=throughput, long_only=long_only)
        for req in decoding:
            if req.status == RequestStatus.RUNNING and budget.remaining > 0:
                self._schedule_tokens(req, 1, budget, step)
                if req.status == RequestStatus.RUNNING:  # (not when it was preempted for its block)
                    self.pacing.count_decode(req)
        self.lanes.serve(self, budget, step)
        step.full = step.full or budget.exhausted
        self.waiting.count_short_delays(step.has_long_work, self.num_steps)
        told = self.outbox.take()
        step.preempted_ids = frozenset(told.preempted_ids)
        self.num_steps += int(bool(step.chunks or step.encoder_work))
        self.last_step = step
        pending = [r for r in self.requests.values() if not r.is_decoding]
        self.admission.observe_step(
            step, pending, len(self.requests), self.remaining_work_s, self.long_order.place_s
        )
        return ScheduledBatch(
            tuple(told.new),
            tuple(step.chunks),
            tuple(step.encoder_work),
            self.encoder_cache.pop_freed(),
            tuple(told.preempted_ids),
            tuple(told.finished_ids),
            budget.features,
        )

    def update(self, batch: ScheduledBatch | None, result: RunnerOutput | None,
               finished: Sequence[tuple[Request, FinishReason]] = (),
               started_s: float | None = None) -> StepReport | None:
        """Follow what happened since the last schedule: the runner's whole report of the step (with
        the encoder work it ran after the tokens went out: units run, images it holds nothing for,
        chunks run; a failed or skipped one computed nothing, one whose mask was pending all but its
        last token), then ``finished``, the requests the caller ended: on the step's tokens (already
        on their requests), or between steps with no batch and no result (an abort, a timeout). With
        ``started_s`` (when the step began, on this clock) its wall time to now, less the time it
        waited for grammar masks (``result.mask_wait_s``), teaches the cost model the work actually
        done (less units an interrupt cut), and the report says what the model predicted and the
        step's wall time."""
        if batch is None or result is None:
            for req, reason in finished:
                self.finish(req, reason)
            return None
        self.encoder.record(batch, result)
        for chunk in batch.chunks:
            rid = chunk.request_id
            if (
                rid not in result.failed
                and rid not in result.skipped_request_ids
                and rid in self.requests
            ):
                req = self.requests[rid]
                if rid in result.sampled and len(req.output_token_ids) == 1:
                    self.admission.observe_first_token(req, result.sample_done_s)
                self._on_chunk_done(
                    req, chunk, chunk.end - int(rid in result.mask_pending_request_ids)
                )
        for req, reason in finished:
            self.finish(req, reason)
        if started_s is None:
            return None
        duration_s = self.clock() - started_s
        features = self.encoder.features_run(batch, result)
        predicted = self.note_step_time(features, duration_s - result.mask_wait_s)
        # the model prices work, not waiting
        self.cost_model.observe(features, duration_s - result.mask_wait_s)
        return StepReport(
            predicted,
            duration_s,
            self.num_steps,
            self.kv.num_used_blocks,
            self.kv.num_blocks,
            len(self.running),
            len(self.waiting),
        )

    def note_step_time(self, features: StepFeatures, wall_s: float) -> float | None:
        """The last scheduled step ran ``features`` in ``wall_s`` (waiting for grammar masks not
        counted): counted for the long lane when only it had prefill work (report.py). Returns the
        cost model's price of the features (None before it is fitted). The simulator calls it with
        its virtual seconds."""
        if not self.cost_model.is_fitted:
            return None
        predicted = self.cost_model.predict(features)
        if self.last_step.long_only:
            self.long_lane_time.record(
                self.last_step.throughput, wall_s, predicted - float(self.cost_model.coef[0])
            )
        return predicted

    def _on_chunk_done(self, req: Request, chunk: ScheduledChunk, end: int) -> None:
        """KV for the chunk's tokens up to ``end`` counts as written (``chunk.end``, or one less
        where its mask was pending and nothing was sampled: that token runs again): publish full
        blocks, release images the prefill has passed."""
        req.num_computed_tokens = end
        if req.block_hashes:
            self.kv.cache_blocks(req.request_id, req.block_hashes, min(end, req.num_prompt_tokens))
        self.encoder.release_passed(req, end)

    # ---- lanes: what a lane policy serves a step through (lanes.LaneServer) ----------------------
    def _long_lane_only(self) -> bool:
        """The long lane has prefill work and the short lane none (pacing.py: the step may be sized
        for throughput; report.py counts these steps' time)."""
        names = self.lanes.names
        return (
            LONG in names
            and SHORT in names
            and self.has_prefill_work(LONG)
            and not self.has_prefill_work(SHORT)
        )

    def has_prefill_work(self, lane: str) -> bool:
        return bool(self.waiting.queues[lane]) or any(
            r.lane == lane and not r.is_decoding for r in self.running
        )

    def long_lane_budget(self, budget: StepBudget, step: StepDraft, aging: bool,
                         held_by_short: bool) -> StepBudget | None:
        return self.pacing.long_lane_budget(budget, step, aging, held_by_short,
                                            lambda: not self.has_prefill_work(SHORT))

    def mark_interruptible(self, step: StepDraft) -> None:
        self.encoder.mark_interruptible(step)

    def serve_lane(
        self, lane: str, budget: StepBudget, step: StepDraft, whole_prompt: bool
    ) -> bool:
        """Prefill work of one lane: running prefills first, then admissions, in arrival order. True
        if anything was scheduled. The long lane, in time-bounded and throughput steps, goes in its
        order: the deadline order serves running and waiting requests alike; least-work serves
        running prefills first, each in the order."""
        before = len(step.chunks) + len(step.encoder_work)
        ordered = lane == LONG and (budget.bounded or budget.whole_images)
        running = [r for r in self.running if r.lane == lane and not r.is_decoding]
        queue = self.waiting.queues[lane]

        # a step's first short prefill is whole (a short prompt is one step), time or not
        def out_of_budget() -> bool:
            if lane == SHORT and not step.has_short_prefill:
                return budget.remaining <= 0
            return budget.exhausted and not (whole_prompt and not step.has_prefill)

        if ordered and self.long_order.merged:
            self._serve_in_order(
                sorted(running + list(queue), key=self.long_order.key), budget, step, out_of_budget
            )
            return len(step.chunks) + len(step.encoder_work) > before
        if ordered:
            running.sort(key=self.long_order.key)
        for req in running:
            if req.request_id not in step.scheduled_ids and req.status == RequestStatus.RUNNING:
                if out_of_budget():
                    break
                self._prefill(req, budget, step, whole_prompt)
        while queue and len(self.running) < self.config.max_num_seqs:
            if out_of_budget():
                break
            req = min(queue, key=self.long_order.key) if ordered else queue[0]
            if whole_prompt and step.has_prefill and req.num_tokens > budget.remaining:
                # the seed's serial prefill: one whole prompt per step, more only if they fit beside
                # it
                break
            if not self._admit(req, budget, step, whole_prompt):
                break  # the lane's next request waits for KV; the wait shows as queue time
            self._prefill(req, budget, step, whole_prompt)
        served = len(step.chunks) + len(step.encoder_work) > before
        if ordered and served:
            self.long_order.after_serve(
                step.scheduled_ids,
                [r for r in self.running if r.lane == LONG and not r.is_decoding] + list(queue),
            )
        return served

    def _serve_in_order(self, ordered: list[Request], budget: StepBudget, step: StepDraft,
                        out_of_budget: Callable[[], bool]) -> None:
        """Each in turn gets its next chunk, a waiting one admitted first. Once one waits for KV,
        nobody after it is admitted (it keeps its turn), but running ones still fill the step."""
        admitting = True
        for req in ordered:
            if out_of_budget():
                break
            if req.status == RequestStatus.RUNNING:
                if req.request_id not in step.scheduled_ids:
                    self._prefill(req, budget, step, False)
            elif admitting and len(self.running) < self.config.max_num_seqs:
                if self._admit(req, budget, step, False):
                    self._prefill(req, budget, step, False)
                else:
                    admitting = False  # the wait shows as queue time

    # ---- admission and prefill -------------------------------------------------------------------
    def _admit(self, req: Request, budget: StepBudget, step: StepDraft, whole_prompt: bool) -> bool:
        num_cached = self.kv_admission.start(
            req, self.kv, None if whole_prompt else max(budget.remaining, 1)
        )
        if num_cached is None:
            step.kv_blocked_ids.add(req.request_id)
            return False
        self.waiting.remove(req)
        if not req.sent_to_runner:
            self.outbox.new.append(req.for_runner())
            req.sent_to_runner = True
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        req.count(
            "num_cached_prompt_tokens", max(0, num_cached - req.stats.num_cached_prompt_tokens)
        )
        self.running.append(req)
        return True

    def _prefill(
        self, req: Request, budget: StepBudget, step: StepDraft, whole_prompt: bool
    ) -> None:
        start = req.num_computed_tokens
        wanted = req.num_tokens - start
        whole_short = req.lane == SHORT and not step.has_short_prefill  # a short prompt is one step
        if whole_prompt:
            end = start + wanted
        elif whole_short:
            end = start + min(wanted, budget.remaining)
        else:
            end = start + budget.chunk_tokens(wanted, start, samples_at_end=True)
            # what the step has left fits none of it (wait_reason: step_full)
            step.full |= end == start
        window, ready = end - start, True
        # a throughput step runs the long lane first come, first served on the vision tower: a
        # request behind one whose prompt this step leaves unfinished starts no image (its encode
        # would delay that one's next chunk)
        behind = budget.whole_images and step.long_prefill_left
        for index, im in req.images_in(start, end):
            if behind and not self.encoder_cache.is_ready(im.content_hash):
                ready, end = False, im.offset
                break
            whole = whole_prompt or req.lane == SHORT or budget.encodes_whole
            ready = self.encoder.ensure(req, index, im, budget, step, all_units=whole)
            if not ready or (budget.whole_images and im.content_hash in step.finishing_hashes):
                # (in a throughput step, before an image encoded in it: that work stays
                # interruptible)
                end = im.offset
                break
        # the next chunk's images too, not cut before each of them
        if budget.whole_images and ready and not behind:
            self._encode_ahead(req, budget, step, end, end + window)
        if req.num_prompt_tokens >= self.config.long_prompt_threshold:
            step.has_long_work = True
        if not whole_prompt:
            end = min(
                end,
                start
                + (budget.remaining if whole_short else budget.chunk_tokens(wanted, start, True)),
            )
        if end > start:
            self._schedule_tokens(req, end - start, budget, step)
        if req.lane == LONG and end < req.num_tokens:
            step.long_prefill_left = True

    def _encode_ahead(
        self, req: Request, budget: StepBudget, step: StepDraft, lo: int, hi: int
    ) -> None:
        """In a throughput step, encode (whole, interruptible) the images of prompt range [lo, hi)
        too: the next step's chunk then spans them instead of stopping before each (a video's grids
        are many small images)."""
        for index, im in req.images_in(lo, hi):
            if budget.encoder_exhausted or not self.encoder.ensure(req, index, im, budget, step,
                                                                   all_units=budget.encodes_whole):
                break

    def _schedule_tokens(
        self, req: Request, num_new: int, budget: StepBudget, step: StepDraft
    ) -> None:
        if not self._ensure_blocks(req, req.num_computed_tokens + num_new, step):
            return
        start = req.num_computed_tokens
        is_decode = req.is_decoding
        before = budget.spent_s
        budget.take_chunk(
            num_new, start, samples=start + num_new == req.num_tokens, is_decode=is_decode
        )
        step.charge(req.request_id, req.lane, is_decode, budget.spent_s - before)
        if req.lane == SHORT and not is_decode:
            step.has_short_prefill = True
        step.scheduled_ids.add(req.request_id)
        step.chunks.append(
            ScheduledChunk(
                req.request_id,
                start,
                num_new,
                tuple(self.kv.block_table(req.request_id)),
                sample=start + num_new == req.num_tokens,
                is_decode=is_decode,
            )
        )
        req.stamp("first_scheduled_s")

    # ---- preemption ------------------------------------------------------------------------------
    def _ensure_blocks(self, req: Request, num_tokens: int, step: StepDraft) -> bool:
        """Grow req's block table to num_tokens; when the pool is dry, preempt a victim
        (kv_admission.py) until it fits. The preemption is labelled by its cause: the growth of a
        decode or of a prefill chunk (only optimistic admission lets a prefill grow). False when req
        itself was the victim."""
        cause = "decode_growth" if req.is_decoding else "prefill_growth"
        while self.kv.allocate(req.request_id, num_tokens) is None:
            victim = self.kv_admission.victim(self.running, req, step.scheduled_ids)
            self._preempt(victim, cause)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, reason: str) -> None:
        """Recompute, never swap: drop its KV, keep its tokens, send it to the front of its lane."""
        self.running.remove(req)
        self._release(req)  # (its token schedule restarts after the recompute)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.count("num_preemptions")
        self.num_preemptions += 1
        self.preemptions_by_reason[reason] = self.preemptions_by_reason.get(reason, 0) + 1
        self.outbox.preempted_ids.append(req.request_id)
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        """Its blocks, encoder pins and pace."""
        self.kv.free(req.request_id)
        self.encoder_cache.release_all(req.request_id)
        self.pacing.forget(req.request_id)

    # ---- work and what an operator sees ----------------------------------------------------------
    def stats(self) -> EngineStats:
        """The scheduler's part of the engine's stats (report.py)."""
        return scheduler_stats(self)

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        self.encoder_cache.check_invariants()

