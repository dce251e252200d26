"""The sampler on hand-made logits: what each sampling parameter does to the chosen token."""

from __future__ import annotations

import pytest
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


def _kept_distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution top-k then top-p keep, by a full sort in float64 (vLLM's and transformers' rule)."""
    scaled = logits.double() / temperature
    if top_k:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, -1)
    sorted_probs, order = torch.sort(probs, descending=True)
    drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    return kept / kept.sum()


def test_sampled_tokens_follow_the_kept_distribution():
    """Over 6,000 seeded draws each, the frequency of every token is its probability under the top-k / top-p rule
    (within 4 standard errors), and no token outside what the rule keeps is ever drawn."""
    logits = torch.linspace(2.0, -2.0, 12)[None]
    for params in ({"temperature": 1.0}, {"temperature": 0.7, "top_k": 4}, {"temperature": 1.3, "top_p": 0.6},
                   {"temperature": 0.9, "top_k": 6, "top_p": 0.8}):
        want = _kept_distribution(logits[0], params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))
        sampler, n = Sampler(seed=5), 6000
        counts = torch.bincount(torch.tensor([sampler.sample(logits, [row(**params)]).token_ids[0]
                                              for _ in range(n)]), minlength=12).double()
        assert (counts[want == 0] == 0).all(), params
        se = (want * (1 - want) / n).sqrt()
        assert ((counts / n - want).abs() <= 4 * se + 1e-9).all(), (params, counts / n, want)


def test_top_p_alone_keeps_its_whole_prefix_when_that_is_more_than_the_first_candidates():
    """A nearly flat distribution: top-p 0.5 over 1,000 tokens keeps 380 of them, more than the 64 and then 256
    most probable the sampler looks at first; draws spread over that whole prefix and never beyond it."""
    logits = (-1e-3 * torch.arange(1000.0))[None]
    kept = _kept_distribution(logits[0], 1.0, top_p=0.5) > 0
    sampler = Sampler(seed=2)
    drawn = {sampler.sample(logits, [row(temperature=1.0, top_p=0.5)]).token_ids[0] for _ in range(1500)}
    assert all(kept[t] for t in drawn)
    assert int(kept.sum()) == 380 and max(drawn) > 256


def test_penalties_of_rows_sharing_a_step_are_each_rows_own():
    """Rows with different repetition, presence and frequency penalties in one step: each row's logits are
    penalised by its own parameters and tokens only (checked against the rule applied to each row alone)."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 30, generator=gen) * 3
    specs = [dict(prompt=[1, 2, 3], output=[4, 4, 5], repetition_penalty=1.3),
             dict(prompt=[7], output=[8, 9, 9, 9], presence_penalty=0.5, frequency_penalty=0.7),
             dict(prompt=[2, 10], output=[11], temperature=0.0),  # no penalties: untouched
             dict(prompt=[12, 13], output=[13, 14], repetition_penalty=0.8, frequency_penalty=-0.4)]
    want = logits.clone()
    for i, spec in enumerate(specs):
        seen = sorted(set(spec["prompt"]) | set(spec["output"]))
        rp = spec.get("repetition_penalty", 1.0)
        if rp != 1.0:
            v = want[i, seen]
            want[i, seen] = torch.where(v > 0, v / rp, v * rp)
        for t in set(spec["output"]):
            count = spec["output"].count(t)
            want[i, t] -= spec.get("presence_penalty", 0.0) + spec.get("frequency_penalty", 0.0) * count
    rows = [row(temperature=0.0, logprobs=True, top_logprobs=1, **{k: v for k, v in s.items() if k != "temperature"})
            for s in specs]
    got = Sampler(0).sample(logits, rows)
    assert got.token_ids == want.argmax(-1).tolist()
    for i, spec in enumerate(specs):  # each row alone gives the same token
        assert Sampler(0).sample(logits[i:i + 1], [rows[i]]).token_ids == [got.token_ids[i]]


def test_the_kernel_and_torch_give_the_same_tokens():
    """Sampler(kernels=False) (--cpu-kernels off) and the default (top-k and argmax through firsttoken's kernel where
    it is built) choose the same tokens: greedy, top-k, top-p alone, with the same seeds."""
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(9)) * 4
    settings = [{"temperature": 0.0}, {"temperature": 0.8, "top_k": 20}, {"temperature": 0.7, "top_p": 0.9},
                {"temperature": 1.0, "top_k": 40, "top_p": 0.8}, {"temperature": 0.0, "repetition_penalty": 1.2},
                {"temperature": 1.0}]
    for step in range(20):
        def rows():  # fresh per-request generators for each side
            return [row(prompt=[1, 2, 3], output=[step], seed=100 * step + i, **s) for i, s in enumerate(settings)]

        assert Sampler(0).sample(logits, rows()).token_ids == Sampler(0, kernels=False).sample(logits, rows()).token_ids


def test_greedy_rows_with_a_repetition_penalty_skip_it_when_their_maximum_is_unseen():
    """Qwen2-VL's default (greedy, repetition 1.05): when the first maximum of the raw logits is a token the request
    has not seen, it is the penalised first maximum too, and the penalty's work over the vocabulary is skipped; when
    it has been seen, the row goes the whole way. Same tokens as the full rule either way (ties included)."""
    from firsttoken.sampling import sampler as sampler_module
    from firsttoken.sampling.penalties import TokenHistory

    penalised_rows: list[int] = []
    full = sampler_module.apply_penalties

    def counting(logits, rows, skip=frozenset()):
        penalised_rows.extend(i for i, r in enumerate(rows) if r.params.has_penalties and i not in skip)
        return full(logits, rows, skip)

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(8, 500, generator=g) * 3).round()  # rounded: ties between seen and unseen tokens
    top = logits.argmax(-1).tolist()
    prompts = [[top[i]] if i % 2 else [(top[i] + 1) % 500] for i in range(8)]  # odd rows have seen their maximum
    rows = [SampleRow(SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.05 + 0.1 * (i % 3)), None,
                      prompts[i], (5, 6), TokenHistory(prompts[i], [5, 6])) for i in range(8)]
    seen_top = [i for i, r in enumerate(rows) if r.history.has_seen(top[i])]
    expected = []
    for i, r in enumerate(rows):  # the full rule: penalise every seen token, clamp, first maximum
        x = logits[i].clone()
        seen = r.history.seen_ids
        x[seen] = torch.where(x[seen] > 0, x[seen] / r.params.repetition_penalty, x[seen] * r.params.repetition_penalty)
        expected.append(int(torch.argmax(x)))
    sampler = Sampler(0, penalties=counting)
    assert sampler._cpu_kernel(logits) is not None  # the kernel is built (CI's machines)
    assert sampler.sample(logits, rows).token_ids == expected
    assert penalised_rows == seen_top and {1, 3, 5, 7} <= set(seen_top) and len(seen_top) < 8  # the others skipped
    assert Sampler(0, kernels=False).sample(logits, rows).token_ids == expected  # no kernel: the whole way, same


def test_top_logprobs_leave_out_tokens_an_output_constraint_masked():
    # the runner masks what a grammar refuses to -inf before sampling; those are no alternatives (and JSON has no
    # -inf): found by the API fuzz (guided_regex "0" with top_logprobs 2 answered a 500)
    logits = torch.full((1, 8), -torch.inf)
    logits[0, 3] = 1.0
    result = Sampler().sample(logits, [row(logprobs=True, top_logprobs=2)])
    assert result.token_ids == [3]
    assert result.logprobs[0].logprob == 0.0 and result.logprobs[0].top == ((3, 0.0),)


def test_logit_bias_moves_a_token_in_and_out_of_reach():
    # +100 makes token 3 the greedy choice, -100 bans the argmax; the logprobs stay the model's own
    forced = Sampler().sample(LOGITS, [row(temperature=0.0, logprobs=True, logit_bias=((3, 100.0),))])
    assert forced.token_ids == [3]
    assert forced.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[0, 3]))
    # (the second row's repetition penalty would otherwise take the unpenalised fast path to token 0)
    banned = Sampler(0).sample(LOGITS.repeat(2, 1), [row(temperature=0.0, logit_bias=((0, -100.0),)),
                                                     row(temperature=0.0, repetition_penalty=1.05, output=(1,),
                                                         logit_bias=((0, -100.0),))])
    assert banned.token_ids == [1, 1]
    sampled = {Sampler(seed).sample(LOGITS, [row(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0)))]).token_ids[0]
               for seed in range(20)}
    assert 0 not in sampled and 1 not in sampled
