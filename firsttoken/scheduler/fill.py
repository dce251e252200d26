"""How one step is filled: the decodes' tokens and, as the lane policy drives it (lanes.py), each
lane's prefill work: running prefills first, then admissions, in arrival or the long lane's order; a
chunk's images encoded first (encoder_plan.py), the next chunk's ahead in a throughput step; and the
blocks each chunk needs, a victim preempted by recompute when the pool runs dry (kv_admission.py).

``StepFiller`` is the ``LaneServer`` a policy serves through. It reads and changes the scheduler's
own request state (``running``, ``waiting``: the same objects, never rebound) and caches; the
scheduler owns requests arriving and ending and what a step's report teaches.
"""

from __future__ import annotations

from collections.abc import Callable

from firsttoken.batch import ScheduledChunk
from firsttoken.config import SchedulerConfig
from firsttoken.kv.block_manager import KVCacheManager
from firsttoken.scheduler.budget import StepBudget
from firsttoken.scheduler.encoder_cache import EncoderCacheManager
from firsttoken.scheduler.encoder_plan import EncoderPlanner
from firsttoken.scheduler.kv_admission import WholePrompt
from firsttoken.scheduler.lanes import LONG, SHORT, LaneQueues, LongOrder
from firsttoken.scheduler.outbox import RunnerOutbox
from firsttoken.scheduler.pacing import Pacing
from firsttoken.scheduler.request import Request, RequestStatus
from firsttoken.scheduler.step import StepDraft


class StepFiller:
    def __init__(
        self,
        config: SchedulerConfig,
        lane_names: tuple[str, ...],
        running: list[Request],
        waiting: LaneQueues,
        kv: KVCacheManager,
        kv_admission: WholePrompt,
        encoder: EncoderPlanner,
        encoder_cache: EncoderCacheManager,
        pacing: Pacing,
        long_order: LongOrder,
        outbox: RunnerOutbox,
        preempt: Callable[[Request, str], None],
    ) -> None:
        """``preempt(victim, cause)``: the scheduler's recompute preemption (it keeps the counts)."""
        self.config = config
        self.lane_names = lane_names
        self.running = running
        self.waiting = waiting
        self.kv = kv
        self.kv_admission = kv_admission
        self.encoder = encoder
        self.encoder_cache = encoder_cache
        self.pacing = pacing
        self.long_order = long_order
        self.outbox = outbox
        self.preempt = preempt

    def long_lane_only(self) -> bool:
        """The long lane has prefill work and the short lane none (pacing.py: the step may be sized
        for throughput; report.py counts these steps' time)."""
        names = self.lane_names
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
            self.schedule_tokens(req, end - start, budget, step)
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

    def schedule_tokens(
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
            self.preempt(victim, cause)
            if victim is req:
                return False
        return True
