"""make-model's recipe for Qwen2-VL (``--family qwen2-vl``, the default): the sizes, transformers'
config and model class, and the Qwen2-VL-2B-Instruct release's layout. Qwen2.5-VL's recipe reuses
its language model's shapes and text config.

    config.json                      layout "transformers" (nested text_config / vision_config) or
                                     "original" (the Qwen2-VL-2B-Instruct release: flat, rope_scaling)
    preprocessor_config.json         Qwen2-VL image processor defaults
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from firsttoken.models.qwen2_vl_vision import IMAGE_PROCESSOR
from firsttoken.models.recipe import (
    MAX_POSITION_EMBEDDINGS,
    RMS_NORM_EPS,
    ROPE_THETA,
    TOKEN_IDS,
    VISION_TOKEN_IDS,
    CheckpointRecipe,
    preprocessor_json,
    text_shape_fields,
)

if TYPE_CHECKING:
    from transformers import Qwen2VLConfig

@dataclass(frozen=True)
class CheckpointShape:
    """Sizes of one named checkpoint; the vision merger's output width is ``hidden_size``."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    mrope_section: tuple[int, int, int]  # (t, h, w) rotary pairs, sums to head_dim / 2
    vision_depth: int
    vision_embed_dim: int
    vision_num_heads: int
    vision_mlp_ratio: int
    dtype: str = "float32"  # on disk

    def __post_init__(self) -> None:
        head_dim = self.hidden_size // self.num_attention_heads
        if sum(self.mrope_section) * 2 != head_dim:
            raise ValueError(
                f"mrope_section {self.mrope_section} must sum to head_dim/2 = {head_dim // 2}"
            )


SIZES: dict[str, CheckpointShape] = {
    "tiny": CheckpointShape(64, 2, 4, 2, 176, (2, 3, 3), 2, 32, 2, 2),
    "small": CheckpointShape(512, 8, 8, 2, 1408, (8, 12, 12), 4, 256, 4, 4),
}


def text_config_dict(shape: CheckpointShape) -> dict[str, Any]:
    """The language model's transformers ``text_config`` for ``shape`` (Qwen2 with M-RoPE), our
    tokenizer's ids."""
    return {
        **text_shape_fields(shape),
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "max_window_layers": shape.num_hidden_layers,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": ROPE_THETA,
            "mrope_section": list(shape.mrope_section),
        },
        "bos_token_id": TOKEN_IDS["<|endoftext|>"],
        "eos_token_id": TOKEN_IDS["<|im_end|>"],
        "dtype": shape.dtype,
    }


def build_hf_config(shape: CheckpointShape) -> "Qwen2VLConfig":
    """The transformers config object for ``shape``, with this tokenizer's special-token ids."""
    from transformers import Qwen2VLConfig

    text = text_config_dict(shape)
    vision = {
        "depth": shape.vision_depth,
        "embed_dim": shape.vision_embed_dim,
        "hidden_size": shape.hidden_size,
        "num_heads": shape.vision_num_heads,
        "mlp_ratio": shape.vision_mlp_ratio,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        dtype=shape.dtype,
        **VISION_TOKEN_IDS,
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    return config


def to_original_key(name: str) -> str:
    """transformers 5 weight name -> Qwen2-VL release name (``model.language_model.`` ->
    ``model.``)."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    return name


def original_config_dict(config: "Qwen2VLConfig", shape: CheckpointShape) -> dict[str, Any]:
    """config.json as the Qwen2-VL-2B-Instruct release lays it out (flat text fields)."""
    text = config.text_config
    vision = config.vision_config
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "attention_dropout": 0.0,
        "bos_token_id": text.bos_token_id,
        "eos_token_id": text.eos_token_id,
        "vision_start_token_id": config.vision_start_token_id,
        "vision_end_token_id": config.vision_end_token_id,
        "vision_token_id": TOKEN_IDS["<|vision_pad|>"],
        "image_token_id": config.image_token_id,
        "video_token_id": config.video_token_id,
        "hidden_act": text.hidden_act,
        "hidden_size": text.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": text.intermediate_size,
        "max_position_embeddings": text.max_position_embeddings,
        "max_window_layers": text.max_window_layers,
        "num_attention_heads": text.num_attention_heads,
        "num_hidden_layers": text.num_hidden_layers,
        "num_key_value_heads": text.num_key_value_heads,
        "rms_norm_eps": text.rms_norm_eps,
        "rope_theta": ROPE_THETA,
        "sliding_window": MAX_POSITION_EMBEDDINGS,
        "tie_word_embeddings": False,
        "torch_dtype": shape.dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "depth": vision.depth,
            "embed_dim": vision.embed_dim,
            "mlp_ratio": vision.mlp_ratio,
            "num_heads": vision.num_heads,
            "in_chans": vision.in_channels,
            "hidden_size": vision.hidden_size,
            "patch_size": vision.patch_size,
            "spatial_merge_size": vision.spatial_merge_size,
            "spatial_patch_size": vision.patch_size,
            "temporal_patch_size": vision.temporal_patch_size,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": list(shape.mrope_section)},
        "vocab_size": text.vocab_size,
    }


def preprocessor_config_dict() -> dict[str, Any]:
    """Qwen2-VL image processor defaults, with both the ``size`` and the legacy min/max_pixels
    keys."""
    p = IMAGE_PROCESSOR
    legacy = {
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "min_pixels": p.min_pixels,
        "max_pixels": p.max_pixels,
    }
    return {**legacy, **preprocessor_json(p, "Qwen2VLImageProcessor", "Qwen2VLProcessor")}


CHECKPOINT_RECIPE = CheckpointRecipe(
    sizes=SIZES,
    hf_config=build_hf_config,
    hf_model="Qwen2VLForConditionalGeneration",
    preprocessor=preprocessor_config_dict,
    original_config=original_config_dict,
    to_original_key=to_original_key,
)
