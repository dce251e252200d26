"""A Qwen-VL checkpoint's shapes, from config.json alone: parameter counts, KV bytes per token, and
the buffers one engine step allocates (the workspace `plan` subtracts from a device's memory).

Reads both config layouts (flat, as Qwen ships it, or nested under ``text_config`` as transformers 5
writes it), Qwen2.5-VL's vision tower (gated MLP) and Qwen3-VL's (explicit head_dim, the tower's
width as hidden_size). Parameters are counted on our own module of the config's family, built on the
meta device, so every family's extras (q/k norms, DeepStack mergers, position tables) count. A field
the arithmetic needs and the config lacks is a ConfigFieldMissing naming the field and what it is
needed for, never a bare KeyError.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# the runner computes logits (and the sampler's probabilities) in float32 whatever the dtype
LOGITS_BYTES = 4
_SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_MISSING = object()


class ConfigFieldMissing(ValueError):
    """config.json lacks (or mistypes) a field: the message names it and what it is needed for."""


@dataclass(frozen=True)
class ModelShape:
    """What planning needs from config.json, read from either Qwen2-VL layout (flat or
    text_config)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    vision_depth: int
    vision_width: int
    vision_mlp_width: int  # fc1 (Qwen2-VL) or gate/up (Qwen2.5-VL) width
    # Qwen2.5-VL: gate/up/down with biases and RMSNorm; Qwen2-VL: fc1/fc2, LayerNorm
    vision_gated_mlp: bool
    vision_out_width: int
    vision_in_channels: int
    vision_patch_size: int
    vision_temporal_patch_size: int
    vision_spatial_merge_size: int
    # (language model, vision) counted on our module when its family parses
    exact_params: tuple[int, int] | None = None

    @classmethod
    def from_config(cls, d: dict[str, Any]) -> "ModelShape":
        nested = isinstance(d.get("text_config"), dict)
        text = _Fields({**d, **d["text_config"]} if nested else d, "text_config." if nested else "")
        v = _Fields(d.get("vision_config") or {}, "vision_config.")
        model_type = str(d.get("model_type", "qwen2_vl"))
        params = "to count the language model's parameters"
        hidden = text.get_int("hidden_size", params)
        heads = text.get_int(
            "num_attention_heads", "to compute head_dim, hence the KV bytes per token"
        )
        # Qwen2.5-VL's gate/up/down vision MLP; Qwen2-VL (mlp_ratio) and Qwen3-VL: fc1/fc2
        gated = "2_5" in model_type
        tower = "to size the vision tower's weights and workspace"
        # Qwen2.5-VL names the vision width hidden_size; Qwen2-VL names it embed_dim (hidden_size is
        # its output). 1280, the width of every released Qwen2-VL / Qwen2.5-VL tower, when neither
        # is given.
        # the tower's width is hidden_size there, embed_dim in Qwen2-VL
        # (InternViT's config names its depth num_hidden_layers and its width hidden_size)
        named_hidden = gated or "qwen3" in model_type or "num_hidden_layers" in v.d
        width = v.get_int(
            "embed_dim", tower, default=(v.d.get("hidden_size") if named_hidden else None) or 1280
        )
        mlp_width = (v.get_int("intermediate_size", tower) if named_hidden
                     else int(width * v.get_float("mlp_ratio", tower, 4.0)))
        return cls(
            model_type=model_type,
            vocab_size=text.get_int(
                "vocab_size", "to count the embedding and lm_head parameters and size the logits"
            ),
            hidden_size=hidden,
            intermediate_size=text.get_int(
                "intermediate_size", params + " and size its MLP activations"
            ),
            num_layers=text.get_int(
                "num_hidden_layers", "to count the layers, hence the KV bytes per token"
            ),
            num_attention_heads=heads,
            num_kv_heads=text.get_int("num_key_value_heads", "", default=heads) or heads,
            head_dim=text.get_int("head_dim", "", default=hidden // heads) or hidden // heads,
            max_position_embeddings=text.get_int("max_position_embeddings", "", default=32768),
            tie_word_embeddings=bool(
                d.get("tie_word_embeddings", text.d.get("tie_word_embeddings", False))
            ),
            vision_depth=v.get_int("depth", tower, default=v.d.get("num_hidden_layers", 32)),
            vision_width=width,
            vision_mlp_width=mlp_width,
            vision_gated_mlp=gated,
            vision_out_width=v.get_int(
                "out_hidden_size",
                tower,
                default=hidden if named_hidden else v.d.get("hidden_size", hidden),
            ),
            vision_in_channels=v.get_int(
                "in_channels", tower, default=v.d.get("in_chans", v.d.get("num_channels", 3))
            ),
            vision_patch_size=v.get_int(
                "patch_size", tower, default=v.d.get("spatial_patch_size", 14)
            ),
            vision_temporal_patch_size=v.get_int("temporal_patch_size", tower, default=2),
            vision_spatial_merge_size=v.get_int("spatial_merge_size", tower, default=2),
            exact_params=exact_param_counts(d),
        )

    # ---- parameters, from shapes alone -----------------------------------------------------------
    def language_model_params(self) -> int:
        if self.exact_params is not None:
            return self.exact_params[0]
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_kv_heads * hd
        attn = (h * q + q) + 2 * (h * kv + kv) + q * h  # q/k/v carry biases, o_proj does not
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        layer = attn + mlp + 2 * h  # two RMSNorm weights
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_layers * layer + h + lm_head

    def vision_params(self) -> int:
        if self.exact_params is not None:
            return self.exact_params[1]
        e, m = self.vision_width, self.vision_mlp_width
        patch = (
            self.vision_in_channels
            * self.vision_temporal_patch_size
            * self.vision_patch_size**2
            * e
        )
        # RMSNorm weight vs LayerNorm weight + bias, x2
        norms = 2 * e if self.vision_gated_mlp else 4 * e
        attn = (e * 3 * e + 3 * e) + (e * e + e)
        mlp = (
            (2 * (e * m + m) + (m * e + e)) if self.vision_gated_mlp else (e * m + m) + (m * e + e)
        )
        merged = e * self.vision_spatial_merge_size**2
        merger = (e if self.vision_gated_mlp else 2 * e) + (merged * merged + merged)
        merger += merged * self.vision_out_width + self.vision_out_width
        return patch + self.vision_depth * (norms + attn + mlp) + merger

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token, all layers, GQA-aware: 2 x layers x KV heads x head_dim x
        bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def seed_kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """The incident review's formula: 2 x layers x attention heads x head_dim x bytes (ignores
        GQA)."""
        return 2 * self.num_layers * self.num_attention_heads * self.head_dim * dtype_bytes

    # ---- one engine step's transient buffers (bytes) ---------------------------------------------
    def lm_activation_bytes(self, num_tokens: int, dtype_bytes: int) -> int:
        """One decoder layer's buffers for a step of num_tokens, summed as if all live at once (an
        upper bound; layers run one after another and reuse them): residual + normed input (2h),
        q/k/v (q + 2kv), attention output (q), gate/up/act (3 x intermediate)."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (
            num_tokens
            * (2 * self.hidden_size + 2 * q + 2 * kv + 3 * self.intermediate_size)
            * dtype_bytes
        )

    def lm_attention_scores_bytes(
        self, num_tokens: int, max_model_len: int, dtype_bytes: int
    ) -> int:
        """Scores + softmax of one prefill chunk against its context: 2 x heads x chunk x context x
        bytes. The CPU SDPA backend materializes them for every chunk after a request's first (it
        passes a mask, which leaves the flash kernel); a flash-attention backend would not."""
        chunk = min(num_tokens, max_model_len)
        return 2 * self.num_attention_heads * chunk * max_model_len * dtype_bytes

    def logits_bytes(self, num_rows: int) -> int:
        """Logits and the sampler's probabilities for the rows sampled in one step, float32."""
        return 2 * num_rows * self.vocab_size * LOGITS_BYTES

    def vision_patches(self, visual_tokens: int) -> int:
        """Patches the vision tower runs for an image of visual_tokens LM tokens (merge x merge
        patches each)."""
        return visual_tokens * self.vision_spatial_merge_size**2

    def vision_activation_bytes(self, visual_tokens: int, dtype_bytes: int) -> int:
        """One vision block's buffers for one image (the runner encodes images one at a time):
        residual, normed, q/k/v, attention output (6 x width) and the MLP's hidden + activation (2 x
        mlp width; gate/up/act 3 x for Qwen2.5-VL), per patch. No attention scores: the tower calls
        SDPA without a mask, whose flash kernel never materializes the patches x patches matrix."""
        mlp = (3 if self.vision_gated_mlp else 2) * self.vision_mlp_width
        return self.vision_patches(visual_tokens) * (6 * self.vision_width + mlp) * dtype_bytes


def exact_param_counts(d: dict[str, Any]) -> tuple[int, int] | None:
    """(language model, vision tower) parameters of our module for this config, built on the meta
    device (no memory): exact for every family we serve, q/k norms, DeepStack mergers and position
    tables included. None when no family parses the config (plan then counts from the shapes,
    Qwen2-VL's way)."""
    try:
        from firsttoken.models.registry import family_of_config

        family = family_of_config(d)
        config = family.parse_config(d, None)
    except (ValueError, KeyError, TypeError):
        return None
    import torch

    from firsttoken.attention.registry import get_backend

    with torch.device("meta"):
        model = family.build(config, get_backend("sdpa"))
    vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith("visual."))
    return sum(p.numel() for p in model.parameters()) - vision, vision


class _Fields:
    """One config.json section; get_int()/get_float() raise ConfigFieldMissing naming the field's
    full path."""

    def __init__(self, d: dict[str, Any], prefix: str) -> None:
        self.d, self.prefix = d, prefix

    def _get(self, key: str, why: str, default: Any) -> Any:
        value = self.d.get(key)
        if value is None:
            if default is _MISSING or default is None:
                raise ConfigFieldMissing(f"config.json has no {self.prefix}{key}, needed {why}")
            return default
        return value

    def get_int(self, key: str, why: str, default: Any = _MISSING) -> int:
        return self._number(key, why, default, int, "a whole number")

    def get_float(self, key: str, why: str, default: Any = _MISSING) -> float:
        return self._number(key, why, default, float, "a number")

    def _number(self, key: str, why: str, default: Any, kind: type, what: str) -> Any:
        value = self._get(key, why, default)
        if isinstance(value, list) and len(value) == 2 and value[0] == value[1]:
            value = value[0]  # a square's sides, as InternViT's patch_size [14, 14]
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ConfigFieldMissing(
                f"config.json's {self.prefix}{key} is {value!r}, not {what}"
            ) from None


def load_config(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    return json.loads((p / "config.json" if p.is_dir() else p).read_text())


def safetensors_weight_bytes(model_dir: str | Path) -> tuple[int, int] | None:
    """(parameters, bytes on disk) summed from the safetensors headers alone; None without
    .safetensors files."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    num_params = num_bytes = 0
    for f in files:
        with open(f, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for dim in meta["shape"]:
                n *= dim
            num_params += n
            num_bytes += n * _SAFETENSORS_DTYPE_BYTES.get(meta["dtype"], 4)
    return num_params, num_bytes
