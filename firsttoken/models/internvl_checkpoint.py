"""make-model's recipe for InternVL3.5: random checkpoints with the family's real config fields.

The model is transformers 5's ``InternVLForConditionalGeneration``: an InternViT tower over 448x448
tiles (14-px patches, pixel shuffle 0.5: 256 tokens a tile), the projector, and a Qwen3 language
model (``text_config.model_type`` "qwen3": q/k norms, no q/k/v bias, an explicit head_dim, plain 1-D
RoPE). ``tiny`` keeps what can go wrong at test speed: GQA, a head_dim (32) that is not hidden /
heads (16), layer scale, and the real tile geometry (a tile is 1,025 rows through a 32-wide tower);
``small`` (~44M parameters in the language model) matches the Qwen families' small. Both untied.

The tokenizer is ours plus the -HF releases' control tokens ``<img>``, ``</img>``,
``<IMG_CONTEXT>`` and ``<video>`` (ids 16014 to 16017, named in tokenizer_config.json as transformers'
``InternVLProcessor`` reads them), and its chat template writes ``<IMG_CONTEXT>`` once per image as
the releases' does; the processor (transformers', or firsttoken's renderer) puts an image's tiles'
pads there between ``<img>`` and ``</img>``. config.json holds their ids: ``image_token_id``,
``start_image_token_id``, ``end_image_token_id``. The preprocessor config is the -HF releases':
448-px tiles, 1 to 12 of them, ImageNet mean and std.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from firsttoken.models.internvl_tiles import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MAX_PATCHES,
    TILE_SIZE,
)
from firsttoken.models.recipe import (
    MAX_POSITION_EMBEDDINGS,
    RMS_NORM_EPS,
    TOKEN_IDS,
    CheckpointRecipe,
    added_token_ids,
    text_shape_fields,
)

if TYPE_CHECKING:
    from transformers import InternVLConfig

ROPE_THETA = 1_000_000.0  # Qwen3's
PATCH_SIZE = 14
# the -HF releases' control tokens, as their tokenizer spells them
START_IMAGE_TOKEN, END_IMAGE_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN = "<img>", "</img>", "<IMG_CONTEXT>", "<video>"
ADDED_TOKENS = (START_IMAGE_TOKEN, END_IMAGE_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN)
ADDED_TOKEN_IDS = added_token_ids(ADDED_TOKENS)
IMAGE_TOKEN_IDS = {
    "image_token_id": ADDED_TOKEN_IDS[IMAGE_TOKEN],
    "start_image_token_id": ADDED_TOKEN_IDS[START_IMAGE_TOKEN],
    "end_image_token_id": ADDED_TOKEN_IDS[END_IMAGE_TOKEN],
}
# transformers' InternVLProcessor reads these off the tokenizer (tokenizer.start_image_token ...)
NAMED_TOKENS = {
    "start_image_token": START_IMAGE_TOKEN,
    "end_image_token": END_IMAGE_TOKEN,
    "context_image_token": IMAGE_TOKEN,
    "video_token": VIDEO_TOKEN,
}
# The -HF releases' image and video parts (one <IMG_CONTEXT> or <video> and a newline each, no
# start/end tokens) in our Qwen2-VL template's turns.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif content['type'] == 'video' %}<video>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class InternVLShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # explicit, as Qwen3
    intermediate_size: int
    vision_depth: int
    vision_hidden_size: int
    vision_num_heads: int
    vision_intermediate_size: int
    vision_norm_type: str = "layer_norm"  # InternViT-300M's; "rms_norm" with QK-norm is 6B's
    vision_qk_norm: bool = False
    dtype: str = "float32"  # on disk


SIZES: dict[str, InternVLShape] = {
    "tiny": InternVLShape(64, 3, 4, 2, 32, 176, 2, 32, 2, 64),
    "small": InternVLShape(512, 8, 8, 2, 64, 1408, 4, 256, 4, 1024),
}


def build_hf_config(shape: InternVLShape) -> InternVLConfig:
    """transformers 5's config for ``shape``, with this tokenizer's ids."""
    from transformers import InternVLConfig

    config = InternVLConfig(
        vision_config=_vision_fields(shape),
        text_config=_text_fields(shape),
        image_token_id=IMAGE_TOKEN_IDS["image_token_id"],
        image_seq_length=(TILE_SIZE // PATCH_SIZE // 2) ** 2,
        downsample_ratio=0.5,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
        dtype=shape.dtype,
    )
    config.architectures = ["InternVLForConditionalGeneration"]
    config.start_image_token_id = IMAGE_TOKEN_IDS["start_image_token_id"]
    config.end_image_token_id = IMAGE_TOKEN_IDS["end_image_token_id"]
    return config


def _text_fields(shape: InternVLShape) -> dict[str, Any]:
    return {
        **text_shape_fields(shape),
        "model_type": "qwen3",
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "tie_word_embeddings": False,
        "bos_token_id": TOKEN_IDS["<|endoftext|>"],
        "eos_token_id": TOKEN_IDS["<|im_end|>"],
        "dtype": shape.dtype,
    }


def _vision_fields(shape: InternVLShape) -> dict[str, Any]:
    return {
        "hidden_size": shape.vision_hidden_size,
        "num_hidden_layers": shape.vision_depth,
        "num_attention_heads": shape.vision_num_heads,
        "intermediate_size": shape.vision_intermediate_size,
        "hidden_act": "gelu",
        "norm_type": shape.vision_norm_type,
        "use_qk_norm": shape.vision_qk_norm,
        "attention_bias": True,
        "layer_norm_eps": 1e-6,
        "image_size": [TILE_SIZE, TILE_SIZE],
        "patch_size": [PATCH_SIZE, PATCH_SIZE],
        "num_channels": 3,
        "use_absolute_position_embeddings": True,
        "layer_scale_init_value": 0.1,
        "use_mean_pooling": True,
        "dtype": shape.dtype,
    }


def preprocessor_dict() -> dict[str, Any]:
    """The -HF releases' preprocessor_config.json (GotOcr2ImageProcessor; InternVLProcessor turns
    crop_to_patches on whatever it says)."""
    return {
        "crop_size": None,
        "crop_to_patches": False,
        "data_format": "channels_first",
        "default_to_square": True,
        "do_center_crop": None,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": list(IMAGENET_MEAN),
        "image_processor_type": "GotOcr2ImageProcessorFast",
        "image_std": list(IMAGENET_STD),
        "max_patches": MAX_PATCHES,
        "min_patches": 1,
        "processor_class": "InternVLProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"height": TILE_SIZE, "width": TILE_SIZE},
    }


CHECKPOINT_RECIPE = CheckpointRecipe(
    sizes=SIZES,
    hf_config=build_hf_config,
    hf_model="InternVLForConditionalGeneration",
    preprocessor=preprocessor_dict,
    added_tokens=ADDED_TOKENS,
    named_tokens=NAMED_TOKENS,
    chat_template=CHAT_TEMPLATE,
    token_fields={"image_token_id": IMAGE_TOKEN, "start_image_token_id": START_IMAGE_TOKEN,
                  "end_image_token_id": END_IMAGE_TOKEN},
)
