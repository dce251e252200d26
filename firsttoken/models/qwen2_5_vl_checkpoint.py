"""make-model's recipe for Qwen2.5-VL (``--family qwen2.5-vl``): random checkpoints with the
release's config fields.

The language model is Qwen2-VL's shape of the same size (qwen2_vl_checkpoint.py SIZES: same text
config, tokenizer, chat template and generation config); the vision tower is Qwen2.5-VL's: RMSNorm,
a SwiGLU MLP of its own width, 112-px windows and a few full-attention blocks (the 7B release: depth
32, full attention in blocks 7, 15, 23, 31; here depth 4 with (1, 3) for tiny, depth 8 with (3, 7)
for small). Layouts:

    transformers   Qwen2_5_VLConfig.save_pretrained (nested text_config / vision_config), weights named
                   model.language_model.* / model.visual.*
    original       the Qwen2.5-VL-7B-Instruct release: flat text fields, ``rope_scaling`` {type: mrope},
                   vision_config with ``in_chans`` and ``spatial_patch_size``, weights named model.* / visual.*
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from firsttoken.models.qwen2_vl_checkpoint import (
    SIZES,
    CheckpointShape,
    build_hf_config,
    original_config_dict,
    preprocessor_config_dict,
    text_config_dict,
    to_original_key,
)
from firsttoken.models.recipe import VISION_TOKEN_IDS, CheckpointRecipe

if TYPE_CHECKING:
    from transformers import Qwen2_5_VLConfig

TOKENS_PER_SECOND = 2  # video time positions per second (the release's value; images never use it)


@dataclass(frozen=True)
class VisionShape:
    depth: int
    embed_dim: int  # the blocks' width (config "hidden_size")
    num_heads: int
    intermediate_size: int  # the SwiGLU MLP's width
    # blocks attending over the whole image; the others within windows
    fullatt_block_indexes: tuple[int, ...]
    window_size: int = 112  # pixels per window side: 4 x 4 merged tokens


@dataclass(frozen=True)
class Qwen25Shape:
    # the language model: Qwen2-VL's shape of the same size (its vision_* fields unused)
    text: CheckpointShape
    vision: VisionShape

    @property
    def dtype(self) -> str:
        return self.text.dtype


QWEN2_5_VL_SIZES: dict[str, Qwen25Shape] = {
    "tiny": Qwen25Shape(SIZES["tiny"], VisionShape(4, 32, 2, 88, (1, 3))),
    # ~46M parameters, next to Qwen2-VL small's ~44M: the same language model, a deeper but
    # narrower-MLP tower
    "small": Qwen25Shape(SIZES["small"], VisionShape(8, 256, 4, 688, (3, 7))),
}


def vision_config_dict(shape: Qwen25Shape) -> dict[str, Any]:
    v = shape.vision
    return {
        "depth": v.depth,
        "hidden_act": "silu",
        "hidden_size": v.embed_dim,
        "intermediate_size": v.intermediate_size,
        "num_heads": v.num_heads,
        "out_hidden_size": shape.text.hidden_size,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": v.window_size,
        "fullatt_block_indexes": list(v.fullatt_block_indexes),
        "tokens_per_second": TOKENS_PER_SECOND,
    }


def build_qwen2_5_vl_config(shape: Qwen25Shape) -> Qwen2_5_VLConfig:
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(
        text_config=text_config_dict(shape.text),
        vision_config=vision_config_dict(shape),
        tie_word_embeddings=False,
        dtype=shape.dtype,
        **VISION_TOKEN_IDS,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return config


def original_layout_config(config: Qwen2_5_VLConfig, shape: Qwen25Shape) -> dict[str, Any]:
    """config.json as Qwen2.5-VL-7B-Instruct lays it out: Qwen2-VL's flat text fields, this
    vision_config."""
    flat = original_config_dict(build_hf_config(shape.text), shape.text)
    vision = vision_config_dict(shape)
    vision["in_chans"] = 3
    vision["spatial_patch_size"] = vision["patch_size"]
    return {
        **flat,
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "vision_config": vision,
    }


CHECKPOINT_RECIPE = CheckpointRecipe(
    sizes=QWEN2_5_VL_SIZES,
    hf_config=build_qwen2_5_vl_config,
    hf_model="Qwen2_5_VLForConditionalGeneration",
    preprocessor=lambda: {**preprocessor_config_dict(), "processor_class": "Qwen2_5_VLProcessor"},
    original_config=original_layout_config,
    to_original_key=to_original_key,
)

