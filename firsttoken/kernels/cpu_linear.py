"""The few-rows float32 products of decode steps on x86 CPUs (``cpu_linear.c``), built on first use.

A decode step multiplies a handful of rows (one per running request) by every weight of the language
model. MKL's sgemm has no good path for 2-16 rows on an AVX2 CPU: its time grows almost linearly
with the rows. The kernels read each weight once, in one sequential sweep, and let every row use it
while it is in cache: on AVX2 CPUs no slower than MKL up to ``MAX_ROWS`` rows (why:
docs/performance.md#few-rows-kernels). Products of at most ``MAX_ROWS`` rows take the kernels;
prefill stays with MKL.

bfloat16 weights (``--dtype bfloat16``, ``auto``'s choice on CPUs with native bf16) keep the
checkpoint's row-major layout; their kernel reads them as bf16 (half float32's bytes), widens each
exactly to float32 and sums as the float32 one; the outputs are rounded to bf16 as torch's bf16
product rounds its float32 sums. ``MAX_ROWS_BF16`` is the most rows at which a whole bf16 decode
step takes less time with this loop than with torch's bf16 products (why:
docs/runs/notes/weights-fp16-int8-bf16.md). On CPUs with AVX512-BF16 the same products take
dot-product instructions instead (vdpbf16ps: 32 bf16 products an instruction, no widening; each
weight row still read once in one stream, up to 16 rows of x against it), faster than the AVX2 loop
from a few rows up (one row is memory-bound either way), so there bf16 products of up to
``MAX_ROWS_BF16_DP`` rows take the kernels (``_Kernel.max_rows_bf16``; why:
docs/runs/notes/decode-kernels.md#bf16-products-as-avx512-bf16-dot-products). Those instructions
read the rows as bf16 too, so only a bf16 model's rows (bf16 values) take them: float32 activations
beside bf16 weights (``--quantization bf16``) always take the widening loop, float32 arithmetic on
every CPU.

The weights keep the layouts their layers' methods give them (models/linear.py: widening layers
input-major or row-major, the narrowing down projection row-major); each layout has its kernel.
Every output is summed in the same order whatever the number of rows and threads, so a request's
decode products are bitwise the same whichever requests share its step.

The same library holds ``--quantization int8``'s arithmetic (loading/quant.py): each input row
quantized to int8 with its own scale, the few rows of a decode step multiplied exactly in int32
against int8 weights (AVX-512 VNNI where the CPU has it, else AVX2), and the int32 products scaled
back; each bitwise the same as its torch twin.

The library also holds ``ft_decode_layers``: a decode step's decoder layers in one call around these
products (loading/fused_decode.py).

Built with the machine's C compiler (``$CC``, else ``cc``/``gcc``: Debian's ``gcc`` package) into
``$FIRSTTOKEN_CACHE/kernels`` (default ``~/.cache/firsttoken/kernels``), once per source and flags,
about a second; loaded with ctypes (the call releases the GIL). Where the CPU lacks AVX2/FMA, no
compiler is found, the build fails or the built kernels disagree with torch on check products,
``kernel_unavailable()`` says why and the engine keeps torch's product (``--cpu-kernels off`` asks
for that). Which layers take them is the model's plan (loading/load_plan.py: for float32, ``auto`` also
leaves Intel's AVX-512 CPUs to MKL); the layers' methods that call them are
loading/kernel_linear.py's, loading/quant.py's and loading/fused_decode.py's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from firsttoken.kernels.cpu_features import CpuFeatures

log = logging.getLogger("firsttoken.kernels")

# the most rows a float32 product takes the kernels for: still faster than MKL (why: module
# docstring)
MAX_ROWS = 16
# the same for bf16 products on the AVX2 loop: beyond it torch's bf16 products win
MAX_ROWS_BF16 = 4
# the sampler's top-k through ft_topk up to this k: its insertions cost ~k ln(n/k) x k/2 moves, so
# beyond a few hundred torch's topk is faster (why: docs/runs/notes/sampler.md)
TOPK_MAX = 256
MAX_ROWS_BF16_DP = 16  # the AVX512-BF16 dot-product loop (ft_bf16_dp): see _Kernel.max_rows_bf16
SOURCE = Path(__file__).with_name("cpu_linear.c")
# no fused multiply-adds beyond the ones written: the int8 kernels are bitwise twins of torch ops
CFLAGS = (
    "-O3",
    "-mavx2",
    "-mfma",
    "-ffp-contract=off",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=gnu11",
)
_plan = threading.local()  # this thread's kernel threads (set_kernel_threads)


def set_kernel_threads(n: int | None) -> int | None:
    """How the running thread's calls into the float32/bf16 products and the fused decode layers
    split their work. n: on n threads of their own (ft_parallel in cpu_linear.c: the caller plus
    workers that are optional, so one the OS pre-empts never stalls a call); for steps whose work is
    all these kernels' (decode steps the fused layers take), where torch's ops run on one thread.
    None (the default): on torch's OpenMP team at torch's count, the team its own ops use, for steps
    where those run on several threads (workers of another pool spinning beside that team would take
    its cores and slow those steps: docs/runs/notes/decode-kernels.md#the-kernels-own-threads).
    Returns the setting it replaces."""
    previous = getattr(_plan, "n", None)
    _plan.n = n
    return previous


def kernel_pool_threads() -> int | None:
    """The running thread's setting (``set_kernel_threads``)."""
    return getattr(_plan, "n", None)


def kernel_threads() -> int:
    """The kernels' ``threads`` argument: -n for n threads of their own, else torch's count
    (OpenMP)."""
    n = kernel_pool_threads()
    return -n if n else torch.get_num_threads()


POOL_SPIN_S = {"decode": 2e-3, "other": 1e-4}
_spin = ["other"]


def set_kernel_spin(mode: str) -> None:
    """How long the kernels' idle workers spin before sleeping: "decode" (2 ms: a decode step's next
    regions begin within a few milliseconds of Python, and a worker asleep by then joins late, after
    a costly wake-up (why: docs/runs/notes/decode-kernels.md#the-kernels-own-threads); spinning one
    costs nothing it would not yield, since a pre-empted worker never stalls a region) or "other"
    (0.1 ms: prefill and vision steps run torch's OpenMP team on every core). Applied once the
    kernels are built (never builds them), only when it changes."""
    if mode == _spin[0] or not _kernel.cache_info().currsize:
        return
    kernel = _kernel()[0]
    if kernel is not None:
        kernel.lib.ft_pool_spin(int(POOL_SPIN_S[mode] * 1e9))
        _spin[0] = mode



def cache_dir() -> Path:
    """Where built kernels live: the user cache the demo checkpoint uses too."""
    return (
        Path(os.environ.get("FIRSTTOKEN_CACHE") or Path.home() / ".cache" / "firsttoken")
        / "kernels"
    )


def compiler() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def int8_pack(qweight: torch.Tensor) -> torch.Tensor:
    """A [K, N] int8 weight (K % 8 == 0, N % 32 == 0) in the AVX2 loop's blocks, [N / 32, K / 8,
    256]: for each 32 columns, for each 8 k, 8 vectors of 32 bytes (2 halves of 4 k x 4 groups of
    columns; in a vector, 2 128-bit lanes of 4 columns (the lane's columns 16 apart), each column's
    4 consecutive k), so 32 columns stream as one run and no weight is shuffled at run time. The
    same bytes, moved: ``int8_unpack`` gives the weight back."""
    k, n = qweight.shape
    assert k % 8 == 0 and n % 32 == 0 and qweight.dtype == torch.int8
    # W[k, n] with k = kb 8 + h 4 + kk and n = nb 32 + lane 16 + i 4 + c  ->  [nb, kb, h, i, lane, c, kk]
    w = qweight.reshape(k // 8, 2, 4, n // 32, 2, 4, 4)  # [kb, h, kk, nb, lane, i, c]
    return w.permute(3, 0, 1, 5, 4, 6, 2).reshape(n // 32, k // 8, 256).contiguous()


def int8_unpack(blocked: torch.Tensor) -> torch.Tensor:
    """``int8_pack``'s inverse: the [K, N] int8 weight."""
    nb, kb, _ = blocked.shape
    w = blocked.reshape(nb, kb, 2, 4, 2, 4, 4)  # [nb, kb, h, i, lane, c, kk]
    return w.permute(1, 2, 6, 0, 4, 3, 5).reshape(kb * 8, nb * 32).contiguous()


def int8_columns(qweight: torch.Tensor) -> int:
    """N of an int8 weight, [K, N] or in ``int8_pack``'s blocks."""
    return qweight.shape[0] * 32 if qweight.dim() == 3 else qweight.shape[1]


class _Kernel:
    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))  # CDLL: the GIL is released during the call
        args = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int,
        ]
        self.input_major, self.row_major = self.lib.ft_linear_im, self.lib.ft_linear_rm
        # bf16 weights: float32 rows (widened weights, float32 arithmetic), or rows holding bf16
        # values (a bf16 model's: AVX512-BF16 dot products where the CPU has them)
        self.row_major_bf16, self.row_major_bf16x = (
            self.lib.ft_linear_rm_bf16,
            self.lib.ft_linear_rm_bf16_bf16x,
        )
        for fn in (self.input_major, self.row_major, self.row_major_bf16, self.row_major_bf16x):
            fn.restype, fn.argtypes = None, args
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.int8_rows, self.quant, self.dequant = (
            self.lib.ft_int8_linear,
            self.lib.ft_quant_rows,
            self.lib.ft_dequant,
        )
        self.int8_rows.restype, self.int8_rows.argtypes = (
            None,
            [p, i64, p, p, p, p, i64, i64, i64, i32],
        )
        self.quant.restype, self.quant.argtypes = None, [p, i64, p, p, i64, i64, i32]
        self.dequant.restype, self.dequant.argtypes = None, [p, p, p, p, p, i64, i64, i32]
        self.int8_rows_q = self.lib.ft_int8_rows
        self.int8_rows_q.restype, self.int8_rows_q.argtypes = (
            None,
            [p, p, p, p, p, p, i64, i64, i64, i32],
        )
        self.int8_rows_blk, self.int8_rows_q_blk = (
            self.lib.ft_int8_linear_blk,
            self.lib.ft_int8_rows_blk,
        )
        self.int8_rows_blk.restype, self.int8_rows_blk.argtypes = (
            None,
            [p, i64, p, p, p, p, i64, i64, i64, i32],
        )
        self.int8_rows_q_blk.restype, self.int8_rows_q_blk.argtypes = (
            None,
            [p, p, p, p, p, p, i64, i64, i64, i32],
        )
        # which loop the int8 products take (AVX-512 VNNI or AVX2)
        self.int8_vnni = bool(self.lib.ft_int8_vnni())
        # bf16 products: AVX512-BF16 dot products (K % 32 == 0) or AVX2
        self.bf16_dp = bool(self.lib.ft_bf16_dp())
        # the fused step's attention loop (D % 64 == 0)
        self.attention_avx512 = bool(self.lib.ft_attention_avx512())
        self.lib.ft_topk.restype, self.lib.ft_topk.argtypes = ctypes.c_int64, [p, i64, i64, p, p]
        self.lib.ft_pool_stats.restype, self.lib.ft_pool_stats.argtypes = None, [p]
        self.lib.ft_pool_hold.restype, self.lib.ft_pool_hold.argtypes = None, [ctypes.c_int]
        self.lib.ft_pool_spin.restype, self.lib.ft_pool_spin.argtypes = None, [i64]
        self.lib.ft_quota_cpus.restype = ctypes.c_int
        self.lib.ft_quota_cpus.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]

    @property
    def max_rows_bf16(self) -> int:
        """The most rows a bfloat16 product takes these kernels for: ``MAX_ROWS_BF16_DP`` where the
        dot-product loop runs (AVX512-BF16), else ``MAX_ROWS_BF16`` (the AVX2 loop): each the most
        rows at which that loop beats torch's bf16 product (why: the module docstring)."""
        return MAX_ROWS_BF16_DP if self.bf16_dp else MAX_ROWS_BF16

    def pool_stats(self) -> dict[str, int]:
        """The kernels' own threads (ft_parallel): regions run on more than one thread so far, work
        items the workers (not the caller) took, workers started."""
        out = (ctypes.c_int64 * 3)()
        self.lib.ft_pool_stats(out)
        return {"regions": out[0], "worker_items": out[1], "workers": out[2]}

    def linear(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               bf16_rows: bool = False) -> torch.Tensor:
        """rows [M, K] float32 with unit column stride; weight [N, K] float32, row-major or
        input-major (its transpose contiguous), or bfloat16 row-major, shaped as ``kernel_applies``
        requires; bias [N] float32 contiguous or None. A bf16 weight's product is float32 arithmetic
        on the widened weight, unless ``bf16_rows`` says every row holds bf16 values (a bf16 model's
        activations, widened): then it may take AVX512-BF16 dot products, which read the rows as
        bf16 (exact for such rows, a rounding of any other)."""
        m, k = rows.shape
        n = weight.shape[0]
        if weight.dtype == torch.bfloat16:  # row-major only; rows and bias float32, outputs float32
            fn = self.row_major_bf16x if bf16_rows else self.row_major_bf16
        else:
            fn = self.row_major if weight.is_contiguous() else self.input_major
        out = torch.empty(m, n, dtype=torch.float32)
        fn(
            rows.data_ptr(),
            rows.stride(0),
            weight.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            out.data_ptr(),
            n,
            m,
            n,
            k,
            kernel_threads(),
        )
        return out

    def topk(self, row: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """torch.topk(row, k) for a contiguous float32 CPU row [n] (largest first; ties: the earlier
        index first; k = 1: argmax's first maximum), or None where it does not apply (k above
        ``TOPK_MAX``, NaNs leaving fewer than k values): the caller takes torch's."""
        n = row.numel()
        if not 1 <= k <= min(n, TOPK_MAX) or row.dtype != torch.float32 or not row.is_contiguous():
            return None
        vals, ids = torch.empty(k, dtype=torch.float32), torch.empty(k, dtype=torch.int64)
        if self.lib.ft_topk(row.data_ptr(), n, k, vals.data_ptr(), ids.data_ptr()) != k:
            return None
        return vals, ids

    def int8_linear(self, rows: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """rows [M, K] float32 on the CPU with unit column stride, each quantized as ``quant_rows``
        does; qweight [K, N] int8 contiguous (K % 8 == 0, N % 8 == 0), or the same weight in
        ``int8_pack``'s blocks, with scale [N]; bias [N] float32 or None: the same numbers as
        ``quant_rows``, an exact int32 product and ``dequant_rows`` in turn."""
        assert rows.dtype == torch.float32 and rows.device.type == "cpu" and rows.stride(-1) == 1
        m, k = rows.shape
        n = int8_columns(qweight)
        out = torch.empty(m, n, dtype=torch.float32)
        fn = self.int8_rows_blk if qweight.dim() == 3 else self.int8_rows
        fn(rows.data_ptr(), rows.stride(0), qweight.data_ptr(), scale.data_ptr(),
           0 if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k, kernel_threads())
        return out

    def int8_products(
        self,
        q: torch.Tensor,
        row_scale: torch.Tensor,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``int8_linear`` from rows already quantized: q [M, K] int8 contiguous with row_scale
        [M]."""
        m, k = q.shape
        n = int8_columns(qweight)
        out = torch.empty(m, n, dtype=torch.float32)
        fn = self.int8_rows_q_blk if qweight.dim() == 3 else self.int8_rows_q
        fn(q.data_ptr(), row_scale.data_ptr(), qweight.data_ptr(), scale.data_ptr(),
           0 if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k, torch.get_num_threads())
        return out

    def quant_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [M, K] float32, unit column stride -> (int8 [M, K], float32 scales [M])."""
        assert rows.dtype == torch.float32 and rows.device.type == "cpu" and rows.stride(-1) == 1
        m, k = rows.shape
        q, scales = torch.empty(m, k, dtype=torch.int8), torch.empty(m, dtype=torch.float32)
        self.quant(
            rows.data_ptr(),
            rows.stride(0),
            q.data_ptr(),
            scales.data_ptr(),
            m,
            k,
            torch.get_num_threads(),
        )
        return q, scales

    def dequant_rows(self, acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """acc [M, N] int32 contiguous -> float32 acc * row_scale[m] * col_scale[n] (+ bias[n])."""
        m, n = acc.shape
        out = torch.empty(m, n, dtype=torch.float32)
        self.dequant(
            acc.data_ptr(),
            row_scale.data_ptr(),
            col_scale.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            n,
            torch.get_num_threads(),
        )
        return out


# subprocess.run's shape: how the compiler is invoked
Run = Callable[..., subprocess.CompletedProcess]


def _build(cpu: CpuFeatures, run: Run = subprocess.run) -> tuple[_Kernel | None, str | None]:
    """The kernels for this CPU, built (with ``run``) or found in the cache, loaded and checked;
    else why not."""
    if not cpu.avx2_fma:
        return None, "this CPU has no AVX2 + FMA"
    cc = compiler()
    if cc is None:
        return None, "no C compiler on PATH (set $CC, or install Debian's gcc package)"
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((cc, *CFLAGS)).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_linear-{digest}.so"
    if not target.exists():
        reason = _compile(cc, target, run)
        if reason is not None:
            return None, reason
    try:
        kernel = _Kernel(target)
    except (OSError, AttributeError) as e:  # not a library, or not ours
        return None, f"loading {target} failed: {e}"
    reason = _check(kernel)
    return (kernel, None) if reason is None else (None, reason)


def _compile(cc: str, target: Path, run: Run) -> str | None:
    """Build into ``target``: aside first, then renamed, so processes building at once race
    safely."""
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        done = run(
            [cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            return f"{cc} failed: {done.stderr.strip()[-400:]}"
        os.replace(tmp, target)
        return None
    except (OSError, subprocess.TimeoutExpired) as e:  # an unwritable cache, a compiler that hangs
        return f"building with {cc} into {target.parent} failed: {e}"
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _check(kernel: _Kernel) -> str | None:
    """The kernels against torch's product: both layouts, rows 1-5, with and without bias, a strided
    input."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 48, generator=g), torch.randn(40, generator=g)
    x = torch.randn(5, 64, generator=g)[:, :48]  # row stride 64
    for w in (weight, weight.t().contiguous().t()):
        for m in range(1, 6):
            for b in (None, bias):
                got, want = kernel.linear(x[:m], w, b), F.linear(x[:m], w, b)
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                    return f"the built kernels disagree with torch (max |diff| {(got - want).abs().max():.3g})"
    # bf16 values, as a bf16 model's rows
    rows16 = torch.randn(5, 64, generator=g).to(torch.bfloat16).float()
    # float32 activations beside bf16 weights (--quantization bf16)
    rows32 = torch.randn(5, 64, generator=g)
    # K % 32 != 0: the AVX2 loop; 64: the dot-product loop where the CPU has AVX512-BF16
    for k in (48, 64):
        w16 = torch.randn(40, k, generator=g).to(torch.bfloat16)
        for m in range(1, 6):
            for rows, bf16_rows in ((rows16, True), (rows16, False), (rows32, False)):
                got = kernel.linear(rows[:m, :k], w16, bias, bf16_rows=bf16_rows)
                want = F.linear(rows[:m, :k], w16.float(), bias)
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                    return f"the built bf16 kernel disagrees with torch (max |diff| {(got - want).abs().max():.3g})"
    q, scales = kernel.quant_rows(x)
    if not torch.equal(q, torch.round(x * (1 / scales)[:, None]).to(torch.int8)):
        return "the built int8 quantize kernel disagrees with torch"
    # N % 16 == 8: the AVX2 loop; 48: the AVX-512 VNNI loop where the CPU has it; 64: the AVX2
    # 32-column loop on CPUs without VNNI
    for n in (40, 48, 64):
        qweight = torch.randint(-127, 128, (48, n), generator=g, dtype=torch.int8)
        scale, b = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
        acc = (q.long() @ qweight.long()).int()
        plain = acc.float() * scales[:, None] * scale
        want = plain + b
        if not torch.equal(kernel.dequant_rows(acc, scales, scale, b), want):
            return "the built int8 dequantize kernel disagrees with torch"
        # 64: the blocked loop too
        weights = (qweight, int8_pack(qweight)) if n % 32 == 0 else (qweight,)
        for m in range(1, 6):
            for w8 in weights:
                if not torch.equal(
                    kernel.int8_linear(x[:m], w8, scale, b), want[:m]
                ) or not torch.equal(kernel.int8_linear(x[:m], w8, scale, None), plain[:m]):
                    return "the built int8 products disagree with torch"
    return None


@functools.lru_cache(maxsize=1)
def _kernel() -> tuple[_Kernel | None, str | None]:
    """This process's kernels for this machine's CPU: built and checked once (the start-up
    self-check)."""
    kernel, reason = _build(CpuFeatures.detect())
    if reason is not None:
        log.info("few-rows CPU kernel not used: %s", reason)
    return kernel, reason


def built_kernels() -> _Kernel | None:
    """The kernels, built and checked on this machine, or None where they are unavailable (builds
    them on first call)."""
    return _kernel()[0]


def kernel_unavailable() -> str | None:
    """None when the kernel is built and checked on this machine, else why not (builds it on first
    call)."""
    return _kernel()[1]


def kernel_takes(
    out_features: int, in_features: int, dtype: torch.dtype, input_major: bool
) -> bool:
    """A weight [N, K] = [out_features, in_features] the kernels take, by its shape and layout
    alone: float32 row-major with K % 16 == 0, or input-major (``weight.t()`` contiguous) with K % 8
    == 0 and N % 8 == 0; bfloat16 row-major with K % 16 == 0."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    if not input_major:
        return in_features % 16 == 0
    return dtype == torch.float32 and in_features % 8 == 0 and out_features % 8 == 0


def kernel_applies(weight: torch.Tensor) -> bool:
    """A CPU weight [N, K] the kernels take (``kernel_takes``, its layout read off its strides)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.is_contiguous():
        return kernel_takes(*weight.shape, weight.dtype, input_major=False)
    return weight.t().is_contiguous() and kernel_takes(
        *weight.shape, weight.dtype, input_major=True
    )
