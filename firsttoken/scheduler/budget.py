"""What one step may still hold: a small object you ask (``granted = budget.chunk_tokens(...)``),
instead of counters decremented in five places.

Two limits: tokens (``--max-batched-tokens``, a hard cap: the forward's memory) and predicted
seconds (the step-time target, priced by the CostModel; unlimited when time-bounding is off or the
model is not fitted yet). Every grant is the most that fits both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from firsttoken.batch import StepFeatures
from firsttoken.scheduler.cost_model import (
    CostModel,
    decode_chunk,
    encoder_units,
    prefill_chunk,
)
from firsttoken.types import EncoderUnit


class StepBudget:
    def __init__(self, num_tokens: int, seconds: float = math.inf, cost: CostModel | None = None,
                 whole_images: bool = False, target_s: float = math.inf, chunk_s: float = math.inf,
                 encoder_s: float = math.inf) -> None:
        """``whole_images``: a throughput step: encoder units are not charged to the token budget
        (which is the prefill chunk's alone) and, unless ``encoder_s`` is finite, not limited either
        (images are encoded whole); ``encoder_s``: predicted seconds of encoder units the step may
        hold then (a decoding answer waits for the step's vision work). ``target_s``: the step's
        bound, its per-step constant included (``seconds`` is what is left of it for work); shares
        are of it. ``chunk_s``: predicted seconds prefill chunks may take (priced whenever a fitted
        cost model prices grants)."""
        self.whole_images = whole_images
        # predicted seconds encoder units may still take (a throughput step)
        self.encoder_seconds = encoder_s
        self.target_s = target_s
        self.total = num_tokens
        self.remaining = num_tokens  # tokens
        self.total_seconds = seconds
        self.seconds = seconds  # predicted seconds left (inf: no time bound)
        fitted = cost is not None and cost.is_fitted
        # set: grants are bounded in time
        self.cost = cost if fitted and math.isfinite(seconds) else None
        # what prices grants
        self.pricer = cost if fitted and (self.cost is not None or whole_images) else None
        self.spent_s = 0.0  # predicted seconds taken so far (0 without a pricer)
        self.features = StepFeatures()  # everything taken so far
        # a chunk may always have this many tokens, time or not (progress guarantee)
        self.floor_tokens = 0
        # predicted seconds prefill chunks may still take (on top of ``seconds``)
        self.chunk_seconds = chunk_s

    @property
    def used(self) -> int:
        return self.total - self.remaining

    @property
    def exhausted(self) -> bool:
        return self.remaining <= 0 or self.seconds <= 0

    @property
    def encodes_whole(self) -> bool:
        """A throughput step whose images are encoded whole, however long that takes."""
        return self.whole_images and math.isinf(self.encoder_seconds)

    @property
    def encoder_exhausted(self) -> bool:
        """A throughput step's vision work has used its seconds."""
        return self.whole_images and self.encoder_seconds <= 0

    @property
    def bounded(self) -> bool:
        """Grants are bounded in predicted seconds (a time-bounded step with a fitted cost
        model)."""
        return self.cost is not None

    def grant_floor(self, num_tokens: int, share: float = 0.0) -> None:
        """Progress guaranteed: at least ``num_tokens`` tokens and ``share`` of the step's bound
        remain, a prefill chunk may always have ``num_tokens`` tokens, and the next encoder unit
        runs whatever it costs."""
        self.remaining = max(self.remaining, num_tokens)
        if share:
            self.seconds = max(self.seconds, share * self.target_s)
        self.floor_tokens = num_tokens

    def cap_chunks(self, share: float) -> None:
        """Prefill chunks may take at most ``share`` of the step's bound (the rest is for encoder
        units)."""
        self.chunk_seconds = share * self.target_s

    def absorb(self, part: StepBudget) -> None:
        """What a separate budget for part of this step (a lane's own) granted, taken from this one
        too."""
        self.remaining = max(0, self.remaining - part.used)
        self.features = self.features + part.features

    def price(self, features: StepFeatures) -> float:
        """Predicted seconds of adding ``features`` to a step (the per-step constant is paid once,
        not per item)."""
        if self.pricer is None:
            return 0.0
        return self.pricer.work_s(features)

    def chunk_tokens(self, wanted: int, context: int, samples_at_end: bool) -> int:
        """The most new tokens (<= wanted) of a prefill chunk at ``context`` that fit; 0 when none
        do."""
        n = min(wanted, self.remaining)
        seconds = min(self.seconds, self.chunk_seconds)
        if n <= 0 or self.pricer is None or math.isinf(seconds):
            return max(n, 0)
        floor = min(n, self.floor_tokens)
        if self.price(prefill_chunk(n, context, samples_at_end and n == wanted)) <= seconds:
            return n
        lo, hi = 0, n  # price grows with n: the largest n that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.price(prefill_chunk(mid, context, samples_at_end and mid == wanted)) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return max(lo, floor)

    def units(self, units: Sequence[EncoderUnit]) -> int:
        """How many of the leading encoder units fit: by predicted time when time-bounded (the
        vision tower does not use the forward's token budget), else by their token-equivalent
        cost."""
        if self.encodes_whole:
            return len(units)
        tokens, seconds = (
            self.remaining,
            self.encoder_seconds if self.whole_images else self.seconds,
        )
        # token budgets price the vision tower in tokens
        charged = self.cost is None and not self.whole_images
        for i, u in enumerate(units):
            if charged:
                tokens -= u.cost_tokens
            seconds -= self.price(encoder_units(u.num_patches, u.attention_pairs))
            if tokens < 0 or seconds < 0:
                return i
        return len(units)

    def take_chunk(self, num_new: int, context: int, samples: bool, is_decode: bool) -> None:
        features = decode_chunk(context) if is_decode else prefill_chunk(num_new, context, samples)
        if not is_decode:
            self.chunk_seconds -= self.price(features)
        self._take(features, num_new)

    def take_units(self, units: Sequence[EncoderUnit]) -> None:
        # token budgets price the vision tower in tokens
        charged = self.cost is None and not self.whole_images
        for u in units:
            before = self.spent_s
            self._take(
                encoder_units(u.num_patches, u.attention_pairs), u.cost_tokens if charged else 0
            )
            if self.whole_images:
                self.encoder_seconds -= self.spent_s - before

    def _take(self, features: StepFeatures, tokens: int) -> None:
        seconds = self.price(features)
        self.remaining -= tokens
        self.seconds -= seconds
        self.spent_s += seconds
        self.features = self.features + features
