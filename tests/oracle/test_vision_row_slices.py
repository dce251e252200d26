"""A large image's vision tower run as the engine runs it — unit by unit, its full-attention blocks in query-row
slices (models/vision_units.py) — against transformers' tower on the same tiny checkpoint and against our own
whole-block pass, for every native-resolution family (this module's ``family``; DeepStack features too). The
image is big enough that each full-attention block scores more than MAX_UNIT_PAIRS query-key pairs, so it is
sliced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from firsttoken.loading.loader import load_model
from firsttoken.models.family import ModelFamily
from firsttoken.models.interfaces import ImageEmbeddings
from firsttoken.models.registry import family_named, load_model_config
from firsttoken.models.vision_units import MAX_UNIT_PAIRS
from tests.oracle.parity import NATIVE_RESOLUTION_FAMILIES, tower_outputs


@pytest.fixture(scope="module", params=NATIVE_RESOLUTION_FAMILIES)
def family(request: pytest.FixtureRequest) -> ModelFamily:
    """The native-resolution families (a tiling tower has no row slices)."""
    return family_named(request.param)


VISION_TOL = 1e-5  # max |Δ| of the tower's outputs, fp32, as test_family_parity.py's
SIDE_PX = 1024  # a 1024² image: 72 x 72 patches of 14 px (Qwen2/2.5-VL), 64 x 64 of 16 px (Qwen3-VL)


def _outputs(out: ImageEmbeddings) -> list[torch.Tensor]:
    return [out.main, *out.deepstack]


def test_a_sliced_tower_matches_the_reference_and_the_whole_pass(family: ModelFamily, model_dir: Path) -> None:
    config = load_model_config(model_dir)
    vision = config.vision
    side = SIDE_PX // vision.patch_size // vision.spatial_merge_size * vision.spatial_merge_size
    grid = (1, side, side)
    units = family.encoder_units(vision, grid)
    assert any(u.rows is not None for u in units) and (side * side) ** 2 > MAX_UNIT_PAIRS
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixel_values = torch.randn(side * side, patch_dim, generator=torch.Generator().manual_seed(0))
    ours = load_model(model_dir, torch.float32)
    ref = family.checkpoint.hf_model_class().from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = tower_outputs(ref.model.get_image_features(pixel_values, torch.tensor([grid])))
        whole = _outputs(ours.visual(pixel_values, [grid]))
        for units_per_call in (1, 3):  # a slice per step, and several slices (across blocks) per step
            state = ours.visual.start_encode(pixel_values, grid)
            calls = 0
            while not state.done:
                ours.visual.run_units(state, units_per_call)
                calls += 1
            sliced = _outputs(ours.visual.finish_encode(state))
            assert calls == -(-len(units) // units_per_call)
            assert len(sliced) == len(whole) == len(expected)
            for s, w, e in zip(sliced, whole, expected):
                assert s.shape == e.shape
                assert (s - w).abs().max().item() <= VISION_TOL  # the rows are the whole block's
                assert (s - e).abs().max().item() <= VISION_TOL
