"""make-model's recipe for Qwen3-VL: random checkpoints with the family's real config fields.

``tiny`` keeps every Qwen3-VL feature that can go wrong at test speed: an explicit head_dim (32)
that is not hidden / heads (16), GQA, uneven interleaved M-RoPE sections (6, 5, 5), q/k norms, three
decoder layers so two take DeepStack features and one does not, a four-block vision tower with
DeepStack after blocks 1 and 2, and an 8x8 learned position table that every image's grid resamples.
``small`` (~44M parameters) matches Qwen2-VL small's language model, with Qwen3-VL-8B's three
DeepStack features. Both untied, as Qwen3-VL-8B (the 2B/4B releases tie lm_head to the embeddings;
the oracle tests cover that with a checkpoint transformers writes).

Layouts: "transformers" is transformers 5's ``save_pretrained`` (``rope_parameters`` holding theta,
sections and ``mrope_interleaved``); "original" is the releases' config.json (transformers 4.57:
``rope_scaling`` + ``rope_theta`` in ``text_config``, vision ``model_type`` "qwen3_vl"). Weight
names are the same in both. The preprocessor config is the releases': 16-px patches, 0.5 mean/std,
{shortest_edge 256^2, longest_edge 4096^2}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from firsttoken.models.qwen3_vl_vision import IMAGE_PROCESSOR
from firsttoken.models.recipe import (
    MAX_POSITION_EMBEDDINGS,
    RMS_NORM_EPS,
    TOKEN_IDS,
    CheckpointRecipe,
    preprocessor_json,
    text_shape_fields,
)

if TYPE_CHECKING:
    from transformers import Qwen3VLConfig

ROPE_THETA = 5_000_000.0  # Qwen3-VL-8B-Instruct's


@dataclass(frozen=True)
class Qwen3VLShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # explicit, as Qwen3 (need not be hidden_size / num_attention_heads)
    intermediate_size: int
    mrope_section: tuple[int, int, int]  # (t, h, w) rotary pairs, interleaved; sums to head_dim / 2
    vision_depth: int
    vision_hidden_size: int
    vision_num_heads: int
    vision_intermediate_size: int
    deepstack_visual_indexes: tuple[int, ...]
    num_position_embeddings: int  # a square: side^2 learned positions
    dtype: str = "float32"  # on disk

    def __post_init__(self) -> None:
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(
                f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}"
            )
        if any(not 0 <= i < self.vision_depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} outside depth {self.vision_depth}")
        if int(self.num_position_embeddings**0.5) ** 2 != self.num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings {self.num_position_embeddings} is not a square"
            )


SIZES: dict[str, Qwen3VLShape] = {
    "tiny": Qwen3VLShape(64, 3, 4, 2, 32, 176, (6, 5, 5), 4, 32, 2, 64, (1, 2), 64),
    "small": Qwen3VLShape(512, 8, 8, 2, 64, 1408, (12, 10, 10), 4, 256, 4, 1024, (0, 1, 2), 576),
}


def build_hf_config(shape: Qwen3VLShape) -> "Qwen3VLConfig":
    """transformers 5's config for ``shape``, with this tokenizer's special-token ids."""
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig(
        text_config={
            **_text_fields(shape),
            "rope_parameters": {**_mrope(shape), "rope_theta": ROPE_THETA},
        },
        vision_config=_vision_fields(shape),
        image_token_id=TOKEN_IDS["<|image_pad|>"],
        video_token_id=TOKEN_IDS["<|video_pad|>"],
        vision_start_token_id=TOKEN_IDS["<|vision_start|>"],
        vision_end_token_id=TOKEN_IDS["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype=shape.dtype,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    return config


def original_config_dict(config: "Qwen3VLConfig", shape: Qwen3VLShape) -> dict[str, Any]:
    """config.json as the Qwen3-VL releases lay it out (Qwen3-VL-8B-Instruct's keys)."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": config.image_token_id,
        "model_type": "qwen3_vl",
        "text_config": {
            **_text_fields(shape),
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "model_type": "qwen3_vl_text",
            "rope_scaling": _mrope(shape),
            "rope_theta": ROPE_THETA,
            "use_cache": True,
        },
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": config.video_token_id,
        "vision_config": {
            **_vision_fields(shape),
            "initializer_range": 0.02,
            "model_type": "qwen3_vl",
        },
        "vision_end_token_id": config.vision_end_token_id,
        "vision_start_token_id": config.vision_start_token_id,
    }


def _text_fields(shape: Qwen3VLShape) -> dict[str, Any]:
    return {
        **text_shape_fields(shape),
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": RMS_NORM_EPS,
        "bos_token_id": TOKEN_IDS["<|endoftext|>"],
        "eos_token_id": TOKEN_IDS["<|im_end|>"],
        "dtype": shape.dtype,
    }


def _mrope(shape: Qwen3VLShape) -> dict[str, Any]:
    return {
        "rope_type": "default",
        "mrope_section": list(shape.mrope_section),
        "mrope_interleaved": True,
    }


def _vision_fields(shape: Qwen3VLShape) -> dict[str, Any]:
    return {
        "depth": shape.vision_depth,
        "hidden_size": shape.vision_hidden_size,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": shape.vision_intermediate_size,
        "num_heads": shape.vision_num_heads,
        "in_channels": 3,
        "patch_size": IMAGE_PROCESSOR.patch_size,
        "spatial_merge_size": IMAGE_PROCESSOR.merge_size,
        "temporal_patch_size": IMAGE_PROCESSOR.temporal_patch_size,
        "out_hidden_size": shape.hidden_size,
        "num_position_embeddings": shape.num_position_embeddings,
        "deepstack_visual_indexes": list(shape.deepstack_visual_indexes),
    }


CHECKPOINT_RECIPE = CheckpointRecipe(
    sizes=SIZES,
    hf_config=build_hf_config,
    hf_model="Qwen3VLForConditionalGeneration",
    # the releases' preprocessor_config.json (transformers maps it to Qwen2VLImageProcessor)
    preprocessor=lambda: preprocessor_json(
        IMAGE_PROCESSOR, "Qwen2VLImageProcessorFast", "Qwen3VLProcessor"
    ),
    original_config=original_config_dict,
)
