"""The sampler on hand-made logits: what each sampling parameter does to the chosen token."""

from __future__ import annotations

import torch

from firsttoken.sampling.sampler import Sampler, SampleRow, make_generator
from firsttoken.types import SamplingParams


def row(prompt=(), output=(), seed=None, **params) -> SampleRow:
    params.setdefault("max_tokens", 8)
    return SampleRow(SamplingParams(**params), make_generator(seed), tuple(prompt), tuple(output))


LOGITS = torch.tensor([[4.0, 3.5, 1.0, 0.0, -1.0]])


def test_greedy_takes_the_argmax():
    assert Sampler(0).sample(LOGITS, [row(temperature=0.0)]).token_ids == [0]


def test_frequency_and_presence_penalties_push_away_generated_tokens():
    assert Sampler(0).sample(LOGITS, [row(output=[0], temperature=0.0, presence_penalty=1.0)]).token_ids == [1]
    assert Sampler(0).sample(LOGITS, [row(output=[0], temperature=0.0, frequency_penalty=0.4)]).token_ids == [0]
    assert Sampler(0).sample(LOGITS, [row(output=[0, 0], temperature=0.0, frequency_penalty=0.4)]).token_ids == [1]


def test_repetition_penalty_covers_prompt_tokens_like_transformers():
    # positive logits are divided, negative multiplied: 4.0 / 1.2 = 3.33 < 3.5
    assert Sampler(0).sample(LOGITS, [row(prompt=[0], temperature=0.0, repetition_penalty=1.2)]).token_ids == [1]


def test_top_k_and_top_p_restrict_the_support():
    sampler = Sampler(0)
    k = [sampler.sample(LOGITS, [row(temperature=1.0, top_k=2)]).token_ids[0] for _ in range(200)]
    assert set(k) == {0, 1}
    p = [sampler.sample(LOGITS, [row(temperature=1.0, top_p=0.5)]).token_ids[0] for _ in range(200)]
    assert set(p) == {0}  # token 0 alone holds over half the mass


def test_same_seed_same_tokens_whatever_shares_the_batch():
    logits = torch.randn(3, 50)
    alone = [Sampler().sample(logits[1:2], [row(seed=7, temperature=1.0)]).token_ids[0] for _ in range(3)]
    batched = Sampler().sample(logits, [row(temperature=1.0), row(seed=7, temperature=1.0), row(temperature=1.0)])
    assert len(set(alone)) == 1 and batched.token_ids[1] == alone[0]


def test_logprobs_report_the_model_distribution_and_alternatives():
    out = Sampler(0).sample(LOGITS, [row(temperature=0.0, logprobs=True, top_logprobs=2)])
    lp = out.logprobs[0]
    expected = torch.log_softmax(LOGITS[0], -1)
    assert lp.token_id == 0 and abs(lp.logprob - float(expected[0])) < 1e-6
    assert [t for t, _ in lp.top] == [0, 1]


def test_a_row_that_fails_to_sample_fails_alone():
    class BrokenGenerator:  # stands for any per-row failure (a generator torch refuses)
        pass

    logits = torch.randn(3, 50)
    rows = [
        SampleRow(SamplingParams(max_tokens=4, temperature=0.0), None, [], []),
        SampleRow(SamplingParams(max_tokens=4, temperature=0.8, seed=1), BrokenGenerator(), [], []),  # type: ignore[arg-type]
        SampleRow(SamplingParams(max_tokens=4, temperature=0.0, logprobs=True), None, [], []),
    ]
    result = Sampler(seed=0).sample(logits, rows)
    assert list(result.failed) == [1]
    assert result.token_ids[0] == int(logits[0].argmax()) and result.token_ids[2] == int(logits[2].argmax())
    assert result.logprobs[2] is not None and result.logprobs[1] is None


def test_extreme_accepted_values_sample_a_real_token():
    logits = torch.randn(1, 50) * 30
    for params in (
        SamplingParams(max_tokens=1, temperature=1e-40),
        SamplingParams(max_tokens=1, temperature=1.0, repetition_penalty=1e-40),
        SamplingParams(max_tokens=1, temperature=2.0, top_p=1e-40, repetition_penalty=1e-30),
        SamplingParams(max_tokens=1, temperature=1e-5, top_k=3),
    ):
        result = Sampler(seed=0).sample(logits, [SampleRow(params, None, [3, 4, 5], [6])])
        assert not result.failed and 0 <= result.token_ids[0] < 50
