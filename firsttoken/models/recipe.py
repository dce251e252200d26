"""What make-model needs of a model family (``CheckpointRecipe``, on its ``ModelFamily``), and what
every family's random checkpoint shares unless its recipe says otherwise: our tokenizer's ids, the
vocabulary they pad to, and the chat template (models/checkpoint.py writes the files).

A leaf of models/: a family's ``*_checkpoint.py`` reads these values and its ``ModelFamily`` holds
its recipe, while checkpoint.py finds the recipe through the registry, so nothing here may import a
family or the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from firsttoken.models.model_config import ImageProcessorConfig
from firsttoken.models.train_tokenizer import NUM_BPE_TOKENS, SPECIAL_TOKENS

LAYOUTS = ("transformers", "original")  # config.json + weight-name layouts a recipe may write
CHECKPOINT_DTYPES = ("float32", "bfloat16")
VOCAB_PAD_MULTIPLE = 64
MAX_POSITION_EMBEDDINGS = 32768
ROPE_THETA = 1_000_000.0
RMS_NORM_EPS = 1e-6

TOKEN_IDS: dict[str, int] = {tok: NUM_BPE_TOKENS + i for i, tok in enumerate(SPECIAL_TOKENS)}
NUM_TOKENIZER_TOKENS = NUM_BPE_TOKENS + len(SPECIAL_TOKENS)
VISION_TOKEN_IDS: dict[str, int] = {  # a Qwen-VL config's fields naming its image/video tokens
    "image_token_id": TOKEN_IDS["<|image_pad|>"],
    "video_token_id": TOKEN_IDS["<|video_pad|>"],
    "vision_start_token_id": TOKEN_IDS["<|vision_start|>"],
    "vision_end_token_id": TOKEN_IDS["<|vision_end|>"],
}
# rows in embed / lm_head
VOCAB_SIZE = -(-NUM_TOKENIZER_TOKENS // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

# Qwen2-VL's chat template (the release's, plus {"type": "image_url"} parts).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or content['type'] == 'image_url' or 'image' in content"
    " or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def added_token_ids(tokens: tuple[str, ...]) -> dict[str, int]:
    """A recipe's ``added_tokens`` -> their ids: after every token of our tokenizer, in order, inside
    the padded vocabulary."""
    if NUM_TOKENIZER_TOKENS + len(tokens) > VOCAB_SIZE:
        raise ValueError(f"{len(tokens)} added tokens overflow the vocabulary of {VOCAB_SIZE}")
    return {tok: NUM_TOKENIZER_TOKENS + i for i, tok in enumerate(tokens)}


def preprocessor_json(
    p: ImageProcessorConfig, image_processor_type: str, processor_class: str
) -> dict[str, Any]:
    """The preprocessor_config.json keys every Qwen-VL release writes, from the family's image
    processor settings (pixel bounds in the ``size`` dict form)."""
    return {
        "size": {"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels},
        "patch_size": p.patch_size,
        "temporal_patch_size": p.temporal_patch_size,
        "merge_size": p.merge_size,
        "image_mean": list(p.image_mean),
        "image_std": list(p.image_std),
        "image_processor_type": image_processor_type,
        "processor_class": processor_class,
    }


def text_shape_fields(shape: Any) -> dict[str, Any]:
    """The language model's sizes as every Qwen-VL text config names them (``shape``: a family's
    checkpoint shape), with our tokenizer's padded vocabulary."""
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
    }


def _same_name(name: str) -> str:
    return name


@dataclass(frozen=True)
class CheckpointRecipe:
    """What make_model needs of a family: its shapes, its transformers config and model class, and
    (for families released in a second layout) how the release names weights and lays out
    config.json. The transformers class is also the family's reference in the oracle tests."""

    # size name ("tiny", "small") -> the family's shape; a shape's ``dtype`` is on disk
    sizes: Mapping[str, Any]
    # shape -> transformers PretrainedConfig (with our tokenizer's ids)
    hf_config: Callable[[Any], Any]
    hf_model: str  # the name of transformers' ...ForConditionalGeneration class
    preprocessor: Callable[[], dict[str, Any]]  # preprocessor_config.json
    # (config, shape) -> release config.json
    original_config: Callable[[Any, Any], dict[str, Any]] | None = None
    to_original_key: Callable[[str], str] = _same_name  # transformers weight name -> the release's
    # special tokens the family's tokenizer has beyond ours, ids from NUM_TOKENIZER_TOKENS on in
    # order (added_token_ids); lm_head rows are zero from NUM_TOKENIZER_TOKENS, so none is generated
    added_tokens: tuple[str, ...] = ()
    # tokenizer_config.json "extra_special_tokens": attribute name -> token, as the family's
    # transformers processor reads them off the tokenizer (tokenizer.start_image_token ...)
    named_tokens: Mapping[str, str] = field(default_factory=dict)
    chat_template: str = CHAT_TEMPLATE
    # config.json's top-level fields that name the family's own control tokens (beyond
    # checkpoint.DEMO_TOKEN_FIELDS), each written to its token's id in our tokenizer: a published
    # config made a dummy checkpoint (make_dummy_model) points at the tokens our tokenizer makes,
    # written where the release leaves a field to its processor's defaults
    token_fields: Mapping[str, str] = field(default_factory=dict)

    @property
    def layouts(self) -> tuple[str, ...]:
        return LAYOUTS if self.original_config is not None else LAYOUTS[:1]

    def hf_model_class(self) -> type:
        """transformers' class (imported on call: the server never needs transformers' models)."""
        import transformers

        return getattr(transformers, self.hf_model)
