"""The scheduler: one loop, one budget per step, lanes as policy.

Tokens, not phases: a request is ``num_computed_tokens`` chasing ``num_tokens``. Each step
(``schedule``):
  1. every running request that is decoding gets its one token;
  2. the lane policy chosen once from ``--scheduling`` (lanes.py) serves its lanes through the
     step filler's ``serve_lane`` (fill.py), each lane's running prefills first, then admissions.
     ``ShortLongLanes``: the short lane's prefills take what they want (the step's first short
     prefill is granted whole: a short prompt is one step), then the long lane fills what is left,
     in its order (deadline or least-work), its vision work a few units per step (encoder_plan.py),
     and runs anyway after ``long_max_wait_steps`` steps held back (aging). ``FcfsLanes``, the seed's starting point: one
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
from collections.abc import Callable
from functools import partial

from firsttoken.batch import RunnerOutput, ScheduledBatch, ScheduledChunk, StepFeatures
from firsttoken.config import CacheConfig, SchedulerConfig
from firsttoken.kv.block_manager import KVCacheManager
from firsttoken.scheduler.admission import Admission, place_work_s, remaining_work_s
from firsttoken.scheduler.cost_model import CostModel
from firsttoken.scheduler.encoder_cache import EncoderCacheManager
from firsttoken.scheduler.encoder_plan import EncoderPlanner
from firsttoken.scheduler.fill import StepFiller
from firsttoken.scheduler.kv_admission import KV_ADMISSIONS
from firsttoken.scheduler.lanes import LONG, SHORT, LaneQueues, lane_policy, long_order
from firsttoken.scheduler.outbox import RunnerOutbox
from firsttoken.scheduler.pacing import Pacing
from firsttoken.scheduler.report import LongLaneTime, scheduler_stats
from firsttoken.scheduler.request import Ended, Request, RequestStatus
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
        # what a lane policy serves a step through
        self.filler = StepFiller(
            config, self.lanes.names, self.running, self.waiting, self.kv, self.kv_admission,
            self.encoder, self.encoder_cache, self.pacing, self.long_order, self.outbox,
            self._preempt,
        )

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
        long_only = self.filler.long_lane_only()
        budget, throughput = self.pacing.step_budget(decoding, long_only=long_only)
        step = StepDraft(throughput=throughput, long_only=long_only)
        for req in decoding:
            if req.status == RequestStatus.RUNNING and budget.remaining > 0:
                self.filler.schedule_tokens(req, 1, budget, step)
                if req.status == RequestStatus.RUNNING:  # (not when it was preempted for its block)
                    self.pacing.count_decode(req)
        self.lanes.serve(self.filler, budget, step)
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

    def update(self, batch: ScheduledBatch, result: RunnerOutput,
               tokens: bool = True) -> Ended:
        """Follow the runner's report of a step: the encoder work it ran (units run, images it holds
        nothing for), and unless ``tokens`` is False (the report of the step's deferred encoder work
        alone: ``Executor.finish_step``) its chunks (a failed or skipped one computed nothing, one
        whose mask was pending all but its last token) with each sampled token appended to its
        request. Ends, and returns with why, what the report ends: the requests the runner failed
        (ERROR) and those whose new token ends them by their own token rule
        (``SamplingParams.finish_after``: STOP, LENGTH) or fills the context (LENGTH). What ends
        on the text (a stop string) or between steps, the caller ends with ``finish``."""
        self.encoder.record(batch, result)
        ended: Ended = []
        for chunk in batch.chunks if tokens else ():
            rid = chunk.request_id
            req = self.requests.get(rid)
            if req is None or rid in result.failed or rid in result.skipped_request_ids:
                continue
            token = result.sampled.get(rid)
            if token is not None and rid not in result.constraint_failed:
                reason = self._append_token(req, token, result.sample_done_s)
                if reason is not None:
                    ended.append((req, reason))
            self._on_chunk_done(req, chunk, chunk.end - int(rid in result.mask_pending_request_ids))
        for rid in dict.fromkeys((*result.failed, *result.constraint_failed)):
            if rid in self.requests:
                ended.append((self.requests[rid], FinishReason.ERROR))
        for req, reason in ended:
            self.finish(req, reason)
        return ended

    def learn_step(self, batch: ScheduledBatch, result: RunnerOutput,
                   started_s: float) -> StepReport:
        """The step's whole report (``result``: with its deferred encoder work's) and when it began
        (on this clock): its wall time to now, less the time it waited for grammar masks
        (``result.mask_wait_s``), teaches the cost model the work actually done (less units an
        interrupt cut); the report says what the model predicted and the step's wall time."""
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

    def _append_token(self, req: Request, token_id: int, sample_done_s: float) -> FinishReason | None:
        """The request's new token; why it ends the request, if it does."""
        req.output_token_ids.append(token_id)
        if len(req.output_token_ids) == 1:
            self.admission.observe_first_token(req, sample_done_s)
        reason = req.engine_request.sampling.finish_after(token_id, len(req.output_token_ids))
        if reason is None and req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return reason

    def _on_chunk_done(self, req: Request, chunk: ScheduledChunk, end: int) -> None:
        """KV for the chunk's tokens up to ``end`` counts as written (``chunk.end``, or one less
        where its mask was pending and nothing was sampled: that token runs again): publish full
        blocks, release images the prefill has passed."""
        req.num_computed_tokens = end
        if req.block_hashes:
            self.kv.cache_blocks(req.request_id, req.block_hashes, min(end, req.num_prompt_tokens))
        self.encoder.release_passed(req, end)

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

