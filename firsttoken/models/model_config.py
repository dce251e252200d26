"""The architecture of a served checkpoint, as frozen values every layer may read.

A model family (models/registry.py) parses its checkpoint's config.json (either layout it ships in)
and preprocessor_config.json into these; nothing downstream reads the raw dicts. Fields a family
does not have keep their neutral defaults (no window attention, no DeepStack, no q/k norm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """config.json lacks or mis-states a field; the message names the field and the file."""


@dataclass(frozen=True)
class VisionConfig:
    depth: int  # vision blocks
    embed_dim: int  # width of the vision blocks
    num_heads: int
    intermediate_size: int  # the blocks' MLP width
    out_hidden_size: int  # the merger's output width == the language model's hidden size
    in_channels: int = 3
    patch_size: int = 14  # pixels per patch side
    spatial_merge_size: int = 2  # merge x merge patches become one LM token
    temporal_patch_size: int = 2
    hidden_act: str = "quick_gelu"
    # pixels per side of an attention window (Qwen2.5-VL: 112); 0 = every block attends fully
    window_size: int = 0
    # with windows: the blocks that attend over the whole image
    fullatt_block_indexes: tuple[int, ...] = ()
    # Qwen3-VL: blocks whose features feed the LM's first layers
    deepstack_visual_indexes: tuple[int, ...] = ()
    num_position_embeddings: int = 0  # Qwen3-VL: learned position table (a square grid), 0 = none
    # Qwen2.5-VL: video time positions per second of clip; 0 = videos step by grid
    tokens_per_second: float = 0.0

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads:
            raise ConfigError(
                "vision_config: embed_dim (hidden_size) must be divisible by num_heads"
            )
        for i in (*self.fullatt_block_indexes, *self.deepstack_visual_indexes):
            if not 0 <= i < self.depth:
                raise ConfigError(f"vision_config: block index {i} is outside depth {self.depth}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def pixels_per_token(self) -> int:
        """Side in pixels of the square one LM token covers (28 for Qwen2-VL, 32 for Qwen3-VL)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def uses_windows(self) -> bool:
        return self.window_size > 0


@dataclass(frozen=True)
class TileSpec:
    """A tiling processor's cut (InternVL's): a grid of ``size`` x ``size`` tiles, between
    ``min_patches`` and ``max_patches`` of them by the image's aspect ratio, plus a thumbnail when
    there is more than one (models/internvl_tiles.py)."""

    size: int = 448  # pixels, a tile's side
    min_patches: int = 1
    max_patches: int = 12


@dataclass(frozen=True)
class ImageProcessorConfig:
    """How pixels become patches (preprocessor_config.json over the family's defaults)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 16384
    # None: native resolution (Qwen: the image resized to fit its budget); a tiling processor's cut
    tiles: TileSpec | None = None

    @property
    def pixels_per_token(self) -> int:
        return self.patch_size * self.merge_size

    def grid_for(self, tokens: int) -> tuple[int, int, int]:
        """(t, h, w) patches of an image of at most ``tokens`` visual tokens (at least one tile):
        near square, or whole tiles."""
        if self.tiles is not None:
            side = self.tiles.size // self.patch_size
            return max(1, tokens // self.tokens_per_tile), side, side
        side = math.isqrt(tokens)
        return 1, side * self.merge_size, tokens // side * self.merge_size

    @property
    def tokens_per_tile(self) -> int:
        """LM tokens of one tile (a tiling processor): its patches over the merge window."""
        assert self.tiles is not None
        return (self.tiles.size // self.patch_size) ** 2 // self.merge_size**2


@dataclass(frozen=True)
class ModelConfig:
    family: str  # registry name: "qwen2-vl", "qwen2.5-vl", "qwen3-vl"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    # sums to head_dim // 2: (temporal, height, width) frequency split
    mrope_section: tuple[int, ...]
    tie_word_embeddings: bool
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    vision: VisionConfig
    image_processor: ImageProcessorConfig = field(default_factory=ImageProcessorConfig)
    mrope_interleaved: bool = False  # Qwen3-VL: t/h/w frequencies interleaved, not in three runs
    attention_bias: bool = True  # q/k/v projections carry a bias (Qwen2) or not (Qwen3)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    # which config.json layout this came from: "transformers" or "original"
    layout: str = "transformers"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be divisible by num_key_value_heads")
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ConfigError(f"mrope_section {list(self.mrope_section)} must sum to head_dim/2 = {self.head_dim // 2}")

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token across all layers: 2 x layers x KV heads x head_dim x bytes
        (GQA-aware)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


class ConfigReader:
    """Reads fields out of a config.json dict with messages that name the missing field and the
    file."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data = data
        self.where = where

    def require(self, key: str, what: str = "") -> Any:
        if key not in self.data or self.data[key] is None:
            need = f" ({what})" if what else ""
            raise ConfigError(f"{self.where} has no '{key}'{need}")
        return self.data[key]

    def get(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        return default if value is None else value


def text_and_vision_dicts(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(text fields, vision fields, layout) of a Qwen-VL config.json in either layout:
    "transformers" nests the language model under ``text_config``; the "original" release keeps its
    fields at the top level."""
    if isinstance(d.get("text_config"), dict):
        return {**d, **d["text_config"]}, d.get("vision_config") or {}, "transformers"
    return d, d.get("vision_config") or {}, "original"


# a Qwen-VL config.json's image/video token fields (top level), with the releases' values
QWEN_VL_TOKEN_IDS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}


def decoder_sizes(t: ConfigReader, hidden_size: int, num_heads: int) -> dict[str, int]:
    """The decoder's sizes as every Qwen-VL text config names them, as ``ModelConfig`` fields (the
    KV heads default to the attention heads); a required one that is missing raises ConfigError
    naming it."""
    return {
        "vocab_size": int(t.require("vocab_size")),
        "hidden_size": hidden_size,
        "intermediate_size": int(t.require("intermediate_size")),
        "num_hidden_layers": int(t.require("num_hidden_layers")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(t.get("num_key_value_heads", num_heads)),
    }


def vision_token_ids(d: dict[str, Any]) -> dict[str, int]:
    """The image/video token ids of a Qwen-VL config.json, as ``ModelConfig`` fields (the releases'
    where absent)."""
    return {name: int(d.get(name, default)) for name, default in QWEN_VL_TOKEN_IDS.items()}


def eos_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return () if value is None else (int(value),)


def default_mrope_section(head_dim: int) -> tuple[int, int, int]:
    """Qwen2-VL's 16/24/24 split of 64 rotary pairs, scaled to another head_dim."""
    if head_dim == 128:
        return (16, 24, 24)
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return (t, h, half - t - h)


def image_processor_config(
    pre: dict[str, Any] | None, defaults: ImageProcessorConfig
) -> ImageProcessorConfig:
    """preprocessor_config.json over a family's defaults (both the min/max_pixels and the size dict
    forms)."""
    if not pre:
        return defaults
    size = pre.get("size") or {}
    min_pixels = pre.get("min_pixels") or size.get("shortest_edge") or defaults.min_pixels
    max_pixels = pre.get("max_pixels") or size.get("longest_edge") or defaults.max_pixels
    return ImageProcessorConfig(
        patch_size=int(pre.get("patch_size", defaults.patch_size)),
        merge_size=int(pre.get("merge_size", defaults.merge_size)),
        temporal_patch_size=int(pre.get("temporal_patch_size", defaults.temporal_patch_size)),
        image_mean=tuple(float(x) for x in pre.get("image_mean", defaults.image_mean)),  # type: ignore[arg-type]
        image_std=tuple(float(x) for x in pre.get("image_std", defaults.image_std)),  # type: ignore[arg-type]
        min_pixels=int(min_pixels),
        max_pixels=int(max_pixels),
    )
