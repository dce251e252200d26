"""The resumable vision tower every family's extends: an image's encode started, run a few encoder
units at a time across steps, and finished (models/interfaces.py's ``VisionEncoder``), and the same
path over several images at once (``forward``).

A tower is patch embedding -> ``blocks`` (pre-norm ViT blocks with 2D rotary,
qwen2_vl_vision.VisionBlock's signature) -> ``merger``. Between ``start_encode`` and
``finish_encode`` its rows live in the tower's own order (a ``RowLayout``: the processor's, or
Qwen2.5-VL's window order), and the layout says which rows attend together in each block. What a
family changes is a hook:

    encoder_units(vision, grid)    the family's units (a static function, also the scheduler's)
    layout(grids, device)          row order and attention segments (default: processor order, one segment a frame)
    embed(pixel_values, grids)     patch rows -> [num_patches, embed_dim] (default: ``patch_embed``)
    block_feature(block, hidden)   a tensor to keep from a block's output, or None (Qwen3-VL's DeepStack features)

Rotary tables are Qwen2-VL's 2D rotary for every family (``vision_rotary_cos_sin``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import nn

from firsttoken.models.interfaces import EncodeState, ImageEmbeddings
from firsttoken.models.layers import rope_inv_freq
from firsttoken.models.model_config import VisionConfig
from firsttoken.models.vision_units import PartialBlock, run_units, whole_blocks
from firsttoken.types import EncoderUnit

Grid = tuple[int, int, int]  # (t, h, w) in patches
VISION_ROPE_THETA = 10000.0


class RowLayout(Protocol):
    """Where an encode's patch rows sit in the tower and which of them attend together."""

    def reorder(self, rows: torch.Tensor) -> torch.Tensor:
        """Processor-order patch rows [num_patches, ...] -> the tower's order."""
        ...

    def restore_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Merged tokens [num_patches / merge^2, ...] in the tower's order -> the processor's."""
        ...

    def segments(self, block: int) -> list[int]:
        """Lengths of the runs of rows (tower order) that attend together in ``block``; they sum to
        num_patches."""
        ...


@dataclass(frozen=True)
class ImageSegments:
    """The processor's order; every block attends within each frame (temporal grid) of each image
    (Qwen2-VL, Qwen3-VL)."""

    frame_rows: list[int]  # patch rows per temporal grid (h * w), images back to back

    def reorder(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def restore_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def segments(self, block: int) -> list[int]:
        return self.frame_rows


@dataclass
class TowerState(EncodeState):
    # [num_patches, embed_dim] in the layout's order, after the blocks finished so far
    hidden: torch.Tensor
    cos: torch.Tensor  # [num_patches, 1, 1, head_dim] fp32, the layout's order
    sin: torch.Tensor
    layout: RowLayout
    # the image's units (the family's encoder_units; whole blocks in ``forward``)
    units: tuple[EncoderUnit, ...]
    units_done: int = 0
    partial: PartialBlock | None = None  # a block part-way through its row slices
    # block_feature's tensors so far, in block order
    features: list[torch.Tensor] = field(default_factory=list)


class VisionTower(nn.Module):
    """The encode protocol over ``patch_embed``, ``blocks`` and ``merger``, which a subclass builds
    in its ``__init__`` after ``super().__init__(config)``. One encoder unit is a block or a
    query-row slice of one (models/vision_units.py); an encode split anywhere across steps gives the
    tensors of the whole pass."""

    encoder_units: ClassVar[Callable[[VisionConfig, Grid], tuple[EncoderUnit, ...]]]
    patch_embed: nn.Module
    blocks: nn.ModuleList
    merger: nn.Module

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def start_encode(self, pixel_values: torch.Tensor, grid_thw: Grid) -> TowerState:
        """``pixel_values`` [t*h*w, C*T*P*P]: one image's patch rows as the processor emits them."""
        return self._start(pixel_values, [grid_thw], self.encoder_units(self.config, grid_thw))

    def run_units(self, state: TowerState, num_units: int) -> None:  # type: ignore[override]
        def whole_block(b: int, hidden: torch.Tensor) -> torch.Tensor:
            return self.blocks[b](hidden, state.cos, state.sin, state.layout.segments(b))

        def keep_feature(b: int, hidden: torch.Tensor) -> None:
            feature = self.block_feature(b, hidden)
            if feature is not None:
                state.features.append(feature)

        run_units(state, num_units, self.blocks, whole_block, keep_feature)

    def finish_encode(self, state: TowerState) -> ImageEmbeddings:  # type: ignore[override]
        restore = state.layout.restore_tokens
        return ImageEmbeddings(
            restore(self.merger(state.hidden)), tuple(restore(f) for f in state.features)
        )

    def forward(
        self,
        pixel_values: torch.Tensor,  # [num_patches, C*T*P*P], images back to back
        grid_thw: Sequence[Grid],  # per image
    ) -> ImageEmbeddings:
        """The whole tower over several images at once: every tensor [sum of t*h*w / merge^2,
        out_hidden_size], images back to back in the processor's order (attention never crosses
        images)."""
        state = self._start(pixel_values, grid_thw, whole_blocks(self.config.depth))
        self.run_units(state, state.num_units)
        return self.finish_encode(state)

    # ---------------------------------------------------------------- hooks

    def layout(self, grids: Sequence[Grid], device: torch.device) -> RowLayout:
        return ImageSegments([h * w for t, h, w in grids for _ in range(t)])

    def embed(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        return self.patch_embed(pixel_values)

    def block_feature(self, block: int, hidden: torch.Tensor) -> torch.Tensor | None:
        return None

    # ----------------------------------------------------------------

    def _start(
        self, pixel_values: torch.Tensor, grids: Sequence[Grid], units: tuple[EncoderUnit, ...]
    ) -> TowerState:
        check_patches(pixel_values, grids)
        layout = self.layout(grids, pixel_values.device)
        cos, sin = vision_rotary_cos_sin(self.config, grids, pixel_values.device)
        hidden = self.embed(pixel_values, grids)  # [num_patches, embed_dim], processor order
        return TowerState(
            layout.reorder(hidden), layout.reorder(cos), layout.reorder(sin), layout, units
        )


def check_patches(pixel_values: torch.Tensor, grids: Sequence[Grid]) -> list[int]:
    """Patch rows per image; ValueError when the grids do not cover ``pixel_values``' rows."""
    patches_per_image = [t * h * w for t, h, w in grids]
    if sum(patches_per_image) != pixel_values.shape[0]:
        raise ValueError(
            f"grid_thw covers {sum(patches_per_image)} patches but pixel_values has {pixel_values.shape[0]} rows"
        )
    return patches_per_image


def vision_rotary_cos_sin(
    config: VisionConfig, grid_thw: Sequence[Grid], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tables [num_patches, 1, 1, head_dim] in processor order: the first half of each head's
    pairs rotates by the patch row, the second half by the patch column."""
    pos = vision_position_ids(grid_thw, config.spatial_merge_size, device)  # [num_patches, 2]
    inv_freq = rope_inv_freq(config.head_dim // 2, VISION_ROPE_THETA, device)  # [head_dim // 4]
    # [num_patches, head_dim // 2] = [h freqs, w freqs]
    freqs = (pos[..., None].float() * inv_freq).flatten(1)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    return emb.cos(), emb.sin()


def vision_position_ids(
    grid_thw: Sequence[Grid], merge_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[num_patches, 2] (row, col) of each patch, in the processor's merge-window-major order."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        shape = (h // merge_size, merge_size, w // merge_size, merge_size)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
    return torch.cat(out, dim=0)
