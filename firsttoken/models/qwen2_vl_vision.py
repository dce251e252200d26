"""Qwen2-VL vision tower: patches -> ViT blocks with 2D rotary -> 2x2 patch merger -> LM-width image
tokens; and the modules the other families' towers reuse, each with parameters where a family
differs (a bias, the norm, the MLP, the activation, where the merger normalises).

Input rows are patches as the Qwen2-VL image processor emits them: per image, ``t * h * w`` rows
(``h``/``w`` in patches), ordered so every 2x2 merge window is 4 consecutive rows; each row is
``C * T * P * P`` pixels flattened in (channel, frame, y, x) order. Output: ``t * h * w / 4`` rows
per image, images back to back. Attention never crosses images.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.models.layers import apply_rotary, quick_gelu
from firsttoken.models.linear import Linear
from firsttoken.models.model_config import ImageProcessorConfig, VisionConfig
from firsttoken.models.vision_tower import VisionTower
from firsttoken.models.vision_units import qkv_share, split_block
from firsttoken.types import EncoderUnit

VISION_LN_EPS = 1e-6
# Qwen2-VL's preprocessor defaults: 14-px patches, 2x2 merge, CLIP mean/std
IMAGE_PROCESSOR = ImageProcessorConfig()
ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
}


def layer_norm(width: int) -> nn.Module:
    return nn.LayerNorm(width, eps=VISION_LN_EPS)


class PatchEmbed(nn.Module):
    """The reference's Conv3d(kernel = stride = (T, P, P)) is one matmul per patch: a Linear over
    the flattened patch, weight = conv weight reshaped to [embed_dim, C*T*P*P] (the loader does the
    reshape). Qwen2-VL's has no bias, Qwen3-VL's has one."""

    def __init__(self, config: VisionConfig, bias: bool = False) -> None:
        super().__init__()
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.proj = Linear(patch_dim, config.embed_dim, bias=bias)

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
        segments: list[int],
    ) -> torch.Tensor:
        return self.attend(*self.project(x, cos, sin), segments)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [1, num_heads, num_patches, head_dim]: 4-D so CPU SDPA takes its flash kernel."""
        num_patches = x.shape[0]
        qkv = self.qkv(x).view(num_patches, 3, self.num_heads, self.head_dim)
        # rotary in fp32 like the reference, on q and k together
        qk = apply_rotary(qkv[:, :2].float(), cos, sin).to(x.dtype)
        q, k = qk.permute(1, 2, 0, 3).unsqueeze(1).unbind(0)
        return q, k, qkv[:, 2].transpose(0, 1).unsqueeze(0)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        """[query rows, embed_dim]: each segment's queries over its own keys (one segment: every
        query row over every key, also when ``q`` holds a slice of the rows)."""
        if len(segments) == 1:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(qi, ki, vi)
                    for qi, ki, vi in zip(
                        q.split(segments, 2), k.split(segments, 2), v.split(segments, 2)
                    )
                ],
                dim=2,
            )
        return self.proj(out[0].transpose(0, 1).reshape(q.shape[2], -1))


class VisionMLP(nn.Module):
    """fc2(act(fc1(x))), ``act`` named by ``hidden_act`` in the family's ``activations``."""

    def __init__(
        self,
        config: VisionConfig,
        activations: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = ACTIVATIONS,
    ) -> None:
        super().__init__()
        if config.hidden_act not in activations:
            raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} unsupported ({', '.join(activations)})")
        self.fc1 = Linear(config.embed_dim, config.intermediate_size)
        self.fc2 = Linear(config.intermediate_size, config.embed_dim)
        self.act = activations[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)) within each segment, then + mlp(norm2(x)); ``norm`` builds a norm of a
    width (LayerNorm, or Qwen2.5-VL's RMSNorm), ``mlp`` is the family's (default: ``VisionMLP``)."""

    def __init__(self, config: VisionConfig, norm: Callable[[int], nn.Module] = layer_norm,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.norm1 = norm(config.embed_dim)
        self.norm2 = norm(config.embed_dim)
        self.attn = VisionAttention(config)
        self.mlp = mlp if mlp is not None else VisionMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 window's 4 consecutive rows concatenated -> Linear -> GELU -> Linear -> LM hidden
    size, behind a norm (``norm``: LayerNorm, or Qwen2.5-VL's RMSNorm) that runs per patch before
    the concatenation, or over the concatenated row (``postshuffle``: Qwen3-VL's DeepStack
    mergers)."""

    def __init__(self, config: VisionConfig, norm: Callable[[int], nn.Module] = layer_norm,
                 postshuffle: bool = False) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.ln_q = norm(self.merged_dim if postshuffle else config.embed_dim)
        self.mlp = nn.Sequential(
            Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            Linear(self.merged_dim, config.out_hidden_size),
        )

    # [num_patches, embed_dim] -> [num_patches / 4, out]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            return self.mlp(self.ln_q(x.view(-1, self.merged_dim)))
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


def full_attention_units(
    vision: VisionConfig, grid_thw: tuple[int, int, int]
) -> tuple[EncoderUnit, ...]:
    """Qwen2-VL (and Qwen3-VL): each block attends over the whole image (frame by frame): one unit
    per block, or its query-row slices for a large image (models/vision_units.py)."""
    t, h, w = grid_thw
    num_patches = t * h * w
    unit = EncoderUnit(num_patches, t * (h * w) ** 2, num_patches // vision.spatial_merge_size**2)
    share = qkv_share(vision, mlp_matrices=2)
    return tuple(u for b in range(vision.depth) for u in split_block(unit, b, [h * w] * t, share))


class Qwen2VisionTransformer(VisionTower):
    """One encoder unit per block (or its row slices); the patch embedding runs in ``start_encode``,
    the merger in ``finish_encode``."""

    encoder_units = staticmethod(full_attention_units)

    def __init__(self, config: VisionConfig) -> None:
        super().__init__(config)
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config)
