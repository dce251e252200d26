"""Encoder-unit planning: which vision-tower units of which image a step runs, which of them a short
arrival may cut, and what the runner reports it actually ran. Bookkeeping over the
``EncoderCacheManager``; no tensors.

An image's encode is the model family's units (a vision block, or a slice of a large block's query
rows), each priced by the cost model; a chunk may cover an image's tokens only once its last unit
has run, in this step or an earlier one. Work of the long lane whose image no chunk of the same step
covers is *interruptible*: the runner runs it last in the step and stops between units when a short
request is waiting, reporting the units done.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from firsttoken.batch import EncoderWork, RunnerOutput, ScheduledBatch, StepFeatures
from firsttoken.scheduler.budget import StepBudget
from firsttoken.scheduler.cost_model import CostModel, encoder_units
from firsttoken.scheduler.encoder_cache import EncoderCacheManager
from firsttoken.scheduler.lanes import LONG
from firsttoken.scheduler.request import Request
from firsttoken.scheduler.step import StepDraft
from firsttoken.types import EncoderUnit, ImageItem


class EncoderPlanner:
    def __init__(
        self, cache: EncoderCacheManager, cost_model: CostModel, requests: Mapping[str, Request]
    ) -> None:
        """``requests``: the scheduler's live requests by id (read, never changed here)."""
        self.cache = cache
        self.cost_model = cost_model
        self.requests = requests
        self.num_interrupts = 0  # steps whose long-lane encoder work a short arrival cut short

    def ensure(self, req: Request, index: int, im: ImageItem, budget: StepBudget, step: StepDraft,
               all_units: bool) -> bool:
        """Make sure the image's embeddings exist by the time this step's chunks run; schedule
        encoder units if needed (all of them with ``all_units``). False when the image is still
        incomplete after this step (the chunk must stop before it)."""
        h = im.content_hash
        if not self.cache.is_pinned_by(req.request_id, h):
            if self.cache.acquire(req.request_id, h, im.num_tokens, len(im.encoder_units)):
                req.count("num_encoder_cache_hits")
        if self.cache.is_ready(h) and h not in step.worked_hashes:
            return True
        if h in step.finishing_hashes:
            return True
        if h in step.worked_hashes:
            return False  # another request advanced it this step and it is not done yet
        start = self.cache.units_done(h)
        units = im.encoder_units[start:]
        num_units = len(units) if all_units else budget.units(units)
        if num_units == 0:
            # the long lane moves by at least a unit per step it runs in (progress), except past the
            # bound of a step that holds a short prefill: that step is the short request's time to
            # first token
            if step.has_short_prefill and not budget.floor_tokens:
                # it yielded this step to the short prefill (wait_reason: short_lane_first)
                step.long_held = True
                return False
            num_units = 1
        before = budget.spent_s
        budget.take_units(units[:num_units])
        step.charge(req.request_id, req.lane, False, budget.spent_s - before)
        # progress is recorded from the runner's report, in record()
        finishes = num_units >= len(units)
        step.encoder_work.append(EncoderWork(req.request_id, index, h, start, num_units, finishes))
        step.worked_hashes.add(h)
        step.scheduled_ids.add(req.request_id)
        req.stamp("first_scheduled_s")
        if finishes:
            step.finishing_hashes.add(h)
        return finishes

    def release_passed(self, req: Request, computed_len: int) -> None:
        """The request's prefill has computed ``computed_len`` prompt tokens: unpin the images
        wholly before that (an image sent twice is released after its last copy)."""
        last_end: dict[str, int] = {}
        for im in req.images:
            last_end[im.content_hash] = max(last_end.get(im.content_hash, 0), im.end)
        for h, end in last_end.items():
            if end <= computed_len:
                self.cache.release(req.request_id, h)

    def mark_interruptible(self, step: StepDraft) -> None:
        """Long-lane encoder work may be cut between units, unless a chunk of this step covers its
        image (that chunk needs the embeddings the work finishes); the step's cut span is what that
        work takes."""
        covered: set[str] = set()
        for c in step.chunks:
            if not c.is_decode:
                req = self.requests[c.request_id]
                covered.update(
                    im.content_hash
                    for im in req.images
                    if im.offset < c.end and im.end > c.context_len
                )
        step.encoder_work = [
            replace(w, interruptible=True)
            if self.requests[w.request_id].lane == LONG and w.content_hash not in covered else w
            for w in step.encoder_work
        ]
        units = [u for w in step.encoder_work if w.interruptible for u in self._units(w)]
        # what they take (the runner runs them last in the step)
        if units and self.cost_model.is_trained:
            span = self.cost_model.work_s(_features(units))
            step.cut_span = (span, span / len(units))

    def features_run(self, batch: ScheduledBatch, result: RunnerOutput) -> StepFeatures:
        """The work a step actually did: what it was scheduled with, less the encoder units an
        interrupt cut (what the cost model must learn the step's time from)."""
        features = batch.features
        for w in self._cut_work(batch, result):
            units = self.requests[w.request_id].images[w.image_index].encoder_units
            features = features - _features(
                units[
                    max(result.encoder_progress[w.content_hash], w.start_unit) : w.start_unit
                    + w.num_units
                ]
            )
        return features

    def record(self, batch: ScheduledBatch, result: RunnerOutput) -> None:
        """Follow what the runner reports of the step's encoder work: units actually run (an
        interrupt's cut work resumes next step from them), images it holds nothing for any more
        (back to zero units)."""
        self.num_interrupts += int(bool(self._cut_work(batch, result)))
        for work in batch.encoder_work:
            h = work.content_hash
            if h in result.encoder_progress:
                self.cache.record_progress(h, result.encoder_progress[h])
        for h in result.discarded_encoder_hashes:
            self.cache.reset(h)

    def _cut_work(self, batch: ScheduledBatch, result: RunnerOutput) -> list[EncoderWork]:
        def cut(w: EncoderWork) -> bool:
            end = w.start_unit + w.num_units
            return result.encoder_progress.get(w.content_hash, end) < end

        return [
            w
            for w in batch.encoder_work
            if w.interruptible
            and w.request_id not in result.failed
            and w.request_id in self.requests
            and cut(w)
        ]

    def _units(self, w: EncoderWork) -> tuple[EncoderUnit, ...]:
        return (
            self.requests[w.request_id]
            .images[w.image_index]
            .encoder_units[w.start_unit : w.start_unit + w.num_units]
        )


def _features(units: tuple[EncoderUnit, ...] | list[EncoderUnit]) -> StepFeatures:
    return encoder_units(sum(u.num_patches for u in units), sum(u.attention_pairs for u in units))
