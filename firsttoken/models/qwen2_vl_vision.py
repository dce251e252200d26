"""Qwen2-VL vision tower: patches -> ViT blocks with 2D rotary -> 2x2 patch merger -> LM-width image tokens.

Input rows are patches as the Qwen2-VL image processor emits them: per image, ``t * h * w`` rows (``h``/``w`` in
patches), ordered so every 2x2 merge window is 4 consecutive rows; each row is ``C * T * P * P`` pixels
flattened in (channel, frame, y, x) order. Output: ``t * h * w / 4`` rows per image, images back to back.
Attention never crosses images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.models.config import ImageProcessorConfig, VisionConfig
from firsttoken.models.interfaces import EncodeState, ImageEmbeddings
from firsttoken.models.layers import apply_rotary, quick_gelu, rope_inv_freq
from firsttoken.models.linear import Linear
from firsttoken.models.vision_units import PartialBlock, qkv_share, run_units, split_block
from firsttoken.types import EncoderUnit

VISION_ROPE_THETA = 10000.0
VISION_LN_EPS = 1e-6
IMAGE_PROCESSOR = ImageProcessorConfig()  # Qwen2-VL's preprocessor defaults: 14-px patches, 2x2 merge, CLIP mean/std


class PatchEmbed(nn.Module):
    """The reference's Conv3d(kernel = stride = (T, P, P), no bias) is one matmul per patch: a Linear over the
    flattened patch, weight = conv weight reshaped to [embed_dim, C*T*P*P] (the loader does the reshape)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.proj = Linear(patch_dim, config.embed_dim, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = Linear(config.embed_dim, 3 * config.embed_dim, bias=True)
        self.proj = Linear(config.embed_dim, config.embed_dim, bias=True)

    def forward(
        self,
        x: torch.Tensor,  # [num_patches, embed_dim]
        cos: torch.Tensor,  # [num_patches, 1, 1, head_dim] fp32
        sin: torch.Tensor,
        patches_per_image: list[int],
    ) -> torch.Tensor:
        return self.attend(*self.project(x, cos, sin), patches_per_image)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [1, num_heads, num_patches, head_dim]: 4-D so CPU SDPA takes its flash kernel."""
        num_patches = x.shape[0]
        qkv = self.qkv(x).view(num_patches, 3, self.num_heads, self.head_dim)
        # rotary in fp32 like the reference, on q and k together
        qk = apply_rotary(qkv[:, :2].float(), cos, sin).to(x.dtype)
        q, k = qk.permute(1, 2, 0, 3).unsqueeze(1).unbind(0)
        return q, k, qkv[:, 2].transpose(0, 1).unsqueeze(0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[int]) -> torch.Tensor:
        """[query rows, embed_dim]: each segment's queries over its own keys (one segment: every query row over
        every key, also when ``q`` holds a slice of the rows)."""
        if len(segments) == 1:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(qi, ki, vi)
                    for qi, ki, vi in zip(q.split(segments, 2), k.split(segments, 2), v.split(segments, 2))
                ],
                dim=2,
            )
        return self.proj(out[0].transpose(0, 1).reshape(q.shape[2], -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = Linear(config.embed_dim, config.intermediate_size)
        self.fc2 = Linear(config.intermediate_size, config.embed_dim)
        if config.hidden_act not in ("quick_gelu", "gelu"):
            raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} unsupported (quick_gelu, gelu)")
        self.act = quick_gelu if config.hidden_act == "quick_gelu" else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


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
    """LayerNorm, then each 2x2 window's 4 consecutive rows concatenated -> MLP -> LM hidden size."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(config.embed_dim, eps=VISION_LN_EPS)
        self.mlp = nn.Sequential(
            Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            Linear(self.merged_dim, config.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


@dataclass
class Qwen2EncodeState(EncodeState):
    hidden: torch.Tensor  # [num_patches, embed_dim] after the blocks finished so far
    cos: torch.Tensor  # [num_patches, 1, 1, head_dim] fp32
    sin: torch.Tensor
    units: tuple[EncoderUnit, ...]  # the image's units (full_attention_units)
    units_done: int = 0
    partial: PartialBlock | None = None  # a block part-way through its row slices


class Qwen2VisionTransformer(nn.Module):
    """One encoder unit per block; the patch embedding runs in ``start_encode``, the merger in ``finish_encode``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def start_encode(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> Qwen2EncodeState:
        _check_patches(pixel_values, [grid_thw])
        cos, sin = self.rotary_cos_sin([grid_thw], pixel_values.device)
        hidden = self.patch_embed(pixel_values)  # [num_patches, embed_dim]
        units = full_attention_units(self.config, grid_thw)
        return Qwen2EncodeState(hidden, cos, sin, units)

    def run_units(self, state: Qwen2EncodeState, num_units: int) -> None:  # type: ignore[override]
        patches = [state.hidden.shape[0]]
        run_units(state, num_units, self.blocks,
                  lambda b, hidden: self.blocks[b](hidden, state.cos, state.sin, patches))

    def finish_encode(self, state: Qwen2EncodeState) -> ImageEmbeddings:  # type: ignore[override]
        return ImageEmbeddings(self.merger(state.hidden))

    def forward(
        self,
        pixel_values: torch.Tensor,  # [num_patches, C*T*P*P]
        grid_thw: Sequence[tuple[int, int, int]],  # per image (t, h, w) in patches
    ) -> torch.Tensor:
        """[sum over images of t*h*w / merge^2, out_hidden_size] image tokens, images back to back."""
        patches_per_image = _check_patches(pixel_values, grid_thw)
        cos, sin = self.rotary_cos_sin(grid_thw, pixel_values.device)
        x = self.patch_embed(pixel_values)  # [num_patches, embed_dim]
        for block in self.blocks:
            x = block(x, cos, sin, patches_per_image)
        return self.merger(x)

    def rotary_cos_sin(
        self, grid_thw: Sequence[tuple[int, int, int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return vision_rotary_cos_sin(self.config, grid_thw, device)


def vision_rotary_cos_sin(
    config: VisionConfig, grid_thw: Sequence[tuple[int, int, int]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tables [num_patches, 1, 1, head_dim]: the first half of each head's pairs rotates by the patch row,
    the second half by the patch column (Qwen2-VL's and Qwen3-VL's 2D rotary)."""
    pos = vision_position_ids(grid_thw, config.spatial_merge_size, device)  # [num_patches, 2]
    inv_freq = rope_inv_freq(config.head_dim // 2, VISION_ROPE_THETA, device)  # [head_dim // 4]
    freqs = (pos[..., None].float() * inv_freq).flatten(1)  # [num_patches, head_dim // 2] = [h freqs, w freqs]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    return emb.cos(), emb.sin()


def vision_position_ids(
    grid_thw: Sequence[tuple[int, int, int]], merge_size: int, device: torch.device | str = "cpu"
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


def _check_patches(pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> list[int]:
    patches_per_image = [t * h * w for t, h, w in grid_thw]
    if sum(patches_per_image) != pixel_values.shape[0]:
        raise ValueError(
            f"grid_thw covers {sum(patches_per_image)} patches but pixel_values has {pixel_values.shape[0]} rows"
        )
    return patches_per_image


def full_attention_units(vision: VisionConfig, grid_thw: tuple[int, int, int]) -> tuple[EncoderUnit, ...]:
    """Qwen2-VL (and Qwen3-VL): each block attends over the whole image (frame by frame): one unit per block, or
    its query-row slices for a large image (models/vision_units.py)."""
    t, h, w = grid_thw
    num_patches = t * h * w
    unit = EncoderUnit(num_patches, t * (h * w) ** 2, num_patches // vision.spatial_merge_size**2)
    share = qkv_share(vision, mlp_matrices=2)
    return tuple(u for b in range(vision.depth) for u in split_block(unit, b, [h * w] * t, share))
