"""Weights stored in fewer bytes for the CPU (``--quantization``).

``fp16``: every linear layer of the language model (attention q/k/v and output, the MLP, the lm_head) keeps its
weight as float16, packed once at load for FBGEMM's AVX2 kernel, which converts the weights to float32 on the fly
and multiplies in float32; activations stay float32. Half the bytes for the weights a decode step streams. Measured
on a 2-core AVX2 EPYC, a 512 -> 2,816 weight out of cache, against MKL's float32 product: one thread 1 row 0.61x,
8 rows 0.47x, 805 rows 0.91x; two threads 0.34x, 0.31x, 0.91x. Not exact against float32 (each product's relative
error ~2e-4); the vision tower keeps float32.

A weight's float16 copy is rounded (the checkpoint's values beyond float16's range or precision are lost); weights
whose magnitude exceeds float16's range are refused at load.

``int8``: every linear layer of the language model (the lm_head included) and of the vision tower (its blocks and
the merger; the patch embedding stays float32) keeps its weight as int8, one scale per output row (symmetric:
|w| max / 127), stored input-major. Each product quantizes every input row to int8 with that row's own scale
(dynamic, per token), multiplies exactly in int32 and scales back. The few rows of a decode step run firsttoken's
kernel (kernels/cpu_linear.c: a quarter of float32's weight bytes; AVX-512 VNNI where the CPU has it, else AVX2);
prefill and the vision tower run ``torch._int_mm`` where it is exact (CPUs with VNNI or AMX: oneDNN's path without
them saturates 16-bit pair sums), else the same kernel. Integer sums are exact, so a row's outputs are bitwise the
same on every path and whatever shares its step; without the kernels (no compiler, ``--cpu-kernels off``) torch's
ops compute the very same numbers, slower (prefill in float64 where torch._int_mm is not exact). Activations between
products stay float32 (norms, attention, rotary). Not exact against float32: top-1 agreement in
docs/performance.md (on the 2-layer test checkpoint 97-98% of the oracle prompts' positions,
tests/oracle/test_quantization.py).

``bf16`` (what ``auto`` picks for a checkpoint stored in bf16 run with float32 activations: ``auto_quantization`` in
models/loader.py): every linear layer of the language model (the lm_head included) keeps its weight as bfloat16,
row-major; activations, biases, norms and the KV cache stay float32, and every product sums in float32. The few rows
of a decode step run firsttoken's kernel, which reads the bf16 weights (half float32's bytes: what bounds a decode
step on a CPU) and widens each exactly to float32 (AVX2; the fused decode layers take them the same way); a
prefill's product widens the weight into a reused float32 buffer and runs torch's float32 product. For a checkpoint
published in bf16 (Qwen2-VL's are) this is the checkpoint's very weights: the same arithmetic as float32 inference,
sums in another order. A float32 checkpoint's weights are rounded to bf16 (relative error up to 2^-9 per weight).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.kernels.cpu_linear import MAX_ROWS, _kernel, kernel_applies

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.multithreaded:
            out = self._linear(rows, self.packed)
        else:
            out = torch.fbgemm_linear_fp16_weight_fp32_activation(rows, self.packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=float16 (FBGEMM)"


def _replace_linears(model: nn.Module, takes: Callable[[str], bool],
                     make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> int:
    """Replace every ``nn.Linear`` whose name ``takes`` accepts by ``make(weight, bias)``, one at a time (each
    float32 weight is freed once its copy is made); a model whose lm_head is tied to its embeddings gets
    ``make(embeddings, None)`` as its lm_head (the embeddings stay float32 for lookups). Returns how many modules
    were made."""
    names = [name for name, sub in model.named_modules() if isinstance(sub, nn.Linear) and takes(name)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        setattr(parent, child, make(linear.weight, linear.bias))
    if getattr(model, "lm_head", False) is None:  # tied: logits from a copy of the embeddings
        model.lm_head = make(model.embed_tokens.weight, None)
        return len(names) + 1
    return len(names)


def quantize_fp16(model: nn.Module, exclude_prefix: str = "visual.", multithreaded: bool = True) -> int:
    """Replace every ``nn.Linear`` outside ``exclude_prefix`` by an ``Fp16Linear``; a model whose lm_head is tied to
    its embeddings gets a packed float16 lm_head for its logits (the embeddings stay float32 for lookups).
    ``multithreaded``: False when the model will only ever run on one torch thread. Returns the number of linear
    layers replaced."""
    reason = fp16_supported()
    if reason is not None:
        raise ValueError(f"--quantization fp16 is not available: {reason}")
    return _replace_linears(model, lambda name: not name.startswith(exclude_prefix),
                            lambda w, b: Fp16Linear(w, b, multithreaded))


# ---------------------------------------------------------------- bf16 weights, float32 activations


class Bf16WeightLinear(nn.Module):
    """``nn.Linear``'s forward with the weight held as bfloat16 [N, K] row-major (the float32 weight is freed) and
    float32 inputs, bias and outputs. Products of at most ``MAX_ROWS`` rows run firsttoken's kernel (the bf16 weight
    read once, each value widened exactly, float32 sums), larger ones torch's float32 product of the weight widened
    into a reused buffer (the same values; a prefill's product is compute-bound, the widening a few % of it).
    Without the kernels (``use_kernels`` False, or a shape they do not take) every product widens."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, use_kernels: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().to(torch.bfloat16).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self.use_kernels = use_kernels and kernel_applies(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.use_kernels and 0 < rows.shape[0] <= MAX_ROWS:
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            out = _kernel()[0].linear(rows, self.weight, self.bias)
        else:
            out = F.linear(rows, _widened(self.weight), self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=bfloat16"


_scratch = threading.local()  # per thread (an engine runs its steps on one): a float32 buffer products widen into


def _widened(weight: torch.Tensor) -> torch.Tensor:
    """``weight.float()`` in a buffer reused across products (grown to the largest weight seen). A fresh float32
    temporary per product is megabytes, above malloc's mmap threshold: a new mapping whose pages fault in on every
    call (one noisy in-process run had the prefill at 1.28x float32's that way, 0.79-0.94x with the buffer reused;
    docs/performance.md)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < weight.numel():
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode alike
            buf = _scratch.buf = torch.empty(weight.numel(), dtype=torch.float32)
    return buf[: weight.numel()].view(weight.shape).copy_(weight)


def quantize_bf16(model: nn.Module, exclude_prefix: str = "visual.", use_kernels: bool = True) -> int:
    """Replace every ``nn.Linear`` outside ``exclude_prefix`` by a ``Bf16WeightLinear``; a model whose lm_head is
    tied to its embeddings gets a bf16 copy of them as its lm_head (the embeddings stay float32 for lookups).
    Returns the number of linear layers replaced."""
    return _replace_linears(model, lambda name: not name.startswith(exclude_prefix),
                            lambda w, b: Bf16WeightLinear(w, b, use_kernels))


# ---------------------------------------------------------------- int8


def _int8_kernel():
    """The built kernels (kernels/cpu_linear.py), or None where they are unavailable (the torch twins run)."""
    from firsttoken.kernels.cpu_linear import _kernel

    return _kernel()[0]


def int8_blocks(kernel) -> bool:
    """Whether int8 weights (N % 32 == 0) are kept in the kernels' blocks (cpu_linear.int8_pack) here: where every
    product takes their AVX2 loop (no AVX-512 VNNI, torch._int_mm not exact), which otherwise interleaves every
    weight at run time."""
    return kernel is not None and not kernel.int8_vnni and not int_mm_exact()


def quantize_rows(rows: torch.Tensor, kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of a float32 [M, K] (unit column stride) to int8 with its own symmetric scale, max |x| / 127:
    q = x * (1 / scale) rounded half to even. A row holding a NaN or an infinity gets scale NaN and zeros (its
    outputs are NaN, as a float product's would be); a row whose max |x| is under 127 x the smallest normal float
    (all zeros included) gets scale 1 and zeros. ``kernel`` (kernels/cpu_linear.py's) where given, else the same
    arithmetic in torch (bitwise the same)."""
    if kernel is not None:
        return kernel.quant_rows(rows)
    finite = torch.isfinite(rows).all(dim=1)
    scales = rows.abs().amax(dim=1) / 127.0
    scales = torch.where(scales >= torch.finfo(torch.float32).tiny, scales, torch.ones_like(scales))
    scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
    q = torch.round(rows * (1 / scales)[:, None])
    q = torch.where(finite[:, None], q, torch.zeros_like(q))
    return q.to(torch.int8), scales


def dequantize_rows(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                    bias: torch.Tensor | None, kernel=None) -> torch.Tensor:
    """int32 [M, N] products to float32: acc * row_scale[m] * col_scale[n] (+ bias[n]), in that order (``kernel``
    as in ``quantize_rows``)."""
    if kernel is not None:
        return kernel.dequant_rows(acc, row_scale, col_scale, bias)
    out = acc.float().mul_(row_scale[:, None]).mul_(col_scale)
    return out.add_(bias) if bias is not None else out


@functools.lru_cache(maxsize=1)
def int_mm_exact() -> bool:
    """Whether torch._int_mm multiplies int8 matrices exactly here. oneDNN's path on CPUs without VNNI (AVX2, plain
    AVX-512) sums pairs of products in saturating 16 bits and gets full-range inputs wrong; with AVX-512 VNNI,
    AVX-VNNI or AMX it is exact. Checked on full-range products besides the flags."""
    from firsttoken.kernels.cpu_linear import cpu_flags

    flags = cpu_flags() or frozenset()
    if not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        return False
    g = torch.Generator().manual_seed(0)
    cases = [(torch.full((17, 64), 127, dtype=torch.int8), torch.full((64, 16), 127, dtype=torch.int8)),
             (torch.full((17, 64), -127, dtype=torch.int8), torch.full((64, 16), 127, dtype=torch.int8)),
             (torch.randint(-127, 128, (33, 136), generator=g, dtype=torch.int8),
              torch.randint(-127, 128, (136, 40), generator=g, dtype=torch.int8))]
    try:
        return all(torch.equal(torch._int_mm(a, b), (a.long() @ b.long()).int()) for a, b in cases)
    except (RuntimeError, AttributeError):  # a build without it
        return False


def exact_products(q: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """q @ qweight in int32, exactly, by torch alone: torch._int_mm where it is exact, else float64 (every product
    and sum of int8 values stays below 2^53 there)."""
    if int_mm_exact():
        return torch._int_mm(q, qweight)
    return (q.double() @ qweight.double()).to(torch.int32)


class Int8Linear(nn.Module):
    """``nn.Linear``'s forward with the weight held as int8 (one symmetric scale per output row: |w| max / 127),
    stored input-major [K, N] (the float weight is freed). Each input row is quantized to int8 with its own scale
    (``quantize_rows``), multiplied exactly in int32 and scaled back (``dequantize_rows``): through the kernels
    (kernels/cpu_linear.c) for the few rows of a decode step (a quarter of float32's bytes streamed) and, where
    torch._int_mm is not exact, for every product; else through torch._int_mm; without the kernels, torch's ops
    alone. Integer sums are exact, so every path gives the same numbers, and a row's output depends on that row
    alone, not on what shares the product. Inputs float32 of any leading shape."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, use_kernels: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.use_kernels = use_kernels  # False: torch's ops only (--cpu-kernels off)
        w = weight.detach().float()
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: zeros, scale 1
        q = w.div(scale[:, None]).round_().clamp_(-127, 127)  # one float temporary of the layer
        self.qweight = q.to(torch.int8).t().contiguous()
        self.scale = scale.contiguous()
        self.bias = bias.detach().float().contiguous() if bias is not None else None
        self.kernel_shape = self.in_features % 8 == 0 and self.out_features % 8 == 0
        if use_kernels and self.kernel_shape and self.out_features % 32 == 0 and int8_blocks(_int8_kernel()):
            from firsttoken.kernels.cpu_linear import int8_pack

            self.qweight = int8_pack(self.qweight)

    def weight_kn(self) -> torch.Tensor:
        """The int8 weight as [K, N] (input-major), whatever layout it is kept in."""
        if self.qweight.dim() == 3:
            from firsttoken.kernels.cpu_linear import int8_unpack

            return int8_unpack(self.qweight)
        return self.qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        kernel = _int8_kernel() if self.use_kernels else None
        if kernel is not None and (self.qweight.dim() == 3 or (
                self.kernel_shape and (rows.shape[0] <= MAX_ROWS or not int_mm_exact()))):
            out = kernel.int8_linear(rows, self.qweight, self.scale, self.bias)
        else:  # torch alone (also a weight in the kernels' blocks once they are switched off: the same numbers)
            q, row_scale = quantize_rows(rows, kernel)
            out = dequantize_rows(exact_products(q, self.weight_kn()), row_scale, self.scale, self.bias, kernel)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=int8 per row"


def int8_paths(kernels_skipped: str | None) -> str:
    """What computes the int8 products on this machine, for the start-up log (``kernels_skipped``: why the kernels
    are not used, or None)."""
    prefill = "torch._int_mm (exact here)" if int_mm_exact() else None
    if kernels_skipped is not None:
        return (f"torch's ops only, the same numbers slower (firsttoken's kernels not used: {kernels_skipped}); "
                f"prefill {prefill or 'in float64 (torch._int_mm is not exact on this CPU)'}")
    from firsttoken.kernels.cpu_linear import _kernel

    kernel = _kernel()[0]
    loop = ("AVX-512 VNNI" if kernel.int8_vnni else
            "AVX2 (weights in its blocks where N % 32 == 0)" if int8_blocks(kernel) else "AVX2")
    return (f"decode steps by firsttoken's {loop} kernel; prefill by "
            f"{prefill or 'the same kernel (torch._int_mm is not exact on this CPU)'}")


INT8_KEEPS_FLOAT = ("visual.patch_embed.",)  # read as a float weight by the vision towers (its dtype); ~6% of a
# 1024² image's encoder FLOPs


def quantize_int8(model: nn.Module, keep_float: tuple[str, ...] = INT8_KEEPS_FLOAT, use_kernels: bool = True) -> int:
    """Replace every ``nn.Linear`` (language model and vision tower) whose name starts with none of ``keep_float``
    by an ``Int8Linear``; a model whose lm_head is tied to its embeddings gets an int8 lm_head for its logits (the
    embeddings stay float32 for lookups). Returns the number of linear layers replaced."""
    return _replace_linears(model, lambda name: not name.startswith(keep_float),
                            lambda w, b: Int8Linear(w, b, use_kernels))
