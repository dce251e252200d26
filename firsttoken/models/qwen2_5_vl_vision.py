"""Qwen2.5-VL vision tower: Qwen2-VL's patch embedding, 2D rotary and attention, with RMSNorm in the
blocks and the merger, a SwiGLU MLP with biases, and window attention.

Window attention. ``window_size`` pixels per side (112 = 4 x 4 merged tokens at 14-px patches and a
2 x 2 merge). ``start_encode`` reorders an image's merge units (merge^2 consecutive patch rows, as
the processor emits them) window by window: windows row-major over the merged-token grid of each
frame, tokens row-major inside a window, the last window row and column cut short where the grid
does not divide. Every window is then a contiguous run of rows. Blocks listed in
``fullatt_block_indexes`` attend over the whole frame, the others within each window; both see the
same reordered rows and rotary tables. ``finish_encode`` runs the merger on the reordered rows (a
merge unit is never split) and restores the processor's order. This is transformers'
``get_vision_window_index`` without its empty padding windows.

Each block is one encoder unit. Its cost against a step's token budget is its share of a
full-attention block's FLOPs (``block_flops``): a windowed block of a large image costs a fraction
of its visual tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from firsttoken.models.layers import RMSNorm, SwiGLUMLP
from firsttoken.models.model_config import VisionConfig
from firsttoken.models.qwen2_vl_vision import PatchEmbed, PatchMerger, VisionBlock
from firsttoken.models.vision_tower import Grid, VisionTower
from firsttoken.models.vision_units import qkv_share, split_block
from firsttoken.types import EncoderUnit

VISION_NORM_EPS = 1e-6  # RMSNorm in the blocks and the merger


def merged_window_side(vision: VisionConfig) -> int:
    """Merged tokens per window side (4 for 112 px, 14-px patches, 2 x 2 merge); the reference's
    integer division."""
    return vision.window_size // vision.spatial_merge_size // vision.patch_size


def window_spans(num_tokens: int, side: int) -> list[int]:
    """Lengths of the windows along one axis of ``num_tokens`` merged tokens: full windows, then the
    remainder."""
    full, rest = divmod(num_tokens, side)
    return [side] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class WindowLayout:
    """Where every merge unit of a batch of images sits in window order, and which rows attend
    together."""

    # [num_merge_units] int64: processor-order index of the unit at each window-order position
    order: torch.Tensor
    # [num_merge_units] int64: window-order position of each processor-order unit
    restore: torch.Tensor
    # patch rows per window, in window order (windowed blocks attend within each)
    window_rows: list[int]
    frame_rows: list[int]  # patch rows per frame (full-attention blocks attend within each)
    # blocks attending within each frame; None: every block
    full_attention_blocks: frozenset[int] | None

    def reorder(self, rows: torch.Tensor) -> torch.Tensor:
        """Processor-order patch rows [num_patches, ...] -> window order (merge units move
        whole)."""
        units = rows.view(self.order.numel(), -1, *rows.shape[1:])
        return units[self.order].reshape(rows.shape)

    def restore_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Merged tokens [num_merge_units, ...] in window order -> the processor's order."""
        return tokens[self.restore]

    def segments(self, block: int) -> list[int]:
        if self.full_attention_blocks is None or block in self.full_attention_blocks:
            return self.frame_rows
        return self.window_rows


def window_layout(
    grids: Sequence[Grid], vision: VisionConfig, device: torch.device | str = "cpu"
) -> WindowLayout:
    """The window order of images back to back (attention never crosses an image or a frame).
    Without windows (``window_size`` 0) a frame is one window and the order is the processor's."""
    merge = vision.spatial_merge_size
    orders: list[torch.Tensor] = []
    window_rows: list[int] = []
    frame_rows: list[int] = []
    offset = 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        side = merged_window_side(vision) if vision.uses_windows else max(gh, gw)
        index = torch.arange(offset, offset + t * gh * gw).reshape(t, gh, gw)
        for frame in index:
            for r0, rows in zip(range(0, gh, side), window_spans(gh, side)):
                for c0, cols in zip(range(0, gw, side), window_spans(gw, side)):
                    orders.append(frame[r0 : r0 + rows, c0 : c0 + cols].flatten())
                    window_rows.append(rows * cols * merge**2)
            frame_rows.append(h * w)
        offset += t * gh * gw
    # built on the CPU: one small copy, not a kernel per window
    order = torch.cat(orders).to(device)
    full_attention = frozenset(vision.fullatt_block_indexes) if vision.uses_windows else None
    return WindowLayout(order, torch.argsort(order), window_rows, frame_rows, full_attention)


def block_flops(vision: VisionConfig, num_patches: int, attention_pairs: int) -> int:
    """Multiply-adds x 2 of one vision block over ``num_patches`` rows whose attention scores
    ``attention_pairs`` query-key pairs: linear layers per patch (qkv 3E^2, proj E^2, gate/up 2EI,
    down EI) plus attention (QK^T and attention x V: 2 x pairs x head_dim x heads multiply-adds)."""
    e, i = vision.embed_dim, vision.intermediate_size
    linear = 2 * (4 * e * e + 3 * e * i)
    attention = 2 * 2 * attention_pairs * vision.head_dim * vision.num_heads
    return num_patches * linear + attention


def window_attention_units(vision: VisionConfig, grid_thw: Grid) -> tuple[EncoderUnit, ...]:
    """One unit per block (a large image's full-attention blocks: their query-row slices,
    models/vision_units.py). A full-attention block scores t x (h*w)^2 pairs and costs the image's
    visual tokens (as a Qwen2-VL block); a windowed block scores the sum of its windows' squares and
    costs round(visual tokens x its FLOPs / a full block's FLOPs), at least 1."""
    t, h, w = grid_thw
    merge = vision.spatial_merge_size
    num_patches = t * h * w
    visual_tokens = num_patches // merge**2
    full_pairs = t * (h * w) ** 2
    if vision.uses_windows:
        side = merged_window_side(vision)
        spans_h, spans_w = window_spans(h // merge, side), window_spans(w // merge, side)
        window_pairs = t * sum((a * b * merge**2) ** 2 for a in spans_h for b in spans_w)
    else:
        window_pairs = full_pairs
    full_flops = block_flops(vision, num_patches, full_pairs)

    def unit(pairs: int) -> EncoderUnit:
        share = block_flops(vision, num_patches, pairs) / full_flops
        return EncoderUnit(num_patches, pairs, max(1, round(visual_tokens * share)))

    full, windowed = unit(full_pairs), unit(window_pairs)
    share = qkv_share(vision, mlp_matrices=3)
    attends_fully = (
        set(vision.fullatt_block_indexes) if vision.uses_windows else set(range(vision.depth))
    )
    return tuple(
        u
        for b in range(vision.depth)
        for u in (
            split_block(full, b, [h * w] * t, share)
            if b in attends_fully
            else (replace(windowed, block=b),)
        )
    )


def rms_norm(width: int) -> nn.Module:
    return RMSNorm(width, VISION_NORM_EPS)


class Qwen25VisionTransformer(VisionTower):
    """Qwen2-VL's blocks with RMSNorm and a SwiGLU MLP with biases, attending within windows or
    frames as the ``WindowLayout`` says; the merger behind an RMSNorm. One encoder unit per block
    (or its row slices); patch embedding and the window reorder run in ``start_encode``, the merger
    and the restored order in ``finish_encode``."""

    encoder_units = staticmethod(window_attention_units)

    def __init__(self, config: VisionConfig) -> None:
        super().__init__(config)
        if config.hidden_act != "silu":
            raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} unsupported (silu)")
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(
            [
                VisionBlock(
                    config,
                    rms_norm,
                    SwiGLUMLP(config.embed_dim, config.intermediate_size, bias=True),
                )
                for _ in range(config.depth)
            ]
        )
        self.merger = PatchMerger(config, rms_norm)

    def layout(self, grids: Sequence[Grid], device: torch.device) -> WindowLayout:
        return window_layout(grids, self.config, device)
