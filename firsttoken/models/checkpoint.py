"""Random-weight Qwen-VL checkpoints in Hugging Face format, built offline.

``make_model(out_dir, size, seed, layout, shards, family)`` writes a directory that transformers 5
loads unchanged (``AutoTokenizer``, ``Qwen2VLImageProcessorPil``, the family's
``...ForConditionalGeneration``). The family is a registered one (models/registry.py) whose
``ModelFamily.checkpoint`` is a ``CheckpointRecipe`` (models/recipe.py: its shapes, transformers
config and model class, second layout if any; Qwen2-VL's is in qwen2_vl_checkpoint.py). Every
family's checkpoint holds:

    config.json                      the recipe's: transformers' layout, or the family's release layout
    generation_config.json           EOS = [<|im_end|>, <|endoftext|>], Qwen2-VL-Instruct sampling defaults
    model.safetensors                or model-0000k-of-0000n.safetensors + model.safetensors.index.json
    tokenizer.json, tokenizer_config.json, chat_template.jinja   ours, plus the recipe's added tokens and template
    preprocessor_config.json         the recipe's image processor settings
    firsttoken_checkpoint.json       how it was made (family, size, seed, layout, format version, parameter counts)

Weights: every tensor comes from its own generator seeded by (seed, tensor name), so the same seed
gives byte-identical files and both layouts hold the same numbers under different names.
Linear and conv weights are N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.1^2),
biases N(0, 0.1^2): activations stay O(1) and attention patterns are far from uniform, so position
(M-RoPE) and masking bugs change the logits visibly.

Peaked logits: with the usual 0.02-std init, top-1 and top-2 logits of a random model differ by
~0.004 and greedy comparisons flip on rounding noise. Here ``lm_head`` rows are N(0, (LOGIT_STD^2 /
hidden_size)), so after the final RMSNorm (output RMS ~1) each logit has std ~LOGIT_STD = 10 and the
top-1/top-2 gap over ~16k tokens has a median of ~1.5. The rows past our tokenizer's last id (a
recipe's added control tokens, the embedding padding) are zero, so greedy decoding never picks an id
the tokenizer cannot decode, nor a control token a family adds.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from firsttoken.models.recipe import (
    CHECKPOINT_DTYPES,
    MAX_POSITION_EMBEDDINGS,
    NUM_TOKENIZER_TOKENS,
    TOKEN_IDS,
    CheckpointRecipe,
    added_token_ids,
)
from firsttoken.models.registry import families, family_of_config
from firsttoken.models.train_tokenizer import ASSET_PATH as TOKENIZER_ASSET
from firsttoken.models.train_tokenizer import SPECIAL_TOKENS

# bump when the files make_model writes change; demo_model_dir rebuilds on mismatch
FORMAT_VERSION = 1
LOGIT_STD = 10.0

# Qwen2-VL-7B-Instruct's generation_config.json sampling values (near-greedy: top_k 1).
GENERATION_SAMPLING: dict[str, Any] = {
    "do_sample": True,
    "temperature": 0.01,
    "top_p": 0.001,
    "top_k": 1,
    "repetition_penalty": 1.05,
}

@dataclass(frozen=True)
class ParamCounts:
    total: int
    language_model: int  # embed_tokens + layers + norm + lm_head
    vision: int  # patch embed + blocks + merger


def recipes() -> dict[str, CheckpointRecipe]:
    """Registered family name -> its recipe: every family make_model can build."""
    return {f.name: f.checkpoint for f in families()}


def make_model(
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    layout: str = "transformers",
    shards: int = 1,
    family: str = "qwen2-vl",
    dtype: str | None = None,
) -> Path:
    """Write a random-weight checkpoint of ``family`` into ``out_dir`` (created if needed) and
    return it. ``dtype`` ("float32", "bfloat16"): the tensors' dtype on disk and the config's
    (default: the size's, float32); Qwen-VL checkpoints are published in bfloat16."""
    known = recipes()
    if family not in known:
        raise ValueError(f"family must be one of {sorted(known)}, got {family!r}")
    recipe = known[family]
    if size not in recipe.sizes:
        raise ValueError(f"size must be one of {sorted(recipe.sizes)}, got {size!r}")
    if layout not in recipe.layouts:
        raise ValueError(f"layout must be one of {recipe.layouts} for {family}, got {layout!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    shape = recipe.sizes[size]
    if dtype is not None:
        if dtype not in CHECKPOINT_DTYPES:
            raise ValueError(f"dtype must be one of {CHECKPOINT_DTYPES}, got {dtype!r}")
        # Qwen2.5-VL's shape holds its language model's, which holds the dtype
        text = getattr(shape, "text", None)
        shape = (
            replace(shape, text=replace(text, dtype=dtype))
            if text is not None
            else replace(shape, dtype=dtype)
        )
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
    _write_tokenizer_files(out, recipe)
    _write_json(out / "preprocessor_config.json", recipe.preprocessor())
    meta = {
        "format_version": FORMAT_VERSION,
        "family": family,
        "size": size,
        "seed": seed,
        "layout": layout,
        "shards": shards,
    }
    _write_json(
        out / "firsttoken_checkpoint.json", {**meta, "params": asdict(count_params(tensors))}
    )
    return out


def random_state_dict(
    config: Any, seed: int, dtype: torch.dtype, model_class: type | None = None
) -> dict[str, torch.Tensor]:
    """Seeded weights for every tensor of ``model_class(config)`` (default Qwen2-VL's), transformers
    names."""
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


def tokenizer_config_dict(recipe: CheckpointRecipe) -> dict[str, Any]:
    """tokenizer_config.json: our tokenizer with ``recipe``'s added tokens, names for its tokens
    (where it has any) and its chat template."""
    added_tokens = recipe.added_tokens
    ids = {**TOKEN_IDS, **added_token_ids(added_tokens)}
    added = {
        str(ids[tok]): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in (*SPECIAL_TOKENS, *added_tokens)
    }
    named = dict(recipe.named_tokens)
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [*SPECIAL_TOKENS[1:], *added_tokens],
        **({"extra_special_tokens": named} if named else {}),
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": recipe.chat_template,
    }


# weight names of a vision tower and its projector, in any family's checkpoint
VISION_PARTS = ("visual.", "vision_tower.", "multi_modal_projector.")


def count_params(tensors: dict[str, torch.Tensor]) -> ParamCounts:
    vision = sum(t.numel() for k, t in tensors.items() if any(part in k for part in VISION_PARTS))
    total = sum(t.numel() for t in tensors.values())
    return ParamCounts(total=total, language_model=total - vision, vision=vision)


def shard_names(names: list[str], sizes_bytes: list[int], num_shards: int) -> list[list[str]]:
    """Split ``names`` (in order) into ``num_shards`` contiguous, non-empty groups of similar
    bytes."""
    if num_shards > len(names):
        raise ValueError(f"shards={num_shards} exceeds the {len(names)} tensors in the checkpoint")
    target_bytes = sum(sizes_bytes) / num_shards
    groups: list[list[str]] = [[]]
    cum_bytes = 0
    for i, (name, nbytes) in enumerate(zip(names, sizes_bytes)):
        remaining_names = len(names) - i
        remaining_groups = num_shards - len(groups)
        must_split = remaining_names == remaining_groups and groups[-1]
        if groups[-1] and (
            must_split or (remaining_groups and cum_bytes >= target_bytes * len(groups))
        ):
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
    groups = shard_names(
        names, [tensors[n].numel() * tensors[n].element_size() for n in names], shards
    )
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups, start=1):
        filename = f"model-{k:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out / filename), metadata=metadata)
        weight_map.update({n: filename for n in group})
    total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    _write_json(out / "model.safetensors.index.json", index)


# config.json's token-id fields and the demo tokenizer's token each one names (published configs
# carry Qwen's ids)
DEMO_TOKEN_FIELDS: dict[str, str] = {
    "bos_token_id": "<|endoftext|>",
    "eos_token_id": "<|im_end|>",
    "pad_token_id": "<|endoftext|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "vision_token_id": "<|vision_pad|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}


def make_dummy_model(out_dir: str | Path, config: dict[str, Any]) -> Path:
    """A weightless checkpoint for ``--load-format dummy``: a published model's ``config`` (its
    config.json, e.g. Qwen2-VL-7B-Instruct's) with the demo checkpoint's tokenizer, chat template,
    generation defaults and its family's image processor settings (the family is the config's:
    models/registry.py). The config's token-id fields (top level and ``text_config``) are rewritten
    to the demo tokenizer's ids for the same tokens, so its image placeholders and stop tokens are
    the ones the tokenizer makes; every other shape field is the published one. No safetensors:
    serve it with --load-format dummy."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(config))  # a deep copy: the caller's dict is left as given
    family = family_of_config(config)
    for section in (config, config.get("text_config") or {}):
        for key, token in DEMO_TOKEN_FIELDS.items():
            if key in section:
                section[key] = TOKEN_IDS[token]
    own = added_token_ids(family.checkpoint.added_tokens)
    for key, token in family.checkpoint.token_fields.items():
        config[key] = own[token] if token in own else TOKEN_IDS[token]
    _write_json(out / "config.json", config)
    _write_generation_config(out)
    _write_tokenizer_files(out, family.checkpoint)
    _write_json(out / "preprocessor_config.json", family.checkpoint.preprocessor())
    _write_json(
        out / "firsttoken_checkpoint.json",
        {
            "format_version": FORMAT_VERSION,
            "family": family.name,
            "weights": "none: serve with --load-format dummy",
        },
    )
    return out


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


def _write_tokenizer_files(out: Path, recipe: CheckpointRecipe) -> None:
    """Our tokenizer as it ships, or with the recipe's added tokens after its last id."""
    if recipe.added_tokens:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(TOKENIZER_ASSET))
        tokenizer.add_special_tokens(list(recipe.added_tokens))
        tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    else:
        shutil.copyfile(TOKENIZER_ASSET, out / "tokenizer.json")
    _write_json(out / "tokenizer_config.json", tokenizer_config_dict(recipe))
    (out / "chat_template.jinja").write_text(recipe.chat_template)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


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
        return int(
            json.loads((model_dir / "firsttoken_checkpoint.json").read_text())["format_version"]
        )
    except (OSError, ValueError, KeyError):
        return None
