"""Paged SDPA attention vs plain causal attention over the whole sequence (the oracle), on shuffled blocks."""

from __future__ import annotations

import random

import pytest
import torch

from firsttoken.attention.base import AttentionMetadata
from firsttoken.attention.registry import get_backend
from firsttoken.attention.sdpa import write_kv

NUM_BLOCKS = 64
BLOCK_SIZE = 4
HEAD_DIM = 8


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [seq, H, D], k/v: [seq, KVH, D] for one whole sequence; causal; returns [seq, H, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    seq = q.shape[0]
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


def run_case(
    query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int, seed: int,
    consecutive: bool = False,
) -> float:
    gen = torch.Generator().manual_seed(seed)
    free = list(range(NUM_BLOCKS))[::-1]  # popped in order: blocks 0, 1, 2, ...
    if not consecutive:
        random.Random(seed).shuffle(free)  # non-contiguous, out-of-order block assignment
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    tables, full, expected = [], [], []
    for q_len, ctx_len in zip(query_lens, context_lens):
        seq_len = q_len + ctx_len
        blocks = [free.pop() for _ in range((seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE)]
        tables.append(blocks)
        q = torch.randn(seq_len, num_heads, HEAD_DIM, generator=gen)
        k = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        full.append((q, k, v))
        expected.append(plain_attention(q, k, v, scale)[ctx_len:])
        # earlier steps already cached the context tokens
        ctx_slots = torch.tensor([blocks[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(ctx_len)])
        write_kv(k[:ctx_len], v[:ctx_len], kv_cache, ctx_slots.long())
    meta = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK_SIZE)
    new = [torch.cat([t[c:] for (t, c) in zip(parts, context_lens)]) for parts in zip(*full)]
    out = get_backend("sdpa").forward(*new, kv_cache, meta, scale)
    # the new keys landed in the cache where the block tables say
    for (q, k, v), blocks, ctx_len, q_len in zip(full, tables, context_lens, query_lens):
        for j in range(ctx_len, ctx_len + q_len):
            torch.testing.assert_close(kv_cache[0, blocks[j // BLOCK_SIZE], j % BLOCK_SIZE], k[j])
    return (out - torch.cat(expected)).abs().max().item()


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([9], [0]),  # first prefill chunk
        ([7], [5]),  # later chunk, starting mid-block
        ([1], [13]),  # single decode
        ([1, 1, 1, 1], [3, 0, 17, 8]),  # pure-decode batch (padded + masked path)
        ([6, 1, 5, 1], [0, 9, 4, 22]),  # mixed prefill chunks and decodes
    ],
)
def test_paged_attention_matches_plain_attention(query_lens, context_lens, num_heads, num_kv_heads) -> None:
    assert run_case(query_lens, context_lens, num_heads, num_kv_heads, seed=len(query_lens)) < 1e-5


@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1], [13]),  # one sequence on consecutive blocks: read as a view of the cache
        ([1, 1, 1], [20, 20, 20]),  # equal lengths: no padding mask
    ],
)
def test_decode_on_consecutive_blocks_matches_plain_attention(query_lens, context_lens) -> None:
    assert run_case(query_lens, context_lens, 4, 2, seed=3, consecutive=True) < 1e-5


def test_unknown_backend_names_the_available_ones() -> None:
    with pytest.raises(ValueError, match="sdpa"):
        get_backend("nope")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_later_chunk_split_into_context_and_itself_equals_the_masked_attention(dtype, tol) -> None:
    from firsttoken.attention.sdpa import _attend, _attend_split

    gen = torch.Generator().manual_seed(7)
    q_len, ctx, heads, kv_heads, dim = 300, 700, 8, 2, 32
    q = torch.randn(q_len, heads, dim, generator=gen).to(dtype)
    k = torch.randn(ctx + q_len, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(ctx + q_len, kv_heads, dim, generator=gen).to(dtype)
    mask = torch.arange(ctx + q_len)[None, :] <= torch.arange(ctx, ctx + q_len)[:, None]
    masked = _attend(q, k, v, mask, dim**-0.5, causal=False)
    split = _attend_split(q, k, v, ctx, dim**-0.5)
    assert split.dtype == dtype and split.shape == masked.shape
    assert (split.float() - masked.float()).abs().max() < tol
