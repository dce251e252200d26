"""Qwen3-VL (dense: 2B/4B/8B/32B): a Qwen3 decoder with interleaved M-RoPE and DeepStack, over the
Qwen3-VL vision tower (qwen3_vl_vision.py); the family's config parsing and its ``ModelFamily``
value (``QWEN3_VL``).

The decoder is Qwen2-VL's (qwen2_vl.py) configured as Qwen3: q/k/v without bias, RMSNorm over each
head of q and k before rotary (``qk_norm``), an explicit ``head_dim`` (need not be hidden / heads),
interleaved M-RoPE sections (every third rotary pair per axis, layers.mrope_cos_sin) with its own
rope theta, and DeepStack: an image's feature k (``ImageEmbeddings.deepstack[k]``) is added to its
rows after decoder layer k. Prompt positions are Qwen2-VL's (images advance the running position by
max(h, w) / merge), weight names are the Qwen-VL ones (``model.language_model.*``,
``model.visual.*``, ``lm_head``), encoder units one full-attention block each.

Video: transformers' Qwen3VLProcessor replaces each template ``<|video_pad|>`` with, per temporal
grid, ``<{t:.1f} seconds>`` + vision_start + (h/m)(w/m) video pads + vision_end. The chat template
(the releases' and make-model's) already wraps the pad as
``<|vision_start|><|video_pad|><|vision_end|>``, so the prompt holds that outer pair around the
per-grid blocks (nested vision_start / vision_end), and every timestamp's text sits between two
special tokens. ``get_rope_index`` then treats each grid as its own (1, h, w) vision run, timestamps
as text.

The MoE variant (Qwen3-VL-30B-A3B, ``Qwen3VLMoeForConditionalGeneration``) is not served: its
architecture is not listed, so the registry refuses it by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from firsttoken.attention.base import AttentionBackend
from firsttoken.models.family import ModelFamily
from firsttoken.models.model_config import (
    ConfigError,
    ConfigReader,
    ModelConfig,
    VisionConfig,
    decoder_sizes,
    eos_ids,
    image_processor_config,
    text_and_vision_dicts,
    vision_token_ids,
)
from firsttoken.models.mrope import Grid, MRopePositions, compute_mrope_positions
from firsttoken.models.qwen2_vl import QWEN_VL_WEIGHTS, Qwen2VLModel, decoder_layout
from firsttoken.models.qwen2_vl_vision import full_attention_units
from firsttoken.models.qwen3_vl_checkpoint import CHECKPOINT_RECIPE
from firsttoken.models.qwen3_vl_vision import (
    IMAGE_PROCESSOR,
    VISION_RENAMES,
    Qwen3VisionTransformer,
    deepstack_bytes_per_token,
)
from firsttoken.models.vision_tower import VISION_ROPE_THETA

QWEN3_VL_NAME = "qwen3-vl"
# transformers' Qwen3VLTextConfig default (the releases set 5,000,000)
DEFAULT_ROPE_THETA = 500_000.0
DEFAULT_MROPE_SECTION = (24, 20, 20)  # transformers' default for head_dim 128


def parse_config(d: dict[str, Any], preprocessor: dict[str, Any] | None) -> ModelConfig:
    """Qwen3-VL's config.json, nested under ``text_config`` / ``vision_config`` in both layouts it
    ships in: the releases (transformers 4.57: ``rope_scaling`` with mrope_section /
    mrope_interleaved and ``rope_theta`` beside it) and transformers 5's ``save_pretrained``
    (``rope_parameters`` holding all of them)."""
    if not isinstance(d.get("text_config"), dict):
        raise ConfigError(
            "config.json has no 'text_config' (Qwen3-VL nests the language model's fields there)"
        )
    text, v, _ = text_and_vision_dicts(d)
    layout = "original" if "rope_parameters" not in d["text_config"] else "transformers"
    t = ConfigReader(text, "config.json text_config")
    vr = ConfigReader(v, "config.json vision_config")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise ConfigError(
            f"config.json text_config: rope_type {rope.get('rope_type')!r} unsupported (default)"
        )
    if t.get("attention_bias", False):
        raise ConfigError("config.json text_config: attention_bias=true is unsupported (no Qwen3-VL release has it)")
    vision_rope = v.get("rope_parameters") or {}
    if float(vision_rope.get("rope_theta", VISION_ROPE_THETA)) != VISION_ROPE_THETA:
        raise ConfigError(f"config.json vision_config: rope_theta must be {VISION_ROPE_THETA:g}")
    hidden = int(t.require("hidden_size"))
    num_heads = int(t.require("num_attention_heads"))
    head_dim = int(t.get("head_dim", hidden // num_heads))
    vision = VisionConfig(
        # transformers' Qwen3VLVisionConfig defaults where a field is absent
        depth=int(vr.get("depth", 27)),
        embed_dim=int(vr.get("hidden_size", 1152)),
        num_heads=int(vr.get("num_heads", 16)),
        intermediate_size=int(vr.get("intermediate_size", 4304)),
        out_hidden_size=int(vr.get("out_hidden_size", 3584)),
        in_channels=int(vr.get("in_channels", 3)),
        patch_size=int(vr.get("patch_size", 16)),
        spatial_merge_size=int(vr.get("spatial_merge_size", 2)),
        temporal_patch_size=int(vr.get("temporal_patch_size", 2)),
        hidden_act=str(vr.get("hidden_act", "gelu_pytorch_tanh")),
        deepstack_visual_indexes=tuple(
            int(i) for i in vr.get("deepstack_visual_indexes", (8, 16, 24))
        ),
        num_position_embeddings=int(vr.get("num_position_embeddings", 2304)),
    )
    if vision.out_hidden_size != hidden:
        raise ConfigError(
            "config.json: vision_config.out_hidden_size must equal text_config.hidden_size"
        )
    return ModelConfig(
        family=QWEN3_VL_NAME,
        **decoder_sizes(t, hidden, num_heads),
        head_dim=head_dim,
        max_position_embeddings=int(t.get("max_position_embeddings", 128000)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", DEFAULT_ROPE_THETA))),
        mrope_section=tuple(int(x) for x in rope.get("mrope_section") or DEFAULT_MROPE_SECTION),
        # transformers interleaves whatever mrope_interleaved says (the releases all say true)
        mrope_interleaved=True,
        attention_bias=False,
        qk_norm=True,
        # top level only, as transformers reads it
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        **vision_token_ids(d),
        vision=vision,
        image_processor=image_processor_config(preprocessor, IMAGE_PROCESSOR),
        hidden_act=str(t.get("hidden_act", "silu")),
        eos_token_ids=eos_ids(d["text_config"].get("eos_token_id", d.get("eos_token_id"))),
        layout=layout,
    )


def positions(
    input_ids: Sequence[int],
    image_grid_thw: Sequence[Grid],
    config: ModelConfig,
    video_grid_thw: Sequence[Grid] = (),
    second_per_grid_ts: Sequence[float] = (),
) -> MRopePositions:
    """Qwen3-VL's positions: a video of (t, h, w) is t runs of (1, h, w) pads, each at time step 0
    of its own run (as transformers splits ``video_grid_thw``; per-grid (1, h, w) entries are taken
    as they are). Time is carried by the timestamp text between runs; ``second_per_grid_ts`` is
    ignored."""
    grids = [(1, int(h), int(w)) for t, h, w in video_grid_thw for _ in range(int(t))]
    return compute_mrope_positions(input_ids, image_grid_thw, config, grids)


def video_prompt_tokens(
    grid_thw: Grid,
    grid_timestamps_s: Sequence[float],
    config: ModelConfig,
    encode: Callable[[str], list[int]],
) -> list[int]:
    """Per temporal grid: ``encode("<{t:.1f} seconds>")`` + vision_start + (h/m)(w/m) video pads +
    vision_end, as Qwen3VLProcessor.replace_video_token writes it. Encoding each timestamp alone
    equals tokenizing the processor's whole string because special tokens split the text before BPE
    and each timestamp lies between two of them (the template's vision_start or the previous grid's
    vision_end before it, the grid's vision_start after)."""
    t, h, w = grid_thw
    if len(grid_timestamps_s) != t:
        raise ValueError(
            f"video of {t} temporal grids has {len(grid_timestamps_s)} grid timestamps"
        )
    pads = [config.video_token_id] * (h * w // config.vision.spatial_merge_size**2)
    frame = [config.vision_start_token_id, *pads, config.vision_end_token_id]
    return [
        tok for time_s in grid_timestamps_s for tok in (*encode(f"<{time_s:.1f} seconds>"), *frame)
    ]


class Qwen3VLModel(Qwen2VLModel):
    """Qwen2-VL's decoder configured as Qwen3 (see the module docstring) over Qwen3-VL's vision
    tower."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__(config, attn_backend, visual=Qwen3VisionTransformer(config.vision))


QWEN3_VL = ModelFamily(
    name=QWEN3_VL_NAME,
    architectures=("Qwen3VLForConditionalGeneration",),
    model_types=("qwen3_vl",),
    parse_config=parse_config,
    build=lambda config, backend: Qwen3VLModel(config, backend),
    weights=replace(QWEN_VL_WEIGHTS, renames=VISION_RENAMES),
    encoder_units=full_attention_units,
    checkpoint=CHECKPOINT_RECIPE,
    positions=positions,
    video_prompt_tokens=video_prompt_tokens,
    encoder_bytes_per_token=deepstack_bytes_per_token,
    decoder_layout=decoder_layout,
)
