"""Weights stored in fewer bytes for the CPU (``--quantization``).

``fp16``: every linear layer of the language model (attention q/k/v and output, the MLP, the lm_head) keeps its
weight as float16, packed once at load for FBGEMM's AVX2 kernel, which converts the weights to float32 on the fly
and multiplies in float32; activations stay float32. Half the bytes for the weights a decode step streams. Measured
on a 2-core AVX2 EPYC, a 512 -> 2,816 weight out of cache, against MKL's float32 product: one thread 1 row 0.61x,
8 rows 0.47x, 805 rows 0.91x; two threads 0.34x, 0.31x, 0.91x. Not exact against float32 (each product's relative
error ~2e-4); the vision tower keeps float32.

A weight's float16 copy is rounded (the checkpoint's values beyond float16's range or precision are lost); weights
whose magnitude exceeds float16's range are refused at load.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

FP16_MAX = 65504.0

# Two entry points to the same FBGEMM kernel (same results), measured on a 2-core AVX2 EPYC, 512 -> 2,816, weights
# out of cache: torch.ops.quantized.linear_dynamic_fp16 splits the product over torch's threads (2 threads: 1 row
# 106 us, 8 rows 232 us, 805 rows 0.91x MKL's float32) at ~21 us per call; torch.fbgemm_linear_fp16_weight_fp32_
# activation costs 4 us per call but runs on one thread (2 threads, 805 rows: 1.7x MKL's time). The engine takes the
# second only when it runs on one thread (and where torch still has it: 2.13 marks it deprecated, with a warning once
# per process on first use, which fp16_supported makes quietly).


def _linear_dynamic_fp16():
    """The multithreaded entry point, resolved when first used (a torch build without FBGEMM lacks it)."""
    return torch.ops.quantized.linear_dynamic_fp16.default


def _single_thread_entry_point() -> bool:
    return all(hasattr(torch, f) for f in ("fbgemm_pack_gemm_matrix_fp16", "fbgemm_linear_fp16_weight_fp32_activation"))


def fp16_supported() -> str | None:
    """None when this torch build and CPU run FBGEMM's fp16 GEMM (the multithreaded entry point, and the
    single-threaded one where torch still has it), else why not."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no FBGEMM (x86 only)"
    try:
        w, x = torch.ones(8, 8), torch.ones(1, 8)
        results = [_linear_dynamic_fp16()(x, torch.ops.quantized.linear_prepack_fp16(w, None))]
        if _single_thread_entry_point():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                packed = torch.fbgemm_pack_gemm_matrix_fp16(w)
                results.append(torch.fbgemm_linear_fp16_weight_fp32_activation(x, packed, torch.zeros(8)))
    except (RuntimeError, AttributeError) as e:  # e.g. a CPU without AVX2, a build without the ops
        return f"FBGEMM's fp16 GEMM cannot run here: {e}"
    if not all(torch.equal(r, torch.full((1, 8), 8.0)) for r in results):
        return "FBGEMM's fp16 GEMM gave a wrong result on this CPU"
    return None


class Fp16Linear(nn.Module):
    """``nn.Linear``'s forward with the weight held as packed float16 (no parameters left: the float32 weight is
    freed). Inputs are float32 of any leading shape (load_model refuses fp16 weights beside another dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, multithreaded: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float().contiguous()
        peak = float(w.abs().max()) if w.numel() else 0.0
        if not peak <= FP16_MAX:
            raise ValueError(f"a weight of magnitude {peak:g} does not fit float16 (max {FP16_MAX:g})")
        b = bias.detach().float().contiguous() if bias is not None else None
        self.multithreaded = multithreaded or not _single_thread_entry_point()
        if self.multithreaded:  # splits the product over torch's threads; ~17 us more per call than the other one
            self.packed = torch.ops.quantized.linear_prepack_fp16(w, b)
            self.bias = None
            self._linear = _linear_dynamic_fp16()
        else:  # one thread only (2 threads: 1.7x MKL's time at prefill sizes), 4 us per call
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.packed = torch.fbgemm_pack_gemm_matrix_fp16(w)
            self.bias = b if b is not None else torch.zeros(self.out_features)  # it takes a bias always

    @classmethod
    def of(cls, linear: nn.Linear, multithreaded: bool = True) -> Fp16Linear:
        return cls(linear.weight, linear.bias, multithreaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.multithreaded:
            out = self._linear(rows, self.packed)
        else:
            out = torch.fbgemm_linear_fp16_weight_fp32_activation(rows, self.packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=float16 (FBGEMM)"


def quantize_fp16(model: nn.Module, exclude_prefix: str = "visual.", multithreaded: bool = True) -> int:
    """Replace every ``nn.Linear`` outside ``exclude_prefix`` by an ``Fp16Linear``; a model whose lm_head is tied to
    its embeddings gets a packed float16 lm_head for its logits (the embeddings stay float32 for lookups).
    ``multithreaded``: False when the model will only ever run on one torch thread. Returns the number of linear
    layers replaced."""
    reason = fp16_supported()
    if reason is not None:
        raise ValueError(f"--quantization fp16 is not available: {reason}")
    names = [name for name, sub in model.named_modules()
             if isinstance(sub, nn.Linear) and not name.startswith(exclude_prefix)]
    for name in names:  # one at a time: each float32 weight is freed once its float16 copy is packed
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp16Linear.of(getattr(parent, child), multithreaded))
    if getattr(model, "lm_head", False) is None:  # tied: logits from a packed copy of the embeddings
        model.lm_head = Fp16Linear(model.embed_tokens.weight, None, multithreaded)
        return len(names) + 1
    return len(names)
