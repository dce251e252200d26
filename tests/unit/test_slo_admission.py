"""Degrade, then refuse: over its class's TTFT objective, a request's images (those whose budget the client left to
the server) are re-planned at smaller budgets, from headers only, down to --image-min-tokens-under-load; if the
prediction is still over, the refusal is a 429 with the predicted wait. The engine's verdicts are scripted here."""

from __future__ import annotations

import pytest

import time
from types import SimpleNamespace

from firsttoken.api.intake import AdmissionRefused, Intake
from firsttoken.types import AdmissionVerdict, PromptWork
from tests.helpers import make_processor
from tests.unit.test_processor import chat, image, png_url, text


class ScriptedEngine:
    """Predicts a TTFT proportional to the prompt's visual work; over ``slo_s`` it says over_slo."""

    def __init__(self, seconds_per_patch: float, slo_s: float) -> None:
        self.seconds_per_patch = seconds_per_patch
        self.slo_s = slo_s
        self.asked: list[PromptWork] = []

    def __call__(self, work: PromptWork, request_id: str | None) -> AdmissionVerdict:
        self.asked.append(work)
        predicted = 0.5 + work.encoder_patches * self.seconds_per_patch / 100
        if predicted > self.slo_s:
            return AdmissionVerdict(False, "long", "over_slo", "busy", 429, predicted, predicted - self.slo_s)
        return AdmissionVerdict.ok("short", predicted)


@pytest.fixture()
def processor(tiny_model_dir):
    return make_processor(tiny_model_dir, 8192, image_max_tokens=1024, image_min_tokens_under_load=64)


def process(processor, req, engine):
    """The request through the server's intake, its admission asked of ``engine``."""
    intake = Intake(processor, SimpleNamespace(check_admission=engine))
    return intake.request(req.prompts()[0], req.to_sampling(), "r1", time.monotonic())


def test_the_budget_is_lowered_step_by_step_until_the_prediction_fits(processor):
    engine = ScriptedEngine(seconds_per_patch=0.05, slo_s=2.0)
    er = process(processor, chat(image(png_url(896, 896)), text("What is this?")), engine)
    budgets = [w.num_prompt_tokens for w in engine.asked]
    assert budgets == sorted(budgets, reverse=True) and len(engine.asked) >= 2  # asked again after each step
    assert er.images[0].num_tokens <= 256 < 1024  # 1024 -> 512 -> 256: the first plan whose prediction fits
    assert er.predicted_ttft_s is not None and er.predicted_ttft_s <= 2.0
    assert "lowered from 1024 to" in er.image_budget_note


def test_at_the_floor_it_refuses_with_the_predicted_wait(processor):
    engine = ScriptedEngine(seconds_per_patch=1.0, slo_s=2.0)  # nothing fits
    with pytest.raises(AdmissionRefused) as err:
        process(processor, chat(image(png_url(896, 896)), text("What is this?")), engine)
    verdict = err.value.verdict
    assert verdict.status == 429 and verdict.reason == "over_slo" and verdict.retry_after_s > 0
    assert engine.asked[-1].encoder_patches <= 64 * 4 * 2  # it went down to the floor first


def test_a_request_that_chose_its_detail_is_not_degraded_but_refused(processor):
    engine = ScriptedEngine(seconds_per_patch=0.05, slo_s=2.0)
    for part in ({"type": "image_url", "image_url": {"url": png_url(896, 896), "detail": "high"}},
                 {"type": "image_url", "image_url": {"url": png_url(896, 896), "max_visual_tokens": 1024}}):
        engine.asked.clear()
        with pytest.raises(AdmissionRefused):
            process(processor, chat(part, text("What is this?")), engine)
        assert len(engine.asked) == 1  # asked once: nothing of its own may be lowered


def test_text_over_its_objective_is_refused_at_once(processor):
    engine = ScriptedEngine(seconds_per_patch=0.0, slo_s=0.1)  # 0.5 s predicted for anything
    with pytest.raises(AdmissionRefused):
        process(processor, chat("hello"), engine)
    assert len(engine.asked) == 1


class MarginEngine(ScriptedEngine):
    """Admits everything under ``slo_s``, but says lower the budget while the visual work is over ``aim_s``."""

    def __init__(self, seconds_per_patch: float, slo_s: float, aim_s: float) -> None:
        super().__init__(seconds_per_patch, slo_s)
        self.aim_s = aim_s

    def __call__(self, work: PromptWork, request_id: str | None) -> AdmissionVerdict:
        verdict = super().__call__(work, request_id)
        if verdict.admitted and work.num_images and verdict.predicted_ttft_s > self.aim_s:
            return AdmissionVerdict.ok(verdict.lane, verdict.predicted_ttft_s, lower_budget=True)
        return verdict


def test_admitted_but_asked_to_lower_it_the_budget_comes_down_until_the_margin_fits(processor):
    engine = MarginEngine(seconds_per_patch=0.05, slo_s=100.0, aim_s=2.0)  # never refused; the margin aims at 2 s
    er = process(processor, chat(image(png_url(896, 896)), text("What is this?")), engine)
    assert len(engine.asked) >= 2 and er.images[0].num_tokens <= 256 < 1024
    assert "lowered from 1024 to" in er.image_budget_note and "margin" in er.image_budget_note


def test_at_the_floor_still_asked_to_lower_it_is_admitted_not_refused(processor):
    engine = MarginEngine(seconds_per_patch=1.0, slo_s=100.0, aim_s=0.1)  # nothing meets the margin's aim
    er = process(processor, chat(image(png_url(896, 896)), text("What is this?")), engine)
    assert engine.asked[-1].encoder_patches <= 64 * 4 * 2  # down to the floor, then admitted as it is
    assert er.predicted_ttft_s is not None and "lowered from 1024 to 64" in er.image_budget_note


def test_a_request_that_chose_its_detail_keeps_it_when_only_the_margin_asks(processor):
    engine = MarginEngine(seconds_per_patch=0.05, slo_s=100.0, aim_s=0.1)
    part = {"type": "image_url", "image_url": {"url": png_url(896, 896), "detail": "high"}}
    er = process(processor, chat(part, text("What is this?")), engine)
    assert len(engine.asked) == 1 and er.image_budget_note is None  # admitted at the detail it asked for


def test_a_request_asked_again_is_not_ahead_of_itself_but_others_admitted_are():
    """The async engine counts the lane's admitted-but-not-queued requests ahead of a new one; a request whose
    budget the processor lowers holds such a reservation from its first ask, and its later asks must not count it."""
    from firsttoken.config import SchedulerConfig
    from firsttoken.engine.async_engine import AsyncEngine
    from firsttoken.engine.interrupt import ShortArrivals

    seen: list[tuple[PromptWork, ...]] = []

    def check_admission(work, pending=()):
        seen.append(pending)
        return AdmissionVerdict.ok("long", 1.0, lower_budget=True)

    config = SimpleNamespace(num_threads=0, max_unread_outputs=64, scheduler=SchedulerConfig(long_prompt_threshold=100))
    engine = SimpleNamespace(config=config, check_admission=check_admission, stats=lambda: None,
                             short_arrivals=ShortArrivals())
    bridge = AsyncEngine(engine)  # its thread is not started
    bridge.check_admission(PromptWork(900, 1, 4000), "other")
    bridge.check_admission(PromptWork(900, 1, 4000), "me")
    bridge.check_admission(PromptWork(500, 1, 1000), "me")  # asked again at a lower budget
    assert [len(p) for p in seen] == [0, 1, 1]  # "other" ahead each time, "me" never ahead of itself
    assert all(p.admitted_s is not None for p in seen[-1])  # reservations carry their admission time
