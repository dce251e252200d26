"""Frozen configuration values.

ModelConfig is read from a Hugging Face checkpoint's config.json in either layout Qwen2-VL ships in:
- "original": the Qwen release (flat text fields, ``rope_scaling.mrope_section``, ``vision_config.in_chans``);
- "transformers": what transformers 5 writes (``text_config`` / ``vision_config`` nested,
  ``rope_parameters``).
Everything downstream reads ModelConfig only, never the raw dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    embed_dim: int  # width of the vision blocks
    num_heads: int
    mlp_ratio: float
    out_hidden_size: int  # the merger's output width == the language model's hidden size
    in_channels: int = 3
    patch_size: int = 14  # pixels per patch side
    spatial_merge_size: int = 2  # 2x2 patches merge into one LM token
    temporal_patch_size: int = 2
    hidden_act: str = "quick_gelu"

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads:
            raise ValueError("vision_config.embed_dim must be divisible by vision_config.num_heads")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def pixels_per_token(self) -> int:
        """Side in pixels of the square one LM token covers (28 for Qwen2-VL)."""
        return self.patch_size * self.spatial_merge_size


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]  # sums to head_dim // 2: (temporal, height, width) frequency split
    tie_word_embeddings: bool
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    vision: VisionConfig
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    layout: str = "transformers"  # which config.json layout this came from

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} must sum to head_dim/2 = {self.head_dim // 2}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token across all layers: 2 x layers x KV heads x head_dim x bytes (GQA-aware)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if "text_config" in d and isinstance(d["text_config"], dict):
            text = {**d, **d["text_config"]}
            layout = "transformers"
        else:
            text = d
            layout = "original"
        v = d.get("vision_config") or {}
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 1_000_000.0)))
        head_dim = text["hidden_size"] // text["num_attention_heads"]
        default_section = (16, 24, 24) if head_dim == 128 else _default_mrope_section(head_dim)
        mrope_section = tuple(rope.get("mrope_section") or default_section)
        eos = text.get("eos_token_id", d.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        vision = VisionConfig(
            depth=int(v.get("depth", 32)),
            embed_dim=int(v.get("embed_dim", 1280)),
            num_heads=int(v.get("num_heads", 16)),
            mlp_ratio=float(v.get("mlp_ratio", 4)),
            out_hidden_size=int(v.get("hidden_size", text["hidden_size"])),
            in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
            patch_size=int(v.get("patch_size", v.get("spatial_patch_size", 14))),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            hidden_act=str(v.get("hidden_act", "quick_gelu")),
        )
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=int(text["num_hidden_layers"]),
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            mrope_section=mrope_section,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            image_token_id=int(d.get("image_token_id", 151655)),
            video_token_id=int(d.get("video_token_id", 151656)),
            vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(d.get("vision_end_token_id", 151653)),
            vision=vision,
            hidden_act=str(text.get("hidden_act", "silu")),
            eos_token_ids=eos_ids,
            layout=layout,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        with open(Path(model_dir) / "config.json") as f:
            return cls.from_dict(json.load(f))


def _default_mrope_section(head_dim: int) -> tuple[int, int, int]:
    """Qwen2-VL's 16/24/24 split of 64 rotary pairs, scaled to another head_dim."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return (t, h, half - t - h)


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults a checkpoint ships in generation_config.json; the server honours them."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "GenerationDefaults":
        path = Path(model_dir) / "generation_config.json"
        if not path.exists():
            return cls()
        with open(path) as f:
            d = json.load(f)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        do_sample = d.get("do_sample", True)
        return cls(
            eos_token_ids=eos_ids,
            temperature=float(d.get("temperature", 1.0)) if do_sample else 0.0,
            top_p=float(d.get("top_p", 1.0)),
            top_k=int(d.get("top_k") or 0),
            repetition_penalty=float(d.get("repetition_penalty", 1.0)),
            extra={k: v for k, v in d.items() if k not in {"eos_token_id", "temperature", "top_p", "top_k"}},
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_bytes: int = 2 * 1024**3  # physical K/V pool, all layers
    enable_prefix_caching: bool = True
    encoder_cache_memory_bytes: int = 512 * 1024**2  # vision-tower outputs kept by image content hash
    enable_encoder_cache: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.encoder_cache_memory_bytes < 0:
            raise ValueError("encoder_cache_memory must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = 2048  # tokens (prefill chunks + decodes) one engine step may run
    max_num_seqs: int = 64  # sequences in one step
    decode_reserve_tokens: int = 64  # KV reserved at admission beyond the prompt, for the first decodes
    max_model_len: int | None = None  # None: the checkpoint's context, capped by the KV pool
    # Lanes: "lanes" (default) routes by prompt length into a short and a long lane; "fcfs" is one FIFO queue
    # with whole-prompt prefills and whole-image encodes (the behaviour the seed's incident started from).
    scheduling: str = "lanes"
    long_prompt_threshold: int = 1024  # prompt tokens (text + image) at or above which a request is "long"
    long_step_tokens: int = 512  # long-lane work per step: prefill tokens + visual tokens x vision layers
    long_step_tokens_idle: int | None = None  # the same, in steps with no short work anywhere (None: as above)
    long_max_wait_steps: int = 4  # aging: long work paused this many steps in a row for short work runs anyway
    kv_admission: str = "whole-prompt"  # or "optimistic": admit when the next chunk fits, preempt when dry
    max_queued_requests: int = 256  # per lane; beyond it the API answers 429 with Retry-After

    def __post_init__(self) -> None:
        if self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.decode_reserve_tokens < 0:
            raise ValueError("decode_reserve_tokens must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.scheduling not in ("lanes", "fcfs"):
            raise ValueError("scheduling must be 'lanes' or 'fcfs'")
        if self.kv_admission not in ("whole-prompt", "optimistic"):
            raise ValueError("kv_admission must be 'whole-prompt' or 'optimistic'")
        if self.long_prompt_threshold < 1:
            raise ValueError("long_prompt_threshold must be >= 1")
        if self.long_step_tokens < 1:
            raise ValueError("long_step_tokens must be >= 1")
        if self.long_step_tokens_idle is not None and self.long_step_tokens_idle < 1:
            raise ValueError("long_step_tokens_idle must be >= 1")
        if self.long_max_wait_steps < 0:
            raise ValueError("long_max_wait_steps must be >= 0")
        if self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be >= 1")
