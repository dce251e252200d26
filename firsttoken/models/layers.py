"""Building blocks shared by the Qwen2-VL language model and vision tower.

Numerics follow the transformers reference on purpose (RMSNorm in fp32 then cast back, rotary
cos/sin cast to the activation dtype in the LM and kept in fp32 in the vision tower), so fp32 runs
agree to ~1e-6.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.models.linear import Linear

# Below this many elements an RMSNorm input is a decode step's few rows: the op count, not memory,
# sets its time.
SMALL_NORM_ELEMENTS = 16 * 4096


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x32 * rsqrt(mean(x32^2) + eps), cast back, times weight: the reference's order. torch's
        # rms_norm is that composite in C++ (bitwise equal on fp32 rows of 64-3584; one call instead
        # of five)
        # bf16 / fp16: normalized in fp32, cast back, then times the weight
        if x.dtype != torch.float32:
            if x.numel() <= SMALL_NORM_ELEMENTS:
                return self.weight * _rms_norm_few_rows(x.float(), None, self.eps).to(x.dtype)
            return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(
                x.dtype
            )
        if x.numel() <= SMALL_NORM_ELEMENTS:
            return _rms_norm_few_rows(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def _rms_norm_few_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, weight.shape, weight, eps)`` bit for bit on fp32 (the same ops: sum of
    squares, divided by the row length, plus eps, rsqrt, times x, times weight) in 7 aten calls
    instead of rms_norm's ~24 (nested ones counted): the row length and eps come as cached 0-dim
    tensors, where rms_norm wraps each Python number in a new tensor every call. Faster for a decode
    step's few rows, no faster for a prefill's (F.rms_norm there; why:
    docs/runs/notes/decode-kernels.md#second-pass-where-the-batch-1-steps-time-is-now-and-what-was-cut).
    ``weight`` None: the unweighted norm (a bf16 model's, weighted after the cast back, as the
    reference does)."""
    inv = (
        torch.sum(x * x, -1, keepdim=True)
        .div_(_scalar(x.shape[-1], x.device))
        .add_(_scalar(eps, x.device))
    )
    out = x * inv.rsqrt_()
    return out if weight is None else out.mul_(weight)


@functools.lru_cache(maxsize=64)
def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A 0-dim float32 tensor holding ``value``; shared and never written (made outside inference
    mode, so callers in and out of it may share it)."""
    with torch.inference_mode(False):
        return torch.tensor(float(value), dtype=torch.float32, device=device)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are one stacked matmul (``gate_up_proj`` = [gate;
    up]). The language models' projections carry no bias; Qwen2.5-VL's vision blocks' do
    (``bias=True``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [..., gate; up], intermediate_size each
        # two slices, not chunk (split, narrows: 7 tensor ops); silu's fresh output takes the
        # product in place
        gate, up = gate_up[..., : self.intermediate_size], gate_up[..., self.intermediate_size :]
        return self.down_proj(F.silu(gate).mul_(up))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (the "half-split" rotary layout Qwen uses)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, ..., head_dim]; cos/sin broadcast against it (e.g. [num_tokens, 1,
    head_dim])."""
    return x * cos + rotate_half(x) * sin


def rolled_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, for ``apply_rotary_rolled``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary_rolled(
    x: torch.Tensor, cos: torch.Tensor, sin_rolled: torch.Tensor
) -> torch.Tensor:
    """``apply_rotary(x, cos, sin)`` bit for bit, given ``sin_rolled = rolled_sin(sin)`` (made once
    per forward): rotate_half(x) * sin is roll(x, half) * sin with the first half's sign flipped,
    and a sign flip is exact. Four tensor ops instead of seven per call."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_rolled


def rope_inv_freq(dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[dim // 2] inverse frequencies 1 / theta^(2i / dim), computed exactly as the reference
    does."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))


@functools.lru_cache(maxsize=16)
def _cached_inv_freq(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """``rope_inv_freq`` made once per (dim, theta, device): the language model asks every step.
    Never written; made outside inference mode, so callers in and out of it may share it."""
    with torch.inference_mode(False):
        return rope_inv_freq(dim, theta, device)


def mrope_cos_sin(
    positions: torch.Tensor,  # [3, num_tokens] int64 (t, h, w)
    head_dim: int,
    theta: float,
    mrope_section: Sequence[int],
    dtype: torch.dtype,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary tables, each [num_tokens, head_dim].

    Qwen2-VL / Qwen2.5-VL: the head_dim/2 frequency pairs are split into ``mrope_section`` = (t, h,
    w) runs; run r rotates by the position on axis r. Qwen3-VL (``interleaved``): pair i rotates by
    the height position when i % 3 == 1 and i < 3 * h, by the width position when i % 3 == 2 and i <
    3 * w, else by the time position. The same half-table is repeated for the second half
    (rotate_half layout). ``positions`` with stride 0 on its first dim (one row expanded, as the
    runner passes decode tokens) is read as the same position on every axis.
    """
    inv_freq = _cached_inv_freq(head_dim, theta, positions.device)
    # one row seen as three (decode: t = h = w): every pair picks the same angle
    if positions.stride(0) == 0:
        freqs = positions[0, :, None].float() * inv_freq  # [num_tokens, head_dim // 2]
    elif interleaved:
        freqs = positions[..., None].float() * inv_freq  # [3, num_tokens, head_dim // 2]
        picked = freqs[0].clone()
        for axis in (1, 2):
            span = slice(axis, mrope_section[axis] * 3, 3)
            picked[..., span] = freqs[axis, ..., span]
        freqs = picked  # [num_tokens, head_dim // 2]
    else:
        freqs = positions[..., None].float() * inv_freq  # [3, num_tokens, head_dim // 2]
        chunks = freqs.split(list(mrope_section), dim=-1)
        # [num_tokens, head_dim // 2]
        freqs = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
