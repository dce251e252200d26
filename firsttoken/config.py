"""Frozen configuration values of the engine. The checkpoint's architecture (ModelConfig) is parsed by its model
family: see firsttoken/models/config.py and models/registry.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
