"""Weights stored in fewer bytes for the CPU (``--quantization``): each a linear layer's method
(models/linear.py), which layers take which is the plan's (loading/methods.py).

``fp16``: every linear layer of the language model (attention q/k/v and output, the MLP, the
lm_head) keeps its weight as float16, packed once at load for FBGEMM's AVX2 kernel, which converts
the weights to float32 on the fly and multiplies in float32; activations stay float32. Half the
bytes for the weights a decode step streams: less time than MKL's float32 product at decode and
prefill sizes (why: docs/runs/notes/weights-fp16-int8-bf16.md#float16-weights). Not exact against
float32 (each product's relative error ~2e-4); the vision tower keeps float32.

A weight's float16 copy is rounded (the checkpoint's values beyond float16's range or precision are
lost); weights whose magnitude exceeds float16's range are refused at load.

``int8``: every linear layer of the language model (the lm_head included) and of the vision tower
(its blocks and the merger; the patch embedding stays float32) keeps its weight as int8, one scale
per output row (symmetric: |w| max / 127), stored input-major. Each product quantizes every input
row to int8 with that row's own scale (dynamic, per token), multiplies exactly in int32 and scales
back. The few rows of a decode step run firsttoken's kernel (kernels/cpu_linear.c: a quarter of
float32's weight bytes; AVX-512 VNNI where the CPU has it, else AVX2); prefill and the vision tower
run ``torch._int_mm`` where it is exact (CPUs with VNNI or AMX: oneDNN's path without them saturates
16-bit pair sums), else the same kernel. Integer sums are exact, so a row's outputs are bitwise the
same on every path and whatever shares its step; without the kernels (no compiler,
``--cpu-kernels off``) torch's ops compute the very same numbers, slower (prefill in float64 where
torch._int_mm is not exact). Activations between products stay float32 (norms, attention, rotary).
Not exact against float32: top-1 agreement in docs/performance.md (on the 2-layer test checkpoint
97-98% of the oracle prompts' positions, tests/oracle/test_quantization.py).

``bf16`` (what ``auto`` picks for a checkpoint stored in bf16 run with float32 activations:
``auto_quantization`` in loading/load_plan.py): every linear layer of the language model (the lm_head
included) keeps its weight as bfloat16, row-major; activations, biases, norms and the KV cache stay
float32, and every product sums in float32. The few rows of a decode step run firsttoken's kernel,
which reads the bf16 weights (half float32's bytes: what bounds a decode step on a CPU) and widens
each exactly to float32 (AVX2; the fused decode layers take them the same way); a prefill's product
widens the weight into a reused float32 buffer and runs torch's float32 product. For a checkpoint
published in bf16 (Qwen2-VL's are) this is the checkpoint's very weights: the same arithmetic as
float32 inference, sums in another order. A float32 checkpoint's weights are rounded to bf16
(relative error up to 2^-9 per weight).
"""

from __future__ import annotations

import functools
import threading
import warnings

import torch
import torch.nn.functional as F

from firsttoken.kernels.cpu_features import CpuFeatures
from firsttoken.kernels.cpu_linear import MAX_ROWS, int8_pack, int8_unpack, kernel_takes
from firsttoken.models.linear import Linear

FP16_MAX = 65504.0

# Two entry points to the same FBGEMM kernel (same results): torch.ops.quantized.linear_dynamic_fp16
# splits the product over torch's threads, at a higher cost per call;
# torch.fbgemm_linear_fp16_weight_fp32_activation costs less per call but runs on one thread (on
# more, prefill would pay). The engine takes the second only when it runs on one thread (why:
# docs/runs/notes/weights-fp16-int8-bf16.md#float16-weights), and where torch still has it: 2.13
# marks it deprecated, with a warning once per process on first use, which fp16_supported makes
# quietly.


def _linear_dynamic_fp16():
    """The multithreaded entry point, resolved when first used (a torch build without FBGEMM lacks
    it)."""
    return torch.ops.quantized.linear_dynamic_fp16.default


def single_thread_entry_point() -> bool:
    """Whether this torch still has FBGEMM's one-thread fp16 entry point."""
    return all(
        hasattr(torch, f)
        for f in ("fbgemm_pack_gemm_matrix_fp16", "fbgemm_linear_fp16_weight_fp32_activation")
    )


@functools.lru_cache(maxsize=1)
def fp16_supported() -> str | None:
    """None when this torch build and CPU run FBGEMM's fp16 GEMM (the multithreaded entry point, and
    the single-threaded one where torch still has it), else why not (probed once per process)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no FBGEMM (x86 only)"
    try:
        w, x = torch.ones(8, 8), torch.ones(1, 8)
        results = [_linear_dynamic_fp16()(x, torch.ops.quantized.linear_prepack_fp16(w, None))]
        if single_thread_entry_point():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                packed = torch.fbgemm_pack_gemm_matrix_fp16(w)
                results.append(
                    torch.fbgemm_linear_fp16_weight_fp32_activation(x, packed, torch.zeros(8))
                )
    except (RuntimeError, AttributeError) as e:  # e.g. a CPU without AVX2, a build without the ops
        return f"FBGEMM's fp16 GEMM cannot run here: {e}"
    if not all(torch.equal(r, torch.full((1, 8), 8.0)) for r in results):
        return "FBGEMM's fp16 GEMM gave a wrong result on this CPU"
    return None


class Fp16Weights:
    """``--quantization fp16``'s method: the layer's weight held as packed float16 (no parameters
    left: the float32 weight is dropped), float32 inputs of any leading shape (the plan refuses fp16
    weights beside another dtype). ``multithreaded``: False when the model only ever runs on one
    torch thread (the single-threaded entry point, cheaper per call, where this torch still has
    it)."""

    def __init__(self, multithreaded: bool = True) -> None:
        # the plan's, or forced
        self.multithreaded = multithreaded or not single_thread_entry_point()
        self.name = "fp16 weights (FBGEMM" + (")" if self.multithreaded else ", one thread)")

    def process_weights(self, layer: Linear) -> None:
        w = layer.weight.detach().float().contiguous()
        peak = float(w.abs().max()) if w.numel() else 0.0
        if not peak <= FP16_MAX:
            raise ValueError(
                f"a weight of magnitude {peak:g} does not fit float16 (max {FP16_MAX:g})"
            )
        b = layer.bias.detach().float().contiguous() if layer.bias is not None else None
        layer.register_parameter("weight", None)
        layer.register_parameter("bias", None)
        # splits the product over torch's threads; costs more per call than the other one
        if self.multithreaded:
            layer.packed = torch.ops.quantized.linear_prepack_fp16(w, b)
        else:  # one thread only, the cheaper call: for an engine that runs on one thread
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                layer.packed = torch.fbgemm_pack_gemm_matrix_fp16(w)
            # it takes a bias always
            layer.packed_bias = b if b is not None else torch.zeros(layer.out_features)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features)
        if self.multithreaded:
            out = _linear_dynamic_fp16()(rows, layer.packed)
        else:
            out = torch.fbgemm_linear_fp16_weight_fp32_activation(
                rows, layer.packed, layer.packed_bias
            )
        return out.view(*x.shape[:-1], layer.out_features)


# ---------------------------------------------------------------- bf16 weights, float32 activations


class Bf16Weights:
    """``--quantization bf16``'s method: the layer's weight held as bfloat16 [N, K] row-major (the
    float32 weight is dropped), float32 inputs, bias and outputs. Products of at most ``MAX_ROWS``
    rows run firsttoken's kernel (the bf16 weight read once, each value widened exactly, float32
    sums), larger ones torch's float32 product of the weight widened into a reused buffer (the same
    values; a prefill's product is compute-bound, the widening a few % of it). Without the kernels
    (``kernels`` None: unavailable or --cpu-kernels off), or for a shape they do not take, every
    product widens."""

    def __init__(self, kernels=None) -> None:
        """``kernels``: the built library, or None."""
        self.kernels = kernels
        self.name = "bf16 weights" + (
            ", few-rows kernels" if kernels is not None else ", widened for torch"
        )

    def takes(self, in_features: int, out_features: int) -> bool:
        """Whether the kernels take this layer's decode products."""
        return self.kernels is not None and kernel_takes(
            out_features, in_features, torch.bfloat16, False
        )

    def process_weights(self, layer: Linear) -> None:
        weight, bias = layer.weight, layer.bias
        layer.weight = _frozen(weight.detach().to(torch.bfloat16).contiguous())
        layer.bias = None if bias is None else _frozen(bias.detach().float().contiguous())
        # 0: widened
        layer.kernel_rows = MAX_ROWS if self.takes(layer.in_features, layer.out_features) else 0

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features)
        if 0 < rows.shape[0] <= layer.kernel_rows:
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            out = self.kernels.linear(rows, layer.weight, layer.bias)
        else:
            out = F.linear(rows, _widened(layer.weight), layer.bias)
        return out.view(*x.shape[:-1], layer.out_features)

    # ---- what the fused decode layers read (loading/fused_decode.py)
    def fuses(self, in_features: int, out_features: int, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 and self.takes(in_features, out_features)

    def fused_weight(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        return layer.weight, None

    def fused_bias(self, layer: Linear) -> torch.Tensor | None:
        return layer.bias


def _frozen(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


# per thread (an engine runs its steps on one): a float32 buffer products widen into
_scratch = threading.local()


def _widened(weight: torch.Tensor) -> torch.Tensor:
    """``weight.float()`` in a buffer reused across products (grown to the largest weight seen). A
    fresh float32 temporary per product is megabytes, above malloc's mmap threshold: a new mapping
    whose pages fault in on every call, which made prefill slower than float32's (why:
    docs/runs/notes/weights-fp16-int8-bf16.md#bf16-weights-float32-activations)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < weight.numel():
        # a normal tensor: written in and out of inference mode alike
        with torch.inference_mode(False):
            buf = _scratch.buf = torch.empty(weight.numel(), dtype=torch.float32)
    return buf[: weight.numel()].view(weight.shape).copy_(weight)


# ---------------------------------------------------------------- int8


def int8_blocks(kernels, int_mm_exact: bool) -> bool:
    """Whether int8 weights (N % 32 == 0) are kept in the kernels' blocks (cpu_linear.int8_pack)
    here: where every product takes their AVX2 loop (no AVX-512 VNNI, torch._int_mm not exact),
    which otherwise interleaves every weight at run time."""
    return kernels is not None and not kernels.int8_vnni and not int_mm_exact


def quantize_rows(rows: torch.Tensor, kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of a float32 [M, K] (unit column stride) to int8 with its own symmetric scale, max
    |x| / 127: q = x * (1 / scale) rounded half to even. A row holding a NaN or an infinity gets
    scale NaN and zeros (its outputs are NaN, as a float product's would be); a row whose max |x| is
    under 127 x the smallest normal float (all zeros included) gets scale 1 and zeros. ``kernel``
    (kernels/cpu_linear.py's) where given, else the same arithmetic in torch (bitwise the same)."""
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
    """int32 [M, N] products to float32: acc * row_scale[m] * col_scale[n] (+ bias[n]), in that
    order (``kernel`` as in ``quantize_rows``)."""
    if kernel is not None:
        return kernel.dequant_rows(acc, row_scale, col_scale, bias)
    out = acc.float().mul_(row_scale[:, None]).mul_(col_scale)
    return out.add_(bias) if bias is not None else out


@functools.lru_cache(maxsize=4)
def int_mm_exact(cpu: CpuFeatures) -> bool:
    """Whether torch._int_mm multiplies int8 matrices exactly on this CPU (probed once per process).
    oneDNN's path on CPUs without VNNI (AVX2, plain AVX-512) sums pairs of products in saturating 16
    bits and gets full-range inputs wrong; with AVX-512 VNNI, AVX-VNNI or AMX it is exact. Checked
    on full-range products besides the flags."""
    if not cpu.int8_dot_products:
        return False
    g = torch.Generator().manual_seed(0)
    cases = [
        (torch.full((17, 64), 127, dtype=torch.int8), torch.full((64, 16), 127, dtype=torch.int8)),
        (torch.full((17, 64), -127, dtype=torch.int8), torch.full((64, 16), 127, dtype=torch.int8)),
        (
            torch.randint(-127, 128, (33, 136), generator=g, dtype=torch.int8),
            torch.randint(-127, 128, (136, 40), generator=g, dtype=torch.int8),
        ),
    ]
    try:
        return all(torch.equal(torch._int_mm(a, b), (a.long() @ b.long()).int()) for a, b in cases)
    except (RuntimeError, AttributeError):  # a build without it
        return False


def exact_products(q: torch.Tensor, qweight: torch.Tensor, int_mm_exact: bool) -> torch.Tensor:
    """q @ qweight in int32, exactly, by torch alone: torch._int_mm where it is exact
    (``int_mm_exact``), else float64 (every product and sum of int8 values stays below 2^53
    there)."""
    if int_mm_exact:
        return torch._int_mm(q, qweight)
    return (q.double() @ qweight.double()).to(torch.int32)


class Int8Weights:
    """``--quantization int8``'s method: the layer's weight held as int8 (one symmetric scale per
    output row: |w| max / 127), stored input-major [K, N] (the float weight is dropped;
    ``layer.qweight``, ``layer.scale``). Each input row is quantized to int8 with its own scale
    (``quantize_rows``), multiplied exactly in int32 and scaled back (``dequantize_rows``): through
    the kernels (kernels/cpu_linear.c) for the few rows of a decode step (a quarter of float32's
    bytes streamed) and, where torch._int_mm is not exact, for every product; else through
    torch._int_mm; without the kernels (``kernels`` None), torch's ops alone. Integer sums are
    exact, so every path gives the same numbers, and a row's output depends on that row alone, not
    on what shares the product. Inputs float32 of any leading shape."""

    def __init__(self, kernels=None, int_mm_exact: bool = False) -> None:
        """``kernels``: the built library, or None (torch's ops only: --cpu-kernels off);
        ``int_mm_exact``: the machine's (``int_mm_exact(cpu)``)."""
        self.kernels = kernels
        self.int_mm_exact = int_mm_exact
        self.name = "int8 weights" + (
            ", firsttoken's kernels" if kernels is not None else ", torch's ops"
        )

    def process_weights(self, layer: Linear) -> None:
        w = layer.weight.detach().float()
        bias = layer.bias
        layer.register_parameter("weight", None)
        scale = w.abs().amax(dim=1) / 127.0
        # an all-zero row: zeros, scale 1
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = w.div(scale[:, None]).round_().clamp_(-127, 127)  # one float temporary of the layer
        del w
        layer.qweight = q.to(torch.int8).t().contiguous()
        layer.scale = scale.contiguous()
        layer.bias = None if bias is None else _frozen(bias.detach().float().contiguous())
        layer.kernel_shape = layer.in_features % 8 == 0 and layer.out_features % 8 == 0
        if self.kernels is not None and layer.kernel_shape and layer.out_features % 32 == 0 \
                and int8_blocks(self.kernels, self.int_mm_exact):
            layer.qweight = int8_pack(layer.qweight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        kernel = self.kernels
        qweight = layer.qweight
        if kernel is not None and (qweight.dim() == 3 or (
                layer.kernel_shape and (rows.shape[0] <= MAX_ROWS or not self.int_mm_exact))):
            out = kernel.int8_linear(rows, qweight, layer.scale, layer.bias)
        # torch alone (also a weight in the kernels' blocks once they are switched off: the same
        # numbers)
        else:
            q, row_scale = quantize_rows(rows, kernel)
            out = dequantize_rows(
                exact_products(q, weight_kn(layer), self.int_mm_exact),
                row_scale,
                layer.scale,
                layer.bias,
                kernel,
            )
        return out.view(*x.shape[:-1], layer.out_features)

    # ---- what the fused decode layers read (loading/fused_decode.py)
    def fuses(self, in_features: int, out_features: int, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 and self.kernels is not None and in_features % 8 == 0 \
            and out_features % 8 == 0

    def fused_weight(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        return layer.qweight, layer.scale

    def fused_bias(self, layer: Linear) -> torch.Tensor | None:
        return layer.bias


def weight_kn(layer: Linear) -> torch.Tensor:
    """An int8 layer's weight as [K, N] (input-major), whatever layout it is kept in."""
    return int8_unpack(layer.qweight) if layer.qweight.dim() == 3 else layer.qweight


def int8_paths(kernels, int_mm_exact: bool, kernels_unused: str | None = None) -> str:
    """What computes the int8 products on this machine, for the start-up block (``kernels`` None:
    firsttoken's kernels are not used, ``kernels_unused`` says why)."""
    prefill = "torch._int_mm (exact here)" if int_mm_exact else None
    if kernels is None:
        return (f"torch's ops only, the same numbers slower (firsttoken's kernels not used: {kernels_unused}); "
                f"prefill {prefill or 'in float64 (torch._int_mm is not exact on this CPU)'}")
    loop = (
        "AVX-512 VNNI"
        if kernels.int8_vnni
        else "AVX2 (weights in its blocks where N % 32 == 0)"
        if int8_blocks(kernels, int_mm_exact)
        else "AVX2"
    )
    return (f"decode steps by firsttoken's {loop} kernel; prefill by "
            f"{prefill or 'the same kernel (torch._int_mm is not exact on this CPU)'}")


# read as a float weight by the vision towers (its dtype); ~6% of a 1024² image's encoder FLOPs
INT8_KEEPS_FLOAT = ("visual.patch_embed.",)
