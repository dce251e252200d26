"""Qwen3-VL vision tower: 16-px patches (+ a learned position table resampled to the grid) -> ViT blocks with 2D
rotary -> 2x2 merger -> LM-width image tokens, plus DeepStack features.

Input rows are patches as the Qwen2-VL image processor emits them (configured with Qwen3-VL's 16-px patches and
0.5 mean/std): per image ``t * h * w`` rows, every 2x2 merge window 4 consecutive rows, each row ``C * T * P * P``
pixels. What differs from Qwen2-VL's tower (qwen2_vl_vision.py, whose attention and position ids are reused):

- the patch embedding has a bias, and a learned ``pos_embed`` table of ``num_position_embeddings`` = side^2 rows
  (a square grid) is resampled bilinearly (align_corners) to each image's h x w patches and added to it;
- blocks use a GELU-tanh MLP (``linear_fc1``/``linear_fc2``); every block attends over the whole image;
- after block ``deepstack_visual_indexes[k]`` the hidden state goes through its own merger (LayerNorm over the
  4 merged patches: "postshuffle") to give DeepStack feature k, which the LM adds to the image's rows after decoder
  layer k. The main merger normalises each patch before merging.

One encoder unit per block, as Qwen2-VL: ``run_units`` collects each DeepStack feature as soon as its block has run,
so an encode split anywhere across steps gives the same tensors as the whole tower.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.models.config import ImageProcessorConfig, VisionConfig
from firsttoken.models.interfaces import EncodeState, ImageEmbeddings
from firsttoken.models.layers import quick_gelu
from firsttoken.models.linear import Linear
from firsttoken.models.qwen2_vl_vision import (
    VISION_LN_EPS,
    VisionAttention,
    _check_patches,
    full_attention_units,
    vision_position_ids,
    vision_rotary_cos_sin,
)
from firsttoken.models.vision_units import PartialBlock, run_units
from firsttoken.types import EncoderUnit

# Qwen3-VL's preprocessor_config.json: 16-px patches, 2x2 merge, mean = std = 0.5, size {shortest_edge: 256^2
# (64 tokens), longest_edge: 4096^2 (16384 tokens)}.
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


class PatchEmbed(nn.Module):
    """The reference's Conv3d(kernel = stride = (T, P, P), with bias) as a Linear over the flattened patch (the
    loader reshapes the weight to [embed_dim, C*T*P*P])."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.proj = Linear(patch_dim, config.embed_dim, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} unsupported ({', '.join(ACTIVATIONS)})")
        self.linear_fc1 = Linear(config.embed_dim, config.intermediate_size)
        self.linear_fc2 = Linear(config.intermediate_size, config.embed_dim)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=VISION_LN_EPS)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=VISION_LN_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, patches_per_image: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, patches_per_image)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 window's 4 consecutive rows concatenated -> fc1 -> GELU -> fc2 -> LM hidden size. The LayerNorm
    runs per patch before the concatenation (main merger) or over the concatenated row (``postshuffle``: the
    DeepStack mergers)."""

    def __init__(self, config: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle else config.embed_dim, eps=VISION_LN_EPS)
        self.linear_fc1 = Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = Linear(self.merged_dim, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_patches, embed_dim] -> [num_patches / 4, out]
        x = self.norm(x.view(-1, self.merged_dim)) if self.postshuffle else self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@dataclass
class Qwen3EncodeState(EncodeState):
    hidden: torch.Tensor  # [num_patches, embed_dim] after the blocks finished so far
    cos: torch.Tensor  # [num_patches, 1, 1, head_dim] fp32
    sin: torch.Tensor
    units: tuple[EncoderUnit, ...]  # the image's units (full_attention_units)
    units_done: int = 0
    deepstack: list[torch.Tensor] = field(default_factory=list)  # features of the DeepStack blocks run so far
    partial: PartialBlock | None = None  # a block part-way through its row slices


class Qwen3VisionTransformer(nn.Module):
    """One encoder unit per block; patch + position embedding in ``start_encode``, the main merger in
    ``finish_encode``, each DeepStack merger right after its block."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        if config.num_position_embeddings < 1:
            raise ValueError("vision_config.num_position_embeddings must be >= 1 (a square table of positions)")
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.embed_dim)
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)  # as the reference: floor(sqrt)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(config, postshuffle=True) for _ in config.deepstack_visual_indexes]
        )
        # block index -> which DeepStack merger runs after it
        self._deepstack_of_block = {b: k for k, b in enumerate(config.deepstack_visual_indexes)}

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def start_encode(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> Qwen3EncodeState:
        _check_patches(pixel_values, [grid_thw])
        cos, sin = vision_rotary_cos_sin(self.config, [grid_thw], pixel_values.device)
        units = full_attention_units(self.config, grid_thw)
        return Qwen3EncodeState(self.embed(pixel_values, [grid_thw]), cos, sin, units)

    def run_units(self, state: Qwen3EncodeState, num_units: int) -> None:  # type: ignore[override]
        patches = [state.hidden.shape[0]]

        def deepstack(b: int, hidden: torch.Tensor) -> None:
            if b in self._deepstack_of_block:
                state.deepstack.append(self.deepstack_merger_list[self._deepstack_of_block[b]](hidden))

        run_units(state, num_units, self.blocks,
                  lambda b, hidden: self.blocks[b](hidden, state.cos, state.sin, patches), deepstack)

    def finish_encode(self, state: Qwen3EncodeState) -> ImageEmbeddings:  # type: ignore[override]
        return ImageEmbeddings(self.merger(state.hidden), tuple(state.deepstack))

    def forward(
        self,
        pixel_values: torch.Tensor,  # [num_patches, C*T*P*P]
        grid_thw: Sequence[tuple[int, int, int]],  # per image (t, h, w) in patches
    ) -> ImageEmbeddings:
        """The whole tower over several images at once: every tensor [sum of t*h*w / merge^2, out_hidden_size],
        images back to back (attention never crosses images)."""
        patches_per_image = _check_patches(pixel_values, grid_thw)
        cos, sin = vision_rotary_cos_sin(self.config, grid_thw, pixel_values.device)
        x = self.embed(pixel_values, grid_thw)
        deepstack = []
        for b, block in enumerate(self.blocks):
            x = block(x, cos, sin, patches_per_image)
            if b in self._deepstack_of_block:
                deepstack.append(self.deepstack_merger_list[self._deepstack_of_block[b]](x))
        return ImageEmbeddings(self.merger(x), tuple(deepstack))

    def embed(self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """[num_patches, embed_dim]: patch embedding + the position table resampled to each image's grid."""
        hidden = self.patch_embed(pixel_values)
        indices, weights = position_taps(grid_thw, self.num_grid_per_side, self.config.spatial_merge_size,
                                         pixel_values.device)
        # the reference's arithmetic: taps in the table's dtype times fp32 weights, summed, cast to the activations'
        pos = (self.pos_embed(indices) * weights[:, :, None]).sum(1)
        return hidden + pos.to(hidden.dtype)


def position_taps(
    grid_thw: Sequence[tuple[int, int, int]], side: int, merge_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear resampling (align_corners=True) of a side x side table to each image's h x w patch grid, as
    gather taps: (indices [num_patches, 4] into the flattened table, fp32 weights [num_patches, 4]), patches in
    the processor's merge-window order. Taps are (row0, col0), (row0, col1), (row1, col0), (row1, col1); the
    arithmetic is transformers' ``get_vision_interpolation_indices_and_weights`` so the weights are bit-equal."""
    indices, weights = [], []
    for t, h, w in grid_thw:
        pos = vision_position_ids([(t, h, w)], merge_size, device)  # [t*h*w, 2] (row, col)
        row_taps, row_weights = _axis_taps(pos[:, 0], h, side)
        col_taps, col_weights = _axis_taps(pos[:, 1], w, side)
        indices.append((row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4))
        weights.append((row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4))
    return torch.cat(indices), torch.cat(weights)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per axis: the two table rows either side of each patch's source coordinate, and their linear weights."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)  # endpoints map onto the table's endpoints
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    distance = (src[:, None] - floor[:, None] - offsets).abs()
    return taps, (1 - distance).clamp(min=0)
