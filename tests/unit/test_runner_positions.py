"""The runner packs M-RoPE positions for a whole step at once: prompt chunks slice their request's table, generated
tokens sit at index + delta on all three axes. Checked against the per-chunk definition on random batches."""

from __future__ import annotations

import random

import torch

from firsttoken.models.mrope import decode_positions
from firsttoken.runner.model_runner import _positions


def per_chunk(table: torch.Tensor, delta: int, start: int, end: int) -> torch.Tensor:
    """[3, end - start] positions of tokens [start, end) of one request, the straightforward way."""
    n_prompt = table.shape[1]
    parts = []
    if start < n_prompt:
        parts.append(table[:, start : min(end, n_prompt)])
    if end > n_prompt:
        s = max(start, n_prompt)
        parts.append(decode_positions(s, end - s, delta))
    return torch.cat(parts, dim=1)


def test_packed_positions_equal_the_per_chunk_definition():
    rng = random.Random(0)
    for _ in range(200):
        expected, prompt_parts, generated_rows, generated_pos = [], [], [], []
        num_tokens = 0
        for _ in range(rng.randint(1, 6)):
            n_prompt = rng.randint(1, 30)
            table = torch.randint(0, 50, (3, n_prompt))  # any table: images make t, h, w differ
            delta = rng.randint(-20, 0)
            start = rng.randint(0, n_prompt + 10)
            end = start + rng.choice([1, 1, rng.randint(1, 12)])  # decodes, prefill chunks, chunks past the prompt
            expected.append(per_chunk(table, delta, start, end))
            if start < n_prompt:
                prompt_parts.append((num_tokens, table[:, start : min(end, n_prompt)]))
            first = max(start, n_prompt)
            generated_rows.extend(range(num_tokens + first - start, num_tokens + end - start))
            generated_pos.extend(range(first + delta, end + delta))
            num_tokens += end - start
        packed = _positions(num_tokens, prompt_parts, generated_rows, generated_pos)
        assert torch.equal(packed, torch.cat(expected, dim=1))
