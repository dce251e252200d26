"""Decode positions reach the model as one row expanded to (t, h, w): the rotary tables made from it are exactly
those of the full [3, n] table, for both M-RoPE layouts."""

from __future__ import annotations

import pytest
import torch

from firsttoken.models.layers import (
    apply_rotary,
    apply_rotary_rolled,
    mrope_cos_sin,
    rolled_sin,
)


@pytest.mark.parametrize("interleaved,section", [(False, (4, 6, 6)), (True, (6, 5, 5))])
def test_an_expanded_row_gives_the_tables_of_its_full_copy(interleaved, section):
    row = torch.tensor([5, 6, 7, 300, 4096], dtype=torch.int64)
    expanded = row.expand(3, -1)
    assert expanded.stride(0) == 0
    for dtype in (torch.float32, torch.bfloat16):
        fast = mrope_cos_sin(expanded, 32, 1e6, section, dtype, interleaved)
        full = mrope_cos_sin(expanded.contiguous(), 32, 1e6, section, dtype, interleaved)
        assert all(torch.equal(a, b) for a, b in zip(fast, full))


def test_the_rolled_rotary_is_the_reference_rotary_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(7, 10, 64, generator=gen) * 5).to(dtype)  # [tokens, heads, head_dim]
        cos, sin = mrope_cos_sin(torch.arange(7).expand(3, -1), 64, 1e6, (8, 12, 12), dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        assert torch.equal(apply_rotary_rolled(x, cos, rolled_sin(sin)), apply_rotary(x, cos, sin))
