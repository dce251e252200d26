"""The predicted TTFT's own error, learnt online per class and divided out.

The admission check's prediction (Scheduler.predict_ttft) prices the work queued ahead of a request
and its own encode and prefill with the step-cost model. What it cannot see runs it low under load,
by an amount that depends on the class: later arrivals that overtake (short requests; in the long
lane smaller ones whose place in line comes first, and under the earlier least-remaining-work order
any smaller one), steps that scatter around their predicted time, image decoding and preprocessing
contending for the same cores (the uncorrected error per class: docs/performance.md, "Prediction
accuracy"). So every first token nudges a correction for its class:

    predicted = raw x exp(bias[class])           exp(bias) kept within [1 / MAX_FACTOR, MAX_FACTOR]
    bias[class] += step   if measured > predicted, else -= step            (--ttft-bias-step, 0.05)

with ``predicted`` the prediction as it was given at admission. A fixed step by the error's sign
(not its size) is a running median: the correction settles where half of a class's first tokens come
earlier than predicted and half later, which is what a median |error| target asks for, and one
request that waited behind an outlier moves it by one step only. At 0.05 a step, a prediction at
0.72x the truth is corrected in about 7 first tokens of the class (ln(1/0.72) / 0.05); with nothing
to correct it wanders by about a step. Classes are by number of images (0, 1, 2+): the classes whose
work, and whose overtakers, differ. ``measured`` is from the request's arrival to its first token,
as a client sees it.
"""

from __future__ import annotations

import math

from firsttoken.metrics.window import image_class

MAX_FACTOR = 3.0  # the correction never scales a prediction by more than this, either way


class TtftBias:
    def __init__(self, step: float, max_factor: float = MAX_FACTOR) -> None:
        self.step = step  # log-space change per first token; 0: no correction
        self.max_log = math.log(max_factor)
        self._log: dict[str, float] = {}  # class -> log of its factor, within the bounds

    def observe(
        self, num_images: int, predicted_s: float, measured_s: float, num_videos: int = 0
    ) -> None:
        """One first token: its class, the prediction given at admission, the TTFT measured from
        arrival."""
        if self.step <= 0 or not (predicted_s > 0 and measured_s > 0) or measured_s == predicted_s:
            return
        key = image_class(num_images, num_videos)
        log = self._log.get(key, 0.0) + (self.step if measured_s > predicted_s else -self.step)
        self._log[key] = max(-self.max_log, min(self.max_log, log))

    def factor(self, num_images: int, num_videos: int = 0) -> float:
        """What a raw prediction for this class is multiplied by (1.0 before its first
        observation)."""
        return math.exp(self._log.get(image_class(num_images, num_videos), 0.0))

    def as_dict(self) -> dict[str, float]:
        """class -> its factor, for the classes seen so far (/stats, /metrics)."""
        return {key: math.exp(log) for key, log in sorted(self._log.items())}
