"""The predicted TTFT's learnt correction (scheduler/ttft_bias.py): per class, a running median of measured /
predicted by fixed steps, bounded, off at step 0; the scheduler's prediction carries it; first tokens teach it."""

from __future__ import annotations

import math

import pytest

from firsttoken.scheduler.cost_model import FEATURE_NAMES, CostModel
from firsttoken.scheduler.ttft_bias import MAX_FACTOR, TtftBias
from firsttoken.types import PromptWork
from tests.unit.fakes import make_scheduler


def _serve(bias: TtftBias, images: int, raw_s: float, truth: float, n: int) -> None:
    """n first tokens of a class whose raw prediction is raw_s and whose TTFT is truth x raw_s."""
    for _ in range(n):
        bias.observe(images, raw_s * bias.factor(images), truth * raw_s)


def test_a_class_that_runs_late_by_a_steady_factor_is_corrected_to_it_and_the_others_are_left_alone() -> None:
    bias = TtftBias(step=0.05)
    _serve(bias, images=3, raw_s=10.0, truth=1 / 0.72, n=7)  # three images: predicted 0.72 of measured
    assert bias.factor(3) == pytest.approx(math.exp(7 * 0.05))  # seven steps up, each by the sign, not the size
    _serve(bias, images=3, raw_s=10.0, truth=1 / 0.72, n=40)
    assert abs(math.log(bias.factor(3) * 0.72)) <= 0.05  # settles within a step of the truth
    assert bias.factor(2) == bias.factor(3)  # 2+ images: one class
    assert bias.factor(0) == bias.factor(1) == 1.0  # never observed: uncorrected
    assert set(bias.as_dict()) == {"2+"}


def test_one_outlier_moves_the_correction_one_step_and_the_factor_is_bounded() -> None:
    bias = TtftBias(step=0.05)
    bias.observe(1, predicted_s=1.0, measured_s=100.0)  # one request stuck behind something unforeseen
    assert bias.factor(1) == pytest.approx(math.exp(0.05))
    for _ in range(200):
        bias.observe(0, predicted_s=1.0, measured_s=0.01)
    assert bias.factor(0) == pytest.approx(1 / MAX_FACTOR)


def test_step_zero_is_no_correction() -> None:
    bias = TtftBias(step=0.0)
    _serve(bias, images=1, raw_s=2.0, truth=2.0, n=50)
    assert bias.factor(1) == 1.0 and bias.as_dict() == {}


def test_the_schedulers_prediction_carries_its_classs_correction() -> None:
    costs = {"step": 0.010, "prefill_tokens": 0.001}
    sched = make_scheduler(num_blocks=512, max_batched_tokens=4096, step_time_target="0.25",
                           cost_model=CostModel(prior=tuple(costs.get(n, 0.0) for n in FEATURE_NAMES)))
    text, photo = PromptWork(120), PromptWork(400, num_images=1)
    raw_text, raw_photo = sched.admission.predict_ttft(text), sched.admission.predict_ttft(photo)
    for _ in range(4):
        sched.admission.observe_ttft(1, predicted_s=raw_photo, measured_s=2 * raw_photo)
    assert sched.admission.predict_ttft(photo) == pytest.approx(raw_photo * math.exp(4 * 0.05))  # the default step
    assert sched.admission.predict_ttft(text) == raw_text
    assert sched.check_admission(photo).predicted_ttft_s == pytest.approx(sched.admission.predict_ttft(photo))
