"""AttentionMetadata.build (vectorized) equals the per-token definition in attention/base.py on random batches:
the block table padded with 0, one flat slot per new token, cumulative query starts."""

from __future__ import annotations

import random

import pytest
import torch

from firsttoken.attention.base import AttentionMetadata


def reference(query_lens, context_lens, block_tables, block_size):
    """Straight from the contract: token j of sequence i lives in block_tables[i][j // bs] at offset j % bs."""
    width = max([1, *map(len, block_tables)])
    table = [list(t) + [0] * (width - len(t)) for t in block_tables]
    slots = [blocks[j // block_size] * block_size + j % block_size
             for q, c, blocks in zip(query_lens, context_lens, block_tables) for j in range(c, c + q)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return table, slots, starts


def random_batch(rng: random.Random, block_size: int, decode_only: bool):
    free = list(range(2000))
    rng.shuffle(free)
    query_lens, context_lens, tables = [], [], []
    for _ in range(rng.randint(1, 9)):
        q = 1 if decode_only else rng.choice([1, 1, rng.randint(1, 40)])
        c = rng.choice([0, rng.randint(0, 60)])
        need = -(-(q + c) // block_size) + rng.randint(0, 2)  # tables may hold spare blocks
        query_lens.append(q)
        context_lens.append(c)
        tables.append(tuple(free.pop() for _ in range(need)))
    return query_lens, context_lens, tables


@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_build_matches_the_per_token_definition(block_size, decode_only):
    rng = random.Random(block_size * 2 + decode_only)
    for _ in range(50):
        query_lens, context_lens, tables = random_batch(rng, block_size, decode_only)
        meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
        table, slots, starts = reference(query_lens, context_lens, tables, block_size)
        assert meta.block_tables.dtype == torch.int32 and meta.block_tables.tolist() == table
        assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == slots
        assert meta.query_start_loc.tolist() == starts


def test_a_block_table_too_short_is_refused():
    with pytest.raises(ValueError, match="sequence 1: block table too short for 9 tokens"):
        AttentionMetadata.build([1, 5], [3, 4], [(0,), (1, 2)], 4)


def test_one_sequence_on_consecutive_blocks_is_read_in_place():
    assert AttentionMetadata.build([1], [13], [(5, 6, 7, 8)], 4).single_run_start == 5
    assert AttentionMetadata.build([1], [13], [(5, 7, 6, 8)], 4).single_run_start is None
    assert AttentionMetadata.build([1, 1], [3, 3], [(0,), (1,)], 4).single_run_start is None  # a batch gathers
    # only the blocks the sequence covers count: a spare block after them may be anywhere
    assert AttentionMetadata.build([1], [3], [(2, 9)], 4).single_run_start == 2
