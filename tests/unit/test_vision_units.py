"""Encoder units finer than a block (models/vision_units.py): a full-attention block over a large image becomes
query-row slices that cover its rows once, score its pairs once and cost what the block costs; small images,
windowed blocks and multi-frame grids keep one unit per block."""

from __future__ import annotations

from firsttoken.models.model_config import VisionConfig
from firsttoken.models.qwen2_5_vl_vision import window_attention_units
from firsttoken.models.qwen2_vl_vision import full_attention_units
from firsttoken.models.vision_units import MAX_UNIT_PAIRS, MIN_UNIT_ROWS, qkv_share, split_block
from firsttoken.types import EncoderUnit

SMALL = VisionConfig(depth=4, embed_dim=256, num_heads=4, intermediate_size=1024, out_hidden_size=512)


def test_a_large_image_block_is_sliced_into_rows_that_add_up_to_the_block() -> None:
    n = 74 * 74  # a 1024² image in 14-px patches
    block = EncoderUnit(n, n * n, n // 4)
    share = qkv_share(SMALL, mlp_matrices=2)
    assert share == 0.25  # qkv 3E² of 4E² + 2EI with I = 4E
    slices = split_block(block, 2, [n], share)
    rows = [u.rows for u in slices]
    assert len(slices) == 4 and rows[0][0] == 0 and rows[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))  # contiguous, no overlap
    assert all(u.block == 2 for u in slices)
    assert all(u.attention_pairs <= MAX_UNIT_PAIRS for u in slices)
    assert sum(u.attention_pairs for u in slices) == block.attention_pairs
    assert abs(sum(u.num_patches for u in slices) - n) <= len(slices)  # rounding only
    assert slices[0].num_patches > slices[1].num_patches  # the first projects q, k, v for every row
    assert abs(sum(u.cost_tokens for u in slices) - block.cost_tokens) <= len(slices)


def test_small_images_multi_frame_grids_and_windowed_blocks_keep_one_unit_per_block() -> None:
    assert [u.rows for u in full_attention_units(SMALL, (1, 28, 28))] == [None] * 4  # 784² pairs: under the cap
    assert [u.block for u in full_attention_units(SMALL, (1, 28, 28))] == [0, 1, 2, 3]
    assert [u.rows for u in full_attention_units(SMALL, (2, 74, 74))] == [None] * 4  # two frames: not sliced
    windowed = VisionConfig(depth=4, embed_dim=256, num_heads=4, intermediate_size=512, out_hidden_size=512,
                            hidden_act="silu", window_size=112, fullatt_block_indexes=(1, 3))
    units = window_attention_units(windowed, (1, 74, 74))
    per_block = [sum(1 for u in units if u.block == b) for b in range(4)]
    assert per_block == [1, 4, 1, 4]  # only the full-attention blocks are sliced


def test_a_huge_image_is_never_sliced_finer_than_the_row_floor() -> None:
    n = 256 * 256  # a 3584² image: the pair cap alone would ask for 128-row slices
    slices = split_block(EncoderUnit(n, n * n, n // 4), 0, [n], 0.25)
    assert min(u.rows[1] - u.rows[0] for u in slices) >= MIN_UNIT_ROWS
    assert len(slices) == n // MIN_UNIT_ROWS
