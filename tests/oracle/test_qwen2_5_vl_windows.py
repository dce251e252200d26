"""What only Qwen2.5-VL's tower has, against transformers: the window layout (``get_vision_window_index``) and what
a windowed block costs the scheduler. Its parity with transformers is test_family_parity.py's and
test_engine_oracle.py's (the tiny tower: depth 4, full attention in blocks 1 and 3, 112-px windows of 4 x 4 merged
tokens)."""

from __future__ import annotations

import pytest
import torch

from firsttoken.models.checkpoint import make_model
from firsttoken.models.model_config import VisionConfig
from firsttoken.models.qwen2_5_vl_vision import block_flops, window_layout
from firsttoken.models.registry import family_named, load_model_config

FAMILY = "qwen2.5-vl"
GRIDS = [(1, 16, 24), (1, 18, 10), (1, 4, 4), (1, 8, 8), (1, 2, 30), (2, 12, 20)]  # patches (t, h, w)


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> VisionConfig:
    model_dir = make_model(tmp_path_factory.mktemp("q25-tiny"), size="tiny", seed=0, family=FAMILY)
    vision = load_model_config(model_dir).vision
    assert vision.fullatt_block_indexes == (1, 3) and vision.window_size == 112
    return vision


@pytest.mark.parametrize("grids", [[g] for g in GRIDS] + [GRIDS])
def test_window_order_and_windows_match_get_vision_window_index(vision: VisionConfig, grids) -> None:
    from transformers.vision_utils import get_vision_window_index

    v = vision
    index, cu = get_vision_window_index(torch.tensor(grids), v.spatial_merge_size, v.window_size, v.patch_size)
    layout = window_layout(grids, v)
    assert torch.equal(layout.order, index)
    assert layout.window_rows == torch.diff(cu).tolist()
    assert torch.equal(layout.order[layout.restore], torch.arange(index.numel()))
    assert [layout.segments(b) for b in range(v.depth)] == [
        layout.frame_rows if b in v.fullatt_block_indexes else layout.window_rows for b in range(v.depth)]


@pytest.mark.parametrize("grid", GRIDS)
def test_encoder_units_cost_windowed_blocks_by_their_flops(vision: VisionConfig, grid) -> None:
    v = vision
    units = family_named(FAMILY).encoder_units(v, grid)
    t, h, w = grid
    visual_tokens = t * h * w // 4
    windows = window_layout([grid], v).window_rows
    assert len(units) == v.depth == 4
    for i, unit in enumerate(units):
        assert unit.num_patches == t * h * w
        if i in v.fullatt_block_indexes:  # blocks 1 and 3: a Qwen2-VL block's pairs and cost
            assert (unit.attention_pairs, unit.cost_tokens) == (t * (h * w) ** 2, visual_tokens)
        else:
            assert unit.attention_pairs == sum(n * n for n in windows)
            share = block_flops(v, t * h * w, unit.attention_pairs) / block_flops(v, t * h * w, t * (h * w) ** 2)
            assert unit.cost_tokens == max(1, round(visual_tokens * share))
            assert 1 <= unit.cost_tokens <= visual_tokens
    if max(h, w) > 8:  # more than one window: a windowed block is cheaper than a full one
        assert units[0].cost_tokens < units[1].cost_tokens
