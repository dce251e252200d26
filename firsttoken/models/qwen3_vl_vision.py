"""Qwen3-VL vision tower: 16-px patches (+ a learned position table resampled to the grid) -> ViT
blocks with 2D rotary -> 2x2 merger -> LM-width image tokens, plus DeepStack features.

Input rows are patches as the Qwen2-VL image processor emits them (configured with Qwen3-VL's 16-px
patches and 0.5 mean/std): per image ``t * h * w`` rows, every 2x2 merge window 4 consecutive rows,
each row ``C * T * P * P`` pixels. What differs from Qwen2-VL's tower (qwen2_vl_vision.py, whose
attention and position ids are reused):

- the patch embedding has a bias, and a learned ``pos_embed`` table of ``num_position_embeddings`` =
  side^2 rows (a square grid) is resampled bilinearly (align_corners) to each image's h x w patches
  and added to it;
- blocks use a GELU-tanh MLP; every block attends over the whole image;
- after block ``deepstack_visual_indexes[k]`` the hidden state goes through its own merger
  (LayerNorm over the 4 merged patches: "postshuffle") to give DeepStack feature k, which the LM
  adds to the image's rows after decoder layer k. The main merger normalises each patch before
  merging.

One encoder unit per block, as Qwen2-VL: ``run_units`` collects each DeepStack feature as soon as
its block has run, so an encode split anywhere across steps gives the same tensors as the whole
tower.

The modules are Qwen2-VL's; the checkpoint names their parts as transformers' Qwen3-VL does
(``mlp.linear_fc1``, a merger's ``norm`` / ``linear_fc1`` / ``linear_fc2``), which
``VISION_RENAMES`` maps onto Qwen2-VL's (``mlp.fc1``, ``ln_q`` / ``mlp.0`` / ``mlp.2``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.models.layers import quick_gelu
from firsttoken.models.model_config import (
    ImageProcessorConfig,
    ModelConfig,
    VisionConfig,
)
from firsttoken.models.qwen2_vl_vision import (
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    VisionMLP,
    full_attention_units,
)
from firsttoken.models.vision_tower import Grid, VisionTower, vision_position_ids

# Qwen3-VL's preprocessor_config.json: 16-px patches, 2x2 merge, mean = std = 0.5, size
# {shortest_edge: 256^2 (64 tokens), longest_edge: 4096^2 (16384 tokens)}.
IMAGE_PROCESSOR = ImageProcessorConfig(
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    min_pixels=65536,
    max_pixels=16777216,
)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # the releases'
    "gelu": F.gelu,
    "quick_gelu": quick_gelu,
}


_MERGER = r"^(visual\.(?:merger|deepstack_merger_list\.\d+)\.)"
# the checkpoint's names (after the prefixes) -> our modules'
VISION_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^(visual\.blocks\.\d+\.mlp\.)linear_(fc[12])\.", r"\1\2."),
    (_MERGER + r"norm\.", r"\1ln_q."),
    (_MERGER + r"linear_fc1\.", r"\1mlp.0."),
    (_MERGER + r"linear_fc2\.", r"\1mlp.2."),
)


def deepstack_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """An image's encoder output per visual token: its main row and one DeepStack row per fed
    decoder layer, each of the language model's width."""
    return config.hidden_size * dtype_bytes * (1 + len(config.vision.deepstack_visual_indexes))


class Qwen3VisionTransformer(VisionTower):
    """Qwen2-VL's modules with a biased patch embedding and a GELU-tanh MLP, plus the learned
    position table (in ``embed``) and a DeepStack merger after each of ``deepstack_visual_indexes``'
    blocks (``block_feature``). One encoder unit per block (or its row slices); the main merger runs
    in ``finish_encode``."""

    encoder_units = staticmethod(full_attention_units)

    def __init__(self, config: VisionConfig) -> None:
        super().__init__(config)
        if config.num_position_embeddings < 1:
            raise ValueError(
                "vision_config.num_position_embeddings must be >= 1 (a square table of positions)"
            )
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.embed_dim)
        # as the reference: floor(sqrt)
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList([VisionBlock(config, mlp=VisionMLP(config, ACTIVATIONS))
                                     for _ in range(config.depth)])
        self.merger = PatchMerger(config)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(config, postshuffle=True) for _ in config.deepstack_visual_indexes]
        )
        # block index -> which DeepStack merger runs after it
        self._deepstack_of_block = {b: k for k, b in enumerate(config.deepstack_visual_indexes)}

    def embed(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """[num_patches, embed_dim]: patch embedding + the position table resampled to each image's
        grid."""
        hidden = self.patch_embed(pixel_values)
        indices, weights = position_taps(
            grids, self.num_grid_per_side, self.config.spatial_merge_size, pixel_values.device
        )
        # the reference's arithmetic: taps in the table's dtype times fp32 weights, summed, cast to
        # the activations'
        pos = (self.pos_embed(indices) * weights[:, :, None]).sum(1)
        return hidden + pos.to(hidden.dtype)

    def block_feature(self, block: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """DeepStack feature k after block ``deepstack_visual_indexes[k]``: [num_patches / merge^2,
        out_hidden]."""
        k = self._deepstack_of_block.get(block)
        return None if k is None else self.deepstack_merger_list[k](hidden)


def position_taps(
    grid_thw: Sequence[tuple[int, int, int]],
    side: int,
    merge_size: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear resampling (align_corners=True) of a side x side table to each image's h x w patch
    grid, as gather taps: (indices [num_patches, 4] into the flattened table, fp32 weights
    [num_patches, 4]), patches in the processor's merge-window order. Taps are (row0, col0), (row0,
    col1), (row1, col0), (row1, col1); the arithmetic is transformers'
    ``get_vision_interpolation_indices_and_weights`` so the weights are bit-equal."""
    indices, weights = [], []
    for t, h, w in grid_thw:
        pos = vision_position_ids([(t, h, w)], merge_size, device)  # [t*h*w, 2] (row, col)
        row_taps, row_weights = _axis_taps(pos[:, 0], h, side)
        col_taps, col_weights = _axis_taps(pos[:, 1], w, side)
        indices.append((row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4))
        weights.append((row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4))
    return torch.cat(indices), torch.cat(weights)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per axis: the two table rows either side of each patch's source coordinate, and their linear
    weights."""
    # endpoints map onto the table's endpoints
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    distance = (src[:, None] - floor[:, None] - offsets).abs()
    return taps, (1 - distance).clamp(min=0)
