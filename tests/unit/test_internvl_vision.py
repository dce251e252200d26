"""InternVL3.5's vision side (models/internvl_vision.py) against transformers' InternVLModel (the
oracle) on tiny random towers in fp32: image features of 1 and 3 tiles for InternViT-300M's shape
(LayerNorm, q/k/v bias) and InternViT-6B's (RMSNorm, QK-norm), a post-norm and an earlier feature
layer; encoder units run one by one equal to the whole; the pixel-shuffle permutation; unit shapes
for the released towers."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from transformers import InternVLConfig, InternVLModel

from firsttoken.models.internvl_vision import (
    INTERNVL_VISION_WEIGHTS,
    InternVisionConfig,
    InternVisionTransformer,
    TileUnit,
    parse_vision_config,
    pixel_shuffle,
    tile_block_flops,
    tile_units,
    unit_shape,
)
from firsttoken.models.model_config import ConfigError

SIDE = 32  # 448-px tiles of 14-px patches
TOL = 1e-5
SHAPE_300M = {"norm_type": "layer_norm", "attention_bias": True}
# layer_norm_eps away from 1e-6 so that an eps taken from the wrong field shows (the QK-norm's is
# RMSNorm's default 1e-6 in transformers, the blocks' and the post-norm's layer_norm_eps)
SHAPE_6B = {"norm_type": "rms_norm", "use_qk_norm": True, "layer_norm_eps": 1e-2}
# name -> (tile side in px, vision_config overrides, InternVLConfig overrides); the units tests
# run many encodes, on 112-px tiles (8 x 8 patches) to stay fast
TOWERS: dict[str, tuple[int, dict, dict]] = {
    "300m": (448, SHAPE_300M, {}),
    "6b": (448, SHAPE_6B, {}),
    "post-norm": (448, {"use_mean_pooling": False, "layer_norm_eps": 1e-2}, {}),
    "layer-2": (448, {"use_mean_pooling": False}, {"vision_feature_layer": -2}),
    "300m-112": (112, SHAPE_300M, {}),
    "6b-112": (112, SHAPE_6B, {}),
}
PARITY = ["300m", "6b", "post-norm", "layer-2"]


@pytest.fixture(autouse=True)
def _one_thread(torch_threads) -> None:
    """Tiny tensors: one intra-op thread (two fight over a busy machine's cores, ~30x slower)."""
    torch_threads(1)


def _randomize(model: InternVLModel, seed: int) -> None:
    """Every vision and projector parameter random and O(1) in effect (transformers zeroes the CLS
    token and positions and sets the layer scales to 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("language_model."):
                continue
            noise = torch.randn(p.shape, generator=g)
            if "lambda_" in name:
                p.copy_(0.5 + 0.5 * noise.abs())
            elif "cls_token" in name or "position_embeddings" in name:
                p.copy_(0.5 * noise)
            elif p.dim() == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)


@functools.cache
def towers(name: str) -> tuple[InternVLModel, InternVisionTransformer]:
    """(transformers' model, ours with its weights through INTERNVL_VISION_WEIGHTS)."""
    image_size, vision, top = TOWERS[name]
    config = InternVLConfig(
        vision_config={"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                       "intermediate_size": 128, "image_size": image_size, "patch_size": 14,
                       **vision},
        text_config={"model_type": "qwen2", "hidden_size": 96, "intermediate_size": 192,
                     "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "vocab_size": 256},
        **top,
    )
    torch.manual_seed(0)
    ref = InternVLModel(config).eval()
    _randomize(ref, seed=1)
    ours = InternVisionTransformer(parse_vision_config(config.to_dict())).eval()
    expected = {f"visual.{k}": v.shape for k, v in ours.state_dict().items()}
    checkpoint = [(k, functools.partial(lambda t: t, v)) for k, v in ref.state_dict().items()
                  if not k.startswith("language_model.")]
    state, unexpected = INTERNVL_VISION_WEIGHTS.load_state(checkpoint, expected)
    assert unexpected == [] and sorted(state) == sorted(expected)
    ours.load_state_dict({k.removeprefix("visual."): v for k, v in state.items()}, strict=True)
    return ref, ours


def tiles(n: int, seed: int = 2, side_px: int = 448) -> torch.Tensor:
    return torch.randn(n, 3, side_px, side_px, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_tiles", [1, 3])
@pytest.mark.parametrize("name", PARITY)
def test_image_features_match_transformers(name: str, num_tiles: int) -> None:
    ref, ours = towers(name)
    pixels = tiles(num_tiles)
    with torch.no_grad():
        expected = ref.get_image_features(pixels).pooler_output  # [N, 256, 96]
        got = ours(pixels, [(num_tiles, SIDE, SIDE)]).main
        from_rows = ours(pixels.reshape(num_tiles, 3, SIDE, 14, SIDE, 14)
                         .permute(0, 2, 4, 1, 3, 5).reshape(-1, 3 * 14 * 14),
                         [(num_tiles, SIDE, SIDE)]).main
    assert got.shape == (num_tiles * 256, 96)
    assert expected.abs().mean() > 0.1  # a signal the tolerance is small against
    torch.testing.assert_close(got, expected.reshape(-1, 96), atol=TOL, rtol=TOL)
    assert torch.equal(from_rows, got)  # tiles or patch rows: the same arithmetic


def _eps(norm: torch.nn.Module) -> float | None:
    """A norm's epsilon (nn.LayerNorm, either RMSNorm); None for an identity."""
    return getattr(norm, "eps", getattr(norm, "variance_epsilon", None))


@pytest.mark.parametrize("name", PARITY)
def test_every_norm_has_transformers_epsilon(name: str) -> None:
    """The projector's LayerNorm (torch's default 1e-5) and the QK-norm (1e-6) are a rounding's
    worth apart from layer_norm_eps at these sizes: compared here, not through the features."""
    ref, ours = towers(name)
    pairs = [(ours.merger.layer_norm, ref.multi_modal_projector.layer_norm)]
    if not isinstance(ref.vision_tower.layernorm, torch.nn.Identity):
        pairs.append((ours.merger.post_norm, ref.vision_tower.layernorm))
    for block, layer in zip(ours.blocks, ref.vision_tower.encoder.layer):
        pairs += [(block.norm1, layer.layernorm_before), (block.norm2, layer.layernorm_after),
                  (block.attn.q_norm, layer.attention.q_norm),
                  (block.attn.k_norm, layer.attention.k_norm)]
    assert [_eps(a) for a, _ in pairs] == [_eps(b) for _, b in pairs]


@pytest.mark.parametrize("name", ["300m-112", "6b-112"])
def test_units_one_by_one_equal_the_whole(name: str) -> None:
    ref, ours = towers(name)
    vision = ours.config
    side = vision.tile_side
    per_tile_block = tile_block_flops(vision, vision.rows_per_tile)
    for num_tiles in (1, 3):
        grid = (num_tiles, side, side)
        pixels = tiles(num_tiles, seed=num_tiles, side_px=vision.image_size)
        with torch.no_grad():
            expected = ref.get_image_features(pixels).pooler_output.reshape(-1, 96)
            one_unit = ours(pixels, [grid]).main  # the tiny tower's default: one unit
            for tile_blocks in (1, 2, 5):  # 1x1; 2 tiles x 1 or 1 tile x 2 blocks; 3 x 1 or 1 x 3
                ours.config = replace(vision, max_unit_flops=tile_blocks * per_tile_block)
                units = ours.encoder_units(ours.config, grid)
                _check_cover(units, num_tiles, vision.depth, vision.rows_per_tile)
                whole = ours(pixels, [grid]).main
                for per_call in (1, 2, 3):
                    state = ours.start_encode(pixels, grid)
                    while not state.done:
                        ours.run_units(state, per_call)
                    assert torch.equal(ours.finish_encode(state).main, whole)
                torch.testing.assert_close(whole, one_unit, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(whole, expected, atol=TOL, rtol=TOL)
            ours.config = vision


def _check_cover(units: tuple, num_tiles: int, depth: int, rows: int) -> None:
    """Every tile through every block exactly once, each tile's blocks in order."""
    done = {t: 0 for t in range(num_tiles)}
    for u in units:
        assert isinstance(u, TileUnit) and u.rows[0] % rows == 0 and u.rows[1] % rows == 0
        for t in range(u.rows[0] // rows, u.rows[1] // rows):
            assert done[t] == u.block
            done[t] += u.num_blocks
    assert set(done.values()) == {depth}


def test_two_images_in_one_forward_are_each_alone() -> None:
    _, ours = towers("6b-112")
    side, px = ours.config.tile_side, ours.config.image_size
    a, b = tiles(1, seed=5, side_px=px), tiles(3, seed=6, side_px=px)
    with torch.no_grad():
        both = ours(torch.cat([a, b]), [(1, side, side), (3, side, side)]).main
        alone = torch.cat([ours(a, [(1, side, side)]).main, ours(b, [(3, side, side)]).main])
    assert torch.equal(both, alone)


def test_pixel_shuffle_is_transformers_permutation() -> None:
    ref, _ = towers("300m-112")
    width = 3
    x = torch.arange(2 * SIDE * SIDE * width, dtype=torch.float32).reshape(2, SIDE, SIDE, width)
    expected = ref.pixel_shuffle(x, scale_factor=0.5).reshape(-1, 4 * width)
    assert torch.equal(pixel_shuffle(x.reshape(2, SIDE * SIDE, width), SIDE, 2), expected)


def _released(embed: int, depth: int, heads: int, mlp: int) -> InternVisionConfig:
    return InternVisionConfig(depth=depth, embed_dim=embed, num_heads=heads,
                              intermediate_size=mlp, out_hidden_size=2048, temporal_patch_size=1)


def test_unit_shapes_of_the_released_towers() -> None:
    small = _released(1024, 24, 16, 4096)  # InternViT-300M-448px-V2_5
    big = _released(3200, 45, 25, 12800)  # InternViT-6B-448px-V2_5 (InternVL3.5-38B)
    assert unit_shape(small, (13, SIDE, SIDE)) == (5, 1)  # 5 x 3.0e10 FLOPs a unit
    assert unit_shape(small, (1, SIDE, SIDE)) == (1, 5)
    assert unit_shape(big, (13, SIDE, SIDE)) == (1, 1)  # one tile-block is 2.65e11 already
    units = tile_units(small, (13, SIDE, SIDE))
    assert [u.rows for u in units[::24]] == [(0, 5 * 1025), (5 * 1025, 10 * 1025),
                                              (10 * 1025, 13 * 1025)]
    assert sum(u.cost_tokens for u in units) == 13 * 256 * 24
    assert sum(u.num_patches for u in units) == 13 * 1025 * 24
    assert sum(u.attention_pairs for u in units) == 13 * 1025**2 * 24
    assert [u.num_blocks for u in tile_units(small, (1, SIDE, SIDE))] == [5, 5, 5, 5, 4]
    assert len(tile_units(big, (13, SIDE, SIDE))) == 13 * 45


def test_what_the_tower_refuses() -> None:
    config = towers("300m-112")[0].config.to_dict()
    for key, value in (("vision_feature_select_strategy", "full"), ("ps_version", "v1"),
                       ("downsample_ratio", 0.4)):
        with pytest.raises(ConfigError):
            parse_vision_config({**config, key: value})
    with pytest.raises(ConfigError):
        parse_vision_config({**config, "vision_config": {"norm_type": "batch_norm"}})
    _, ours = towers("300m-112")
    with pytest.raises(ValueError):
        ours.start_encode(torch.zeros(2, 3, 112, 112), (2, 4, 16))
