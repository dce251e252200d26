"""What a model family provides the engine: everything model-specific, in one value per family.

Adding a family is writing its module under models/ (config parsing, the nn.Module, its weight
mapping, its encoder units, its make-model recipe) and listing its ``ModelFamily`` in
models/registry.py (or, from a test or a plugin, ``registry.register(family)``). Nothing in engine/,
scheduler/ or runner/ names a family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from firsttoken.attention.base import AttentionBackend
from firsttoken.models.decode import DecoderLayout
from firsttoken.models.ladder import PIXEL_LADDER, BudgetLadder
from firsttoken.models.model_config import ModelConfig, VisionConfig
from firsttoken.models.mrope import Grid, MRopePositions, compute_mrope_positions
from firsttoken.models.recipe import CheckpointRecipe
from firsttoken.models.weights import WeightMapping
from firsttoken.types import EncoderUnit


class PositionsFn(Protocol):
    """A prompt's M-RoPE positions, as transformers' ``get_rope_index`` for the family gives them.
    ``input_ids`` hold the expanded pads (images: ``image_token_id``, videos: ``video_token_id``, in
    any order); ``image_grid_thw`` one (t, h, w) per image and ``video_grid_thw`` one per video,
    each in prompt order; ``second_per_grid_ts`` one per video (seconds of clip per temporal grid)
    or empty (1 s each). ValueError when grids and pads disagree."""

    def __call__(
        self,
        input_ids: Sequence[int],
        image_grid_thw: Sequence[Grid],
        config: ModelConfig,
        video_grid_thw: Sequence[Grid] = (),
        second_per_grid_ts: Sequence[float] = (),
    ) -> MRopePositions: ...


class VideoPromptTokensFn(Protocol):
    """The token ids that replace ONE ``<|video_pad|>`` of the chat template for a video of
    ``grid_thw`` (t, h, w) patches, ``grid_timestamps_s`` its t grid times in seconds
    (inputs/video.py ``VideoPlan.grid_timestamps``); ``encode`` turns text into token ids without
    special tokens. The result is what transformers' processor puts there, token for token, and the
    family's ``positions`` reads it back with ``video_grid_thw=[grid_thw]``."""

    def __call__(
        self,
        grid_thw: Grid,
        grid_timestamps_s: Sequence[float],
        config: ModelConfig,
        encode: Callable[[str], list[int]],
    ) -> list[int]: ...


def video_pad_tokens(
    grid_thw: Grid,
    grid_timestamps_s: Sequence[float],
    config: ModelConfig,
    encode: Callable[[str], list[int]],
) -> list[int]:
    """Qwen2-VL / Qwen2.5-VL: one contiguous run of t * (h/m) * (w/m) video pads; no timestamps."""
    t, h, w = grid_thw
    return [config.video_token_id] * (t * h * w // config.vision.spatial_merge_size**2)


@dataclass(frozen=True)
class ImageSlots:
    """How a family's prompt marks an image, as control-token strings of its tokenizer. The chat
    template writes ``pad`` once per image, and the renderer repeats it into the image's planned
    visual tokens. Either way the prompt holds ``start``, the pads, ``end``: with
    ``renderer_wraps`` False the template writes ``start`` + ``pad`` + ``end`` itself (Qwen-VL);
    True, it writes ``pad`` alone and the renderer puts ``start`` before the pads and ``end`` after
    them, as transformers' processor does (InternVL). The three strings' ids are config.json's
    (``ModelConfig.image_token_id``, ``vision_start_token_id``, ``vision_end_token_id``).
    ``control``: every string that marks an image or video slot, the three among them; client text
    never makes one (inputs/render.py encodes them as plain text)."""

    pad: str
    start: str
    end: str
    renderer_wraps: bool
    control: tuple[str, ...]


QWEN_IMAGE_SLOTS = ImageSlots(
    pad="<|image_pad|>",
    start="<|vision_start|>",
    end="<|vision_end|>",
    renderer_wraps=False,
    control=("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
)


def main_rows_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """An image's encoder output per visual token when it is ``ImageEmbeddings.main`` alone: one row
    of the language model's width."""
    return config.hidden_size * dtype_bytes


@dataclass(frozen=True)
class ModelFamily:
    name: str  # "qwen2-vl": what make-model --family and the README call it
    architectures: tuple[str, ...]  # config.json "architectures" values served by this family
    # config.json "model_type" values (fallback when architectures is absent)
    model_types: tuple[str, ...]
    # (config.json dict, preprocessor_config.json dict or None) -> ModelConfig; ConfigError names a
    # missing field
    parse_config: Callable[[dict[str, Any], dict[str, Any] | None], ModelConfig]
    # an nn.Module honouring models/interfaces.py
    build: Callable[[ModelConfig, AttentionBackend], nn.Module]
    weights: WeightMapping
    encoder_units: Callable[[VisionConfig, Grid], tuple[EncoderUnit, ...]]
    # how make-model builds a random checkpoint; its transformers class is the oracle
    checkpoint: CheckpointRecipe
    positions: PositionsFn = compute_mrope_positions
    video_prompt_tokens: VideoPromptTokensFn = video_pad_tokens
    # (config, bytes per element of the model's dtype) -> bytes of ImageEmbeddings per visual token:
    # what one token of an image holds in the encoder cache (main rows, and DeepStack features where
    # the tower has them)
    encoder_bytes_per_token: Callable[[ModelConfig, int], int] = main_rows_bytes
    # its decoder's parts as decode methods that read weights directly see them (models/decode.py:
    # the fused decode layers); None: its decoder layers always run eagerly
    decoder_layout: Callable[[ModelConfig], DecoderLayout] | None = None
    # the visual-token budgets an image can be planned at (models/ladder.py)
    budget_ladder: BudgetLadder = PIXEL_LADDER
    # False: a request with a video (a clip or a frame list) is refused with a 400 naming the part
    video: bool = True
    # the control tokens that mark an image slot in its prompts, and who writes them
    image_slots: ImageSlots = QWEN_IMAGE_SLOTS
