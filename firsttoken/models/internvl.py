"""InternVL3.5 (``InternVLForConditionalGeneration``, the -HF releases): InternViT over 448x448
tiles plus a thumbnail (internvl_vision.py, internvl_tiles.py), the projector, and a Qwen3 language
model (InternVL3's Qwen2 one is read too); the family's config parsing and its ``ModelFamily``
value (``INTERNVL``).

The decoder is Qwen2-VL's (qwen2_vl.py) configured by ``text_config.model_type``: "qwen3" (no q/k/v
bias, q/k norms, an explicit head_dim) or "qwen2" (biases, no norms). Positions are plain 1-D RoPE:
every token, image pads included, one step after the previous, which the M-RoPE decoder computes
exactly when the three axes carry the same position. An image is the grid (tiles, 32, 32) at a 2x2
merge: 256 tokens a tile, the prompt's pads between ``<img>`` and ``</img>``, which the renderer
writes around the template's one ``<IMG_CONTEXT>`` (``INTERNVL_IMAGE_SLOTS``). The budget ladder is
in tiles (internvl_tiles.TileLadder). Videos are not served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from firsttoken.attention.base import AttentionBackend
from firsttoken.models.family import ImageSlots, ModelFamily
from firsttoken.models.internvl_checkpoint import (
    CHECKPOINT_RECIPE,
    END_IMAGE_TOKEN,
    IMAGE_TOKEN,
    START_IMAGE_TOKEN,
    VIDEO_TOKEN,
)
from firsttoken.models.internvl_tiles import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MAX_PATCHES,
    MIN_PATCHES,
    TILE_LADDER,
)
from firsttoken.models.internvl_vision import (
    INTERNVL_VISION_WEIGHTS,
    InternVisionTransformer,
    parse_vision_config,
    tile_units,
)
from firsttoken.models.model_config import (
    ConfigError,
    ConfigReader,
    ImageProcessorConfig,
    ModelConfig,
    TileSpec,
    decoder_sizes,
    eos_ids,
)
from firsttoken.models.mrope import Grid, MRopePositions
from firsttoken.models.qwen2_vl import Qwen2VLModel, decoder_layout
from firsttoken.models.weights import QKV_AND_GATE_UP, WeightMapping

INTERNVL_NAME = "internvl3.5"
# InternVL3.5-HF's tokenizer: <img>, </img>, <IMG_CONTEXT> (config.json names only the last)
START_IMAGE_TOKEN_ID = 151669
END_IMAGE_TOKEN_ID = 151670
DEFAULT_IMAGE_TOKEN_ID = 151671
TEXT_MODEL_TYPES = {"qwen3": (False, True), "qwen2": (True, False)}  # (q/k/v bias, q/k norms)


def parse_config(d: dict[str, Any], preprocessor: dict[str, Any] | None) -> ModelConfig:
    """InternVL's config.json (transformers' layout: ``text_config`` and ``vision_config``
    nested) and its preprocessor_config.json (the tiling: size, min and max patches, mean, std)."""
    if not isinstance(d.get("text_config"), dict):
        raise ConfigError("config.json has no 'text_config' (InternVL nests its language model there)")
    text = d["text_config"]
    t = ConfigReader(text, "config.json text_config")
    model_type = str(t.get("model_type", "qwen2"))
    if model_type not in TEXT_MODEL_TYPES:
        raise ConfigError(f"config.json text_config: model_type {model_type!r} unsupported "
                          f"({', '.join(TEXT_MODEL_TYPES)})")
    bias, qk_norm = TEXT_MODEL_TYPES[model_type]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"config.json text_config: rope_type {rope.get('rope_type')!r} unsupported (default)")
    hidden = int(t.require("hidden_size"))
    num_heads = int(t.require("num_attention_heads"))
    head_dim = int(t.get("head_dim", hidden // num_heads))
    vision = parse_vision_config(d)
    image_token = int(d.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))
    return ModelConfig(
        family=INTERNVL_NAME,
        **decoder_sizes(t, hidden, num_heads),
        head_dim=head_dim,
        max_position_embeddings=int(t.get("max_position_embeddings", 40960)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1_000_000.0))),
        # one axis carries every rotary pair: 1-D RoPE (the three axes' positions are equal)
        mrope_section=(head_dim // 2, 0, 0),
        attention_bias=bias,
        qk_norm=qk_norm,
        # the top level's, as transformers reads it (InternVLConfig's default: tied)
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        image_token_id=image_token,
        video_token_id=-1,  # no video
        vision_start_token_id=int(d.get("start_image_token_id", START_IMAGE_TOKEN_ID)),
        vision_end_token_id=int(d.get("end_image_token_id", END_IMAGE_TOKEN_ID)),
        vision=vision,
        image_processor=_image_processor(preprocessor, vision.patch_size, vision.spatial_merge_size,
                                         vision.image_size),
        hidden_act=str(t.get("hidden_act", "silu")),
        eos_token_ids=eos_ids(text.get("eos_token_id", d.get("eos_token_id"))),
    )


def _image_processor(pre: dict[str, Any] | None, patch: int, merge: int, tile: int
                     ) -> ImageProcessorConfig:
    """The tiling from preprocessor_config.json (InternVLProcessor crops to patches whatever
    ``crop_to_patches`` says), over the -HF releases' values."""
    p = ConfigReader(pre or {}, "preprocessor_config.json")
    size = p.get("size", {}) or {}
    side = int(size.get("height", tile))
    if side != tile or int(size.get("width", side)) != side:
        raise ConfigError(f"preprocessor_config.json size {size} must be the tower's {tile}x{tile} tiles")
    return ImageProcessorConfig(
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=1,
        image_mean=tuple(float(x) for x in p.get("image_mean", IMAGENET_MEAN)),  # type: ignore[arg-type]
        image_std=tuple(float(x) for x in p.get("image_std", IMAGENET_STD)),  # type: ignore[arg-type]
        tiles=TileSpec(side, int(p.get("min_patches", MIN_PATCHES)), int(p.get("max_patches", MAX_PATCHES))),
    )


def positions(
    input_ids: Sequence[int],
    image_grid_thw: Sequence[Grid],
    config: ModelConfig,
    video_grid_thw: Sequence[Grid] = (),
    second_per_grid_ts: Sequence[float] = (),
) -> MRopePositions:
    """1-D positions, the same on the three axes; the image pads must match the grids' tokens."""
    merge = config.vision.spatial_merge_size
    expected = sum(t * h * w // merge**2 for t, h, w in image_grid_thw)
    found = sum(1 for token in input_ids if token == config.image_token_id)
    if found != expected or video_grid_thw:
        raise ValueError(f"{found} image pads for grids of {expected} tokens"
                         + (" (videos are not served)" if video_grid_thw else ""))
    ids = torch.arange(len(input_ids), dtype=torch.int64)
    return MRopePositions(ids.expand(3, -1).contiguous(), 0)


class InternVLModel(Qwen2VLModel):
    """Qwen2-VL's decoder configured as InternVL's language model over InternViT and the
    projector (``visual``)."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__(config, attn_backend, visual=InternVisionTransformer(config.vision))


INTERNVL_WEIGHTS = WeightMapping(
    prefixes=(
        ("model.language_model.", ""),
        *INTERNVL_VISION_WEIGHTS.prefixes,
        ("lm_head.", "lm_head."),
    ),
    stacked=(*QKV_AND_GATE_UP, *INTERNVL_VISION_WEIGHTS.stacked),
    reshape=INTERNVL_VISION_WEIGHTS.reshape,
    skip_suffixes=("rotary_emb.inv_freq", *INTERNVL_VISION_WEIGHTS.skip_suffixes),
    renames=INTERNVL_VISION_WEIGHTS.renames,
)

# the template writes <IMG_CONTEXT> alone; the renderer wraps the image's pads in <img>...</img>,
# as transformers' InternVLProcessor does
INTERNVL_IMAGE_SLOTS = ImageSlots(
    pad=IMAGE_TOKEN,
    start=START_IMAGE_TOKEN,
    end=END_IMAGE_TOKEN,
    renderer_wraps=True,
    control=(START_IMAGE_TOKEN, END_IMAGE_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN),
)

INTERNVL = ModelFamily(
    name=INTERNVL_NAME,
    architectures=("InternVLForConditionalGeneration",),
    model_types=("internvl",),
    parse_config=parse_config,
    build=lambda config, backend: InternVLModel(config, backend),
    weights=INTERNVL_WEIGHTS,
    encoder_units=tile_units,
    checkpoint=CHECKPOINT_RECIPE,
    positions=positions,
    decoder_layout=decoder_layout,
    budget_ladder=TILE_LADDER,
    video=False,
    image_slots=INTERNVL_IMAGE_SLOTS,
)
