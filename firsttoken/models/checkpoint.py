"""Random-weight Qwen-VL checkpoints in Hugging Face format, built offline.

``make_model(out_dir, size, seed, layout, shards, family)`` writes a directory that transformers 5 loads
unchanged (``AutoTokenizer``, ``Qwen2VLImageProcessorPil``, the family's ``...ForConditionalGeneration``); a family
contributes a ``CheckpointRecipe`` (its shapes, transformers config and model class, second layout if any).
For Qwen2-VL:

    config.json                      layout "transformers" (nested text_config / vision_config) or
                                     "original" (the Qwen2-VL-2B-Instruct release: flat, rope_scaling)
    generation_config.json           EOS = [<|im_end|>, <|endoftext|>], Qwen2-VL-Instruct sampling defaults
    model.safetensors                or model-0000k-of-0000n.safetensors + model.safetensors.index.json
    tokenizer.json, tokenizer_config.json, chat_template.jinja
    preprocessor_config.json         Qwen2-VL image processor defaults
    firsttoken_checkpoint.json       how it was made (size, seed, layout, format version, parameter counts)

Weights: every tensor comes from its own generator seeded by (seed, tensor name), so the same seed
gives byte-identical files and both layouts hold the same numbers under different names.
Linear and conv weights are N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.1^2),
biases N(0, 0.1^2): activations stay O(1) and attention patterns are far from uniform, so position
(M-RoPE) and masking bugs change the logits visibly.

Peaked logits: with the usual 0.02-std init, top-1 and top-2 logits of a random model differ by
~0.004 and greedy comparisons flip on rounding noise. Here ``lm_head`` rows are N(0, (LOGIT_STD^2 /
hidden_size)), so after the final RMSNorm (output RMS ~1) each logit has std ~LOGIT_STD = 10 and the
top-1/top-2 gap over ~16k tokens has a median of ~1.5. The rows past the tokenizer's last id
(embedding padding) are zero, so greedy decoding never picks an id the tokenizer cannot decode.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from firsttoken.models.train_tokenizer import ASSET_PATH as TOKENIZER_ASSET
from firsttoken.models.train_tokenizer import NUM_BPE_TOKENS, SPECIAL_TOKENS

if TYPE_CHECKING:
    from transformers import Qwen2VLConfig

FORMAT_VERSION = 1  # bump when the files make_model writes change; demo_model_dir rebuilds on mismatch
LAYOUTS = ("transformers", "original")
LOGIT_STD = 10.0
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
VOCAB_SIZE = -(-NUM_TOKENIZER_TOKENS // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE  # rows in embed / lm_head

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

# Qwen2-VL-7B-Instruct's generation_config.json sampling values (near-greedy: top_k 1).
GENERATION_SAMPLING: dict[str, Any] = {
    "do_sample": True,
    "temperature": 0.01,
    "top_p": 0.001,
    "top_k": 1,
    "repetition_penalty": 1.05,
}

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
MIN_PIXELS = 3136  # 56 * 56
CHECKPOINT_DTYPES = ("float32", "bfloat16")
MAX_PIXELS = 12845056  # 14 * 14 * 4 * 16384


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
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {head_dim // 2}")


SIZES: dict[str, CheckpointShape] = {
    "tiny": CheckpointShape(64, 2, 4, 2, 176, (2, 3, 3), 2, 32, 2, 2),
    "small": CheckpointShape(512, 8, 8, 2, 1408, (8, 12, 12), 4, 256, 4, 4),
}


@dataclass(frozen=True)
class ParamCounts:
    total: int
    language_model: int  # embed_tokens + layers + norm + lm_head
    vision: int  # patch embed + blocks + merger


@dataclass(frozen=True)
class CheckpointRecipe:
    """What make_model needs of a family: its shapes, its transformers config and model class, and (for families
    released in a second layout) how the release names weights and lays out config.json."""

    family: str  # registry name
    sizes: dict[str, Any]  # size name -> the family's shape
    hf_config: Callable[[Any], Any]  # shape -> transformers PretrainedConfig (with our tokenizer's ids)
    hf_model_class: Callable[[], type]  # the transformers ...ForConditionalGeneration (imported on call)
    preprocessor: Callable[[], dict[str, Any]]  # preprocessor_config.json
    original_config: Callable[[Any, Any], dict[str, Any]] | None = None  # (config, shape) -> release config.json
    to_original_key: Callable[[str], str] = lambda name: name


def recipes() -> dict[str, CheckpointRecipe]:
    """Every family make_model can build (families register theirs in _RECIPE_MODULES)."""
    import importlib

    out = {QWEN2_VL_RECIPE.family: QWEN2_VL_RECIPE}
    for module in _RECIPE_MODULES:
        recipe = importlib.import_module(module).CHECKPOINT_RECIPE
        out[recipe.family] = recipe
    return out


def make_model(
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    layout: str = "transformers",
    shards: int = 1,
    family: str = "qwen2-vl",
    dtype: str | None = None,
) -> Path:
    """Write a random-weight checkpoint of ``family`` into ``out_dir`` (created if needed) and return it. ``dtype``
    ("float32", "bfloat16"): the tensors' dtype on disk and the config's (default: the size's, float32); Qwen-VL
    checkpoints are published in bfloat16."""
    known = recipes()
    if family not in known:
        raise ValueError(f"family must be one of {sorted(known)}, got {family!r}")
    recipe = known[family]
    if size not in recipe.sizes:
        raise ValueError(f"size must be one of {sorted(recipe.sizes)}, got {size!r}")
    if layout not in LAYOUTS or (layout == "original" and recipe.original_config is None):
        allowed = LAYOUTS if recipe.original_config is not None else ("transformers",)
        raise ValueError(f"layout must be one of {allowed} for {family}, got {layout!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    shape = recipe.sizes[size]
    if dtype is not None:
        if dtype not in CHECKPOINT_DTYPES:
            raise ValueError(f"dtype must be one of {CHECKPOINT_DTYPES}, got {dtype!r}")
        text = getattr(shape, "text", None)  # Qwen2.5-VL's shape holds its language model's, which holds the dtype
        shape = replace(shape, text=replace(text, dtype=dtype)) if text is not None else replace(shape, dtype=dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = recipe.hf_config(shape)
    tensors = random_state_dict(config, seed, getattr(torch, shape.dtype), recipe.hf_model_class())
    if layout == "original":
        tensors = {recipe.to_original_key(k): v for k, v in tensors.items()}
    _write_weights(out, tensors, shards)
    if layout == "original" and recipe.original_config is not None:
        _write_json(out / "config.json", recipe.original_config(config, shape))
    else:
        config.save_pretrained(out)
    _write_generation_config(out)
    _write_tokenizer_files(out)
    _write_json(out / "preprocessor_config.json", recipe.preprocessor())
    meta = {"format_version": FORMAT_VERSION, "family": family, "size": size, "seed": seed, "layout": layout,
            "shards": shards}
    _write_json(out / "firsttoken_checkpoint.json", {**meta, "params": asdict(count_params(tensors))})
    return out


def text_config_dict(shape: CheckpointShape) -> dict[str, Any]:
    """The language model's transformers ``text_config`` for ``shape`` (Qwen2 with M-RoPE), our tokenizer's ids."""
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
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
        text_config=text, vision_config=vision, tie_word_embeddings=False, dtype=shape.dtype, **VISION_TOKEN_IDS
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    return config


def random_state_dict(config: Any, seed: int, dtype: torch.dtype, model_class: type | None = None) -> dict[str, torch.Tensor]:
    """Seeded weights for every tensor of ``model_class(config)`` (default Qwen2-VL's), transformers names."""
    if model_class is None:
        from transformers import Qwen2VLForConditionalGeneration as model_class

    with torch.device("meta"):
        model = model_class(config)  # names and shapes only
    hidden_size = config.text_config.hidden_size
    return {
        name: _init_tensor(name, tuple(t.shape), seed, hidden_size).to(dtype)
        for name, t in sorted(model.state_dict().items())
    }


def _init_tensor(name: str, shape: tuple[int, ...], seed: int, hidden_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name == "lm_head.weight":
        weight = noise * (LOGIT_STD / math.sqrt(hidden_size))
        weight[NUM_TOKENIZER_TOKENS:] = 0.0  # padding rows: logit 0, never the argmax
        return weight
    if name.endswith(".bias"):
        return noise * 0.1
    if len(shape) == 1:  # RMSNorm / LayerNorm weight
        return 1.0 + noise * 0.1
    if name.endswith("embed_tokens.weight"):
        return noise
    fan_in = math.prod(shape[1:])
    return noise / math.sqrt(fan_in)


def to_original_key(name: str) -> str:
    """transformers 5 weight name -> Qwen2-VL release name (``model.language_model.`` -> ``model.``)."""
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
    """Qwen2-VL image processor defaults, with both the ``size`` and the legacy min/max_pixels keys."""
    return {
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    }


def tokenizer_config_dict() -> dict[str, Any]:
    added = {
        str(TOKEN_IDS[tok]): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }


def count_params(tensors: dict[str, torch.Tensor]) -> ParamCounts:
    vision = sum(t.numel() for k, t in tensors.items() if "visual." in k)
    total = sum(t.numel() for t in tensors.values())
    return ParamCounts(total=total, language_model=total - vision, vision=vision)


def shard_names(names: list[str], sizes_bytes: list[int], num_shards: int) -> list[list[str]]:
    """Split ``names`` (in order) into ``num_shards`` contiguous, non-empty groups of similar bytes."""
    if num_shards > len(names):
        raise ValueError(f"shards={num_shards} exceeds the {len(names)} tensors in the checkpoint")
    target_bytes = sum(sizes_bytes) / num_shards
    groups: list[list[str]] = [[]]
    cum_bytes = 0
    for i, (name, nbytes) in enumerate(zip(names, sizes_bytes)):
        remaining_names = len(names) - i
        remaining_groups = num_shards - len(groups)
        must_split = remaining_names == remaining_groups and groups[-1]
        if groups[-1] and (must_split or (remaining_groups and cum_bytes >= target_bytes * len(groups))):
            groups.append([])
        groups[-1].append(name)
        cum_bytes += nbytes
    return groups


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    groups = shard_names(names, [tensors[n].numel() * tensors[n].element_size() for n in names], shards)
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups, start=1):
        filename = f"model-{k:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out / filename), metadata=metadata)
        weight_map.update({n: filename for n in group})
    total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    _write_json(out / "model.safetensors.index.json", index)


def _write_generation_config(out: Path) -> None:
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": TOKEN_IDS["<|endoftext|>"],
            "pad_token_id": TOKEN_IDS["<|endoftext|>"],
            "eos_token_id": [TOKEN_IDS["<|im_end|>"], TOKEN_IDS["<|endoftext|>"]],
            **GENERATION_SAMPLING,
        },
    )


def _write_tokenizer_files(out: Path) -> None:
    shutil.copyfile(TOKENIZER_ASSET, out / "tokenizer.json")
    _write_json(out / "tokenizer_config.json", tokenizer_config_dict())
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _qwen2_vl_model_class() -> type:
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration


QWEN2_VL_RECIPE = CheckpointRecipe(
    family="qwen2-vl",
    sizes=SIZES,
    hf_config=lambda shape: build_hf_config(shape),
    hf_model_class=_qwen2_vl_model_class,
    preprocessor=lambda: preprocessor_config_dict(),
    original_config=lambda config, shape: original_config_dict(config, shape),
    to_original_key=lambda name: to_original_key(name),
)
# Modules of other families' recipes (each defines CHECKPOINT_RECIPE), imported when make_model first needs them.
_RECIPE_MODULES: tuple[str, ...] = ("firsttoken.models.qwen2_5_vl_checkpoint", "firsttoken.models.qwen3_vl_checkpoint")


def demo_model_dir() -> Path:
    """The tiny seed-0 checkpoint, built once into the user cache (``$FIRSTTOKEN_CACHE`` or
    ``~/.cache/firsttoken``) as ``demo-tiny-seed0``; concurrent callers race safely (build in a
    temp dir, then rename)."""
    cache_root = Path(os.environ.get("FIRSTTOKEN_CACHE") or Path.home() / ".cache" / "firsttoken")
    target = cache_root / "demo-tiny-seed0"
    if _format_version(target) == FORMAT_VERSION:
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-tiny-", dir=cache_root))
    make_model(tmp, size="tiny", seed=0)
    if target.exists():  # stale format: move it aside, then swap the fresh build in
        _move_aside_and_remove(target, cache_root / f"{tmp.name}.stale")
    try:
        tmp.rename(target)
    except OSError:  # another process renamed its build in first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _move_aside_and_remove(path: Path, aside: Path) -> None:
    try:
        path.rename(aside)
    except OSError:  # another process moved it already
        return
    shutil.rmtree(aside, ignore_errors=True)


def _format_version(model_dir: Path) -> int | None:
    try:
        return int(json.loads((model_dir / "firsttoken_checkpoint.json").read_text())["format_version"])
    except (OSError, ValueError, KeyError):
        return None
