"""Qwen2.5-VL: Qwen2-VL's decoder (Qwen2 with M-RoPE, the same positions for images) behind a new
vision tower with window attention (qwen2_5_vl_vision); the family's config parsing and value
(``QWEN2_5_VL``, in models/registry.py).

What is Qwen2-VL's and reused as is: the language model (``Qwen2VLModel``), the image processor
(14-px patches, 2 x 2 merge, CLIP mean/std, the same preprocessor_config.json), M-RoPE positions for
images (transformers' ``get_rope_index`` gives image frames a time step of 1, as Qwen2-VL's), and
the checkpoint names, with the vision MLP's gate/up stacked like the decoder's. Its own: video
positions, whose temporal grid g sits at time floor(g * tokens_per_second * second_per_grid_t)
(``positions``). Not served: the decoder's sliding window (refused by ``parse_config``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from firsttoken.models.family import ModelFamily
from firsttoken.models.model_config import (
    ConfigError,
    ConfigReader,
    ModelConfig,
    VisionConfig,
    text_and_vision_dicts,
)
from firsttoken.models.mrope import Grid, MRopePositions, vision_positions
from firsttoken.models.qwen2_5_vl_checkpoint import CHECKPOINT_RECIPE
from firsttoken.models.qwen2_5_vl_vision import (
    Qwen25VisionTransformer,
    merged_window_side,
    window_attention_units,
)
from firsttoken.models.qwen2_vl import QWEN_VL_WEIGHTS, Qwen2VLModel, decoder_layout
from firsttoken.models.qwen2_vl import parse_config as parse_qwen2_vl_config
from firsttoken.models.vision_tower import VISION_ROPE_THETA

QWEN2_5_VL_NAME = "qwen2.5-vl"

# transformers 5.24's Qwen2_5_VLVisionConfig defaults, used where config.json leaves a field out (as
# transformers).
DEFAULT_DEPTH = 32
DEFAULT_EMBED_DIM = 3584
DEFAULT_NUM_HEADS = 16
DEFAULT_INTERMEDIATE_SIZE = 3420
DEFAULT_WINDOW_SIZE = 112
DEFAULT_FULLATT_BLOCK_INDEXES = (7, 15, 23, 31)
DEFAULT_TOKENS_PER_SECOND = 4  # the releases write 2


def vision_config(v: dict[str, Any], lm_hidden_size: int) -> VisionConfig:
    """vision_config in either layout: the release names the input channels ``in_chans`` and repeats
    the patch size as ``spatial_patch_size``; ``hidden_size`` is the tower's width,
    ``out_hidden_size`` the merger's output."""
    vr = ConfigReader(v, "config.json vision_config")
    vision = VisionConfig(
        depth=int(vr.get("depth", DEFAULT_DEPTH)),
        embed_dim=int(vr.get("hidden_size", DEFAULT_EMBED_DIM)),
        num_heads=int(vr.get("num_heads", DEFAULT_NUM_HEADS)),
        intermediate_size=int(vr.get("intermediate_size", DEFAULT_INTERMEDIATE_SIZE)),
        out_hidden_size=int(vr.get("out_hidden_size", lm_hidden_size)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        patch_size=int(v.get("patch_size", v.get("spatial_patch_size", 14))),
        spatial_merge_size=int(vr.get("spatial_merge_size", 2)),
        temporal_patch_size=int(vr.get("temporal_patch_size", 2)),
        hidden_act=str(vr.get("hidden_act", "silu")),
        window_size=int(vr.get("window_size", DEFAULT_WINDOW_SIZE)),
        fullatt_block_indexes=tuple(
            int(i) for i in vr.get("fullatt_block_indexes", DEFAULT_FULLATT_BLOCK_INDEXES)
        ),
        tokens_per_second=float(vr.get("tokens_per_second", DEFAULT_TOKENS_PER_SECOND)),
    )
    theta = float((v.get("rope_parameters") or {}).get("rope_theta", VISION_ROPE_THETA))
    if theta != VISION_ROPE_THETA:
        raise ConfigError(
            f"config.json vision_config: rope_theta {theta:g} unsupported ({VISION_ROPE_THETA:g})"
        )
    if vision.hidden_act != "silu":
        raise ConfigError(
            f"config.json vision_config: hidden_act {vision.hidden_act!r} unsupported (silu)"
        )
    if merged_window_side(vision) < 1:
        raise ConfigError(
            f"config.json vision_config: window_size {vision.window_size} is smaller than one merged token "
            f"({vision.pixels_per_token} px)"
        )
    if vision.out_hidden_size != lm_hidden_size:
        raise ConfigError(
            f"config.json vision_config: out_hidden_size {vision.out_hidden_size} != the language model's "
            f"hidden_size {lm_hidden_size}"
        )
    return vision


def parse_config(d: dict[str, Any], preprocessor: dict[str, Any] | None) -> ModelConfig:
    """Qwen2.5-VL's config.json in either layout: "original" (the release, e.g.
    Qwen2.5-VL-7B-Instruct: flat text fields, ``rope_scaling``) or "transformers" (nested
    ``text_config``, ``rope_parameters``). The text fields and the image processor are Qwen2-VL's,
    read by its parser; the vision tower's are this family's."""
    text, v, _ = text_and_vision_dicts(d)
    if text.get("use_sliding_window"):
        raise ConfigError(
            "config.json: use_sliding_window is true; the decoder's sliding window is not supported"
        )
    # the text side, Qwen2-VL's tower
    base = parse_qwen2_vl_config({**d, "vision_config": {}}, preprocessor)
    return replace(base, family=QWEN2_5_VL_NAME, vision=vision_config(v, base.hidden_size))


def positions(
    input_ids: Sequence[int],
    image_grid_thw: Sequence[Grid],
    config: ModelConfig,
    video_grid_thw: Sequence[Grid] = (),
    second_per_grid_ts: Sequence[float] = (),
) -> MRopePositions:
    """Qwen2.5-VL's positions: video k steps ``tokens_per_second * second_per_grid_ts[k]`` per
    temporal grid (1 s per grid when ``second_per_grid_ts`` is empty). transformers' processor hands
    ``second_per_grid_ts`` over as a float32 tensor, so the step and ``arange(t) * step`` are
    float32 products truncated to int64: computed the same way here, a fractional step (2 / 1.5 s
    per grid) lands on the same integer positions."""
    if second_per_grid_ts and len(second_per_grid_ts) != len(video_grid_thw):
        raise ValueError(
            f"{len(second_per_grid_ts)} second_per_grid_ts for {len(video_grid_thw)} videos"
        )
    seconds = second_per_grid_ts or [1.0] * len(video_grid_thw)
    steps = [
        torch.tensor(s, dtype=torch.float32) * config.vision.tokens_per_second for s in seconds
    ]
    return vision_positions(input_ids, image_grid_thw, config, video_grid_thw, steps)


QWEN2_5_VL = ModelFamily(
    name=QWEN2_5_VL_NAME,
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    model_types=("qwen2_5_vl",),
    parse_config=parse_config,
    build=lambda config, backend: Qwen2VLModel(
        config, backend, visual=Qwen25VisionTransformer(config.vision)
    ),
    # the vision MLP's mlp.gate_proj / mlp.up_proj stack into mlp.gate_up_proj as well
    weights=QWEN_VL_WEIGHTS,
    encoder_units=window_attention_units,
    checkpoint=CHECKPOINT_RECIPE,
    positions=positions,
    decoder_layout=decoder_layout,
)
