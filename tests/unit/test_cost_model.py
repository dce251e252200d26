"""The step-cost model on synthetic step timings: it recovers what steps cost, stays non-negative, and follows a
machine that gets slower."""

from __future__ import annotations

import random

import numpy as np

from firsttoken.batch import StepFeatures
from firsttoken.scheduler.cost_model import FEATURE_NAMES, CostModel, decode_chunk, encoder_units, prefill_chunk

TRUE = {"step": 0.004, "sequences": 0.0002, "sampled": 0.0003, "prefill_tokens": 0.0004, "prefill_attention": 2e-8,
        "decode_tokens": 0.001, "decode_context": 1e-6, "encoder_patches": 5e-5, "encoder_attention": 3e-10}


def random_step(rng: random.Random) -> StepFeatures:
    f = StepFeatures()
    for _ in range(rng.randint(0, 6)):
        f = f + decode_chunk(rng.randint(10, 3000))
    if rng.random() < 0.7:
        q = rng.randint(8, 2048)
        f = f + prefill_chunk(q, rng.randint(0, 4000), rng.random() < 0.5)
    if rng.random() < 0.4:
        n = rng.choice([256, 1024, 4096, 5476])
        f = f + encoder_units(n, n * n if rng.random() < 0.5 else n * 64)
    return f if not f.is_empty else decode_chunk(100)


def seconds(f: StepFeatures, scale: float = 1.0) -> float:
    return float(f.vector() @ np.array([TRUE[n] for n in FEATURE_NAMES])) * scale


def test_it_learns_what_steps_cost_within_the_noise():
    rng = random.Random(0)
    model = CostModel()
    for _ in range(400):
        f = random_step(rng)
        model.observe(f, seconds(f) * rng.uniform(0.92, 1.08))
    errors = []
    for _ in range(300):  # fresh steps it has not seen
        f = random_step(rng)
        errors.append(abs(model.predict(f) / seconds(f) - 1))
    assert np.median(errors) < 0.05 and np.percentile(errors, 90) < 0.12
    assert all(c >= 0 for c in model.fit().coefficients)
    learned = model.fit().as_dict()
    for term in ("step", "prefill_tokens", "encoder_patches"):  # the terms that carry most of the time
        assert abs(learned[term] / TRUE[term] - 1) < 0.3, (term, learned[term])


def test_honest_error_is_recorded_per_observation():
    rng = random.Random(1)
    model = CostModel()
    for _ in range(100):
        f = random_step(rng)
        model.observe(f, seconds(f))
    assert len(model.ratios) == 99  # every observation after the first fit, predicted before it was seen
    assert np.median([abs(r - 1) for r in list(model.ratios)[-50:]]) < 0.02


def test_it_follows_a_machine_that_slows_down():
    rng = random.Random(2)
    model = CostModel(window=128)
    for _ in range(200):
        f = random_step(rng)
        model.observe(f, seconds(f))
    for _ in range(300):  # another tenant arrives: everything takes twice as long
        f = random_step(rng)
        model.observe(f, seconds(f, 2.0))
    probe = prefill_chunk(512, 0, True)
    assert abs(model.predict(probe) / seconds(probe, 2.0) - 1) < 0.1


def test_an_unfitted_model_predicts_nothing_and_a_prior_is_a_fit():
    assert not CostModel().is_fitted and CostModel().predict(prefill_chunk(100, 0, True)) == 0.0
    prior = tuple(TRUE[n] for n in FEATURE_NAMES)
    model = CostModel(prior=prior)
    assert model.is_fitted and abs(model.predict(decode_chunk(1000)) - seconds(decode_chunk(1000))) < 1e-12
