"""Weights stored in fewer bytes for the CPU (``--quantization``).

``fp16``: every linear layer of the language model (attention q/k/v and output, the MLP, the lm_head) keeps its
weight as float16, packed once at load for FBGEMM's AVX2 kernel, which converts the weights to float32 on the fly
and multiplies in float32; activations stay float32. Half the bytes for the weights a decode step streams. Measured
on a 2-core AVX2 EPYC, one thread, a 512 -> 2,816 weight out of cache: one row 141 vs 215 us (MKL, float32), 8 rows
348 vs 772 us, 805 rows 0.97x. Not exact against float32 (each product's relative error ~2e-4); the vision tower
keeps float32.

A weight's float16 copy is rounded (the checkpoint's values beyond float16's range or precision are lost); weights
whose magnitude exceeds float16's range are refused at load.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from firsttoken.config import QUANTIZATIONS  # noqa: F401  (the choices, where the config checks them)

FP16_MAX = 65504.0

# torch 2.13 marks the fbgemm fp16 entry points deprecated (a warning once per process, on first use: fp16_supported
# makes that use, quietly); they are the fast ones: 4 us of overhead per call against 22 us for
# torch.ops.quantized.linear_dynamic_fp16, the same kernel with the same result.


def fp16_supported() -> str | None:
    """None when this torch build and CPU run FBGEMM's fp16 GEMM, else why not."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no FBGEMM (x86 only)"
    if not hasattr(torch, "fbgemm_pack_gemm_matrix_fp16"):
        return "this torch version has no FBGEMM fp16 GEMM"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            packed = torch.fbgemm_pack_gemm_matrix_fp16(torch.ones(8, 8))
            out = torch.fbgemm_linear_fp16_weight_fp32_activation(torch.ones(1, 8), packed, torch.zeros(8))
    except RuntimeError as e:  # e.g. a CPU without AVX2
        return f"FBGEMM cannot run here: {e}"
    if not torch.equal(out, torch.full((1, 8), 8.0)):
        return "FBGEMM's fp16 GEMM gave a wrong result on this CPU"
    return None


class Fp16Linear(nn.Module):
    """``nn.Linear``'s forward with the weight held as packed float16 (no parameters left: the float32 weight is
    freed). Inputs are float32 of any leading shape."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float().contiguous()
        peak = float(w.abs().max()) if w.numel() else 0.0
        if not peak <= FP16_MAX:
            raise ValueError(f"a weight of magnitude {peak:g} does not fit float16 (max {FP16_MAX:g})")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.packed = torch.fbgemm_pack_gemm_matrix_fp16(w)
        self.bias = (bias.detach().float().contiguous() if bias is not None
                     else torch.zeros(self.out_features))  # the kernel takes a bias tensor always

    @classmethod
    def of(cls, linear: nn.Linear) -> Fp16Linear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            raise TypeError(f"--quantization fp16 runs float32 activations, got {rows.dtype}")
        out = torch.fbgemm_linear_fp16_weight_fp32_activation(rows, self.packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=float16 (FBGEMM)"


def quantize_fp16(model: nn.Module, exclude_prefix: str = "visual.") -> int:
    """Replace every ``nn.Linear`` outside ``exclude_prefix`` by an ``Fp16Linear``; a model whose lm_head is tied to
    its embeddings gets a packed float16 lm_head for its logits (the embeddings stay float32 for lookups). Returns
    the number of linear layers replaced."""
    reason = fp16_supported()
    if reason is not None:
        raise ValueError(f"--quantization fp16 is not available: {reason}")
    targets = [(name, sub) for name, sub in model.named_modules()
               if isinstance(sub, nn.Linear) and not name.startswith(exclude_prefix)]
    for name, sub in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp16Linear.of(sub))
    if getattr(model, "lm_head", False) is None:  # tied: logits from a packed copy of the embeddings
        model.lm_head = Fp16Linear(model.embed_tokens.weight, None)
        return len(targets) + 1
    return len(targets)
