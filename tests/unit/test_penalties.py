"""The runner's incrementally kept TokenHistory penalizes exactly as the history rebuilt from all tokens."""

from __future__ import annotations

import random

import torch

from firsttoken.sampling.penalties import TokenHistory
from firsttoken.sampling.sampler import Sampler, SampleRow
from firsttoken.types import SamplingParams


def test_growing_one_token_at_a_time_equals_building_from_the_whole_history():
    rng = random.Random(0)
    prompt = [rng.randrange(50) for _ in range(30)]
    grown = TokenHistory(prompt)
    output: list[int] = []
    for _ in range(80):
        token = rng.randrange(60)
        output.append(token)
        grown.append(token)
        built = TokenHistory(prompt, output)
        assert sorted(grown.seen_ids.tolist()) == built.seen_ids.tolist() == sorted(set(prompt) | set(output))
        assert dict(zip(grown.output_ids.tolist(), grown.output_counts.tolist())) == {
            t: output.count(t) for t in set(output)}


def test_the_sampler_gives_the_same_logits_and_tokens_with_a_kept_history():
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.7, logprobs=True, top_logprobs=3)
    prompt = [rng.randrange(40) for _ in range(25)]
    history = TokenHistory(prompt)
    output: list[int] = []
    for _ in range(30):
        logits = torch.randn(1, 40, generator=gen) * 3
        kept = Sampler(0).sample(logits, [SampleRow(params, None, prompt, output, history)])
        rebuilt = Sampler(0).sample(logits, [SampleRow(params, None, prompt, output)])
        assert kept == rebuilt
        token = rng.randrange(40)  # any next token: the histories must follow whatever was appended
        output.append(token)
        history.append(token)
