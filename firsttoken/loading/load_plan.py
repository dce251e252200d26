"""How a checkpoint runs on this machine: ``--device``, ``--dtype``, ``--quantization``,
``--cpu-kernels``, ``--attention-backend`` and ``--load-format`` settled, ``auto`` included, in one
place (``plan_model``), from the flags, the checkpoint and the machine.

The result is a ``ModelPlan``: plain values, each choice with the reason it went that way, so the
engine logs it once, ``GET /v1/engine/config`` reports it, and the loader builds from it
(loading/methods.py picks each layer's method by it); nothing downstream asks ``auto`` again. The
machine is a ``Machine`` value (its CPU's features, the kernels built and self-checked here or why
not, torch's probes, its CUDA device as ``CudaFacts``): ``Machine.detect()`` in production, a value
of the test's own in tests (``with_cuda`` gives it a CUDA device).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from firsttoken.config import (
    FLOAT32_ACTIVATIONS,
    AttentionBackendName,
    CpuKernels,
    Device,
    Dtype,
    LoadFormat,
    Quantization,
    ResolvedDevice,
    ResolvedQuantization,
    check_choice,
)
from firsttoken.kernels.cpu_features import CpuFeatures
from firsttoken.loading.methods import LayerMethods
from firsttoken.loading.plan_values import TORCH_DTYPES, CudaFacts, Machine, ModelPlan
from firsttoken.loading.quant import int8_paths, single_thread_entry_point
from firsttoken.models.registry import family_of, load_model_config
from firsttoken.models.weight_files import stored_linear_dtypes

BF16_WEIGHTS_ARITHMETIC = (
    "each widened exactly to float32, float32 activations and sums: float32 inference's "
    "arithmetic on every CPU"
)


def _products(
    quantization: str,
    kernels_unused: str | None,
    fp16_multithreaded: bool,
    machine: Machine,
    dtype: torch.dtype,
) -> str:
    """What computes the language model's products, and in what arithmetic where the CPU decides it,
    in words."""
    if quantization == "int8":
        return "int8 weights: " + int8_paths(machine.kernels if kernels_unused is None else None,
                                             machine.int_mm_exact, kernels_unused)
    if quantization == "bf16":
        return f"bf16 weights ({BF16_WEIGHTS_ARITHMETIC}): " + (
            "by firsttoken's kernels"
            if kernels_unused is None
            else f"by torch's ({kernels_unused})"
        )
    if quantization == "fp16":
        return (
            "float16 weights: FBGEMM's "
            + ("multithreaded" if fp16_multithreaded else "one-thread")
            + " entry point"
        )
    if kernels_unused is not None:
        return f"torch's (few-rows kernels not used: {kernels_unused})"
    if dtype == torch.bfloat16:
        return (
            "firsttoken's few-rows kernels: bf16 rows and weights, float32 sums rounded to bf16, "
            + (
                "as AVX512-BF16 dot products (bf16 denormals read as zero)"
                if machine.cpu.has("avx512_bf16")
                else "the weights widened by the AVX2 loop"
            )
        )
    return "firsttoken's few-rows AVX2 kernels"


def resolve_device(device: Device | str, cuda: CudaFacts) -> tuple[ResolvedDevice, str]:
    """``--device``'s device, and why: ``auto`` is cuda where torch sees a CUDA device, else cpu.
    ValueError ("device cuda: ...", one line) for cuda where there is none."""
    check_choice("device", device, Device)
    if device == "cuda" and not cuda.available:
        raise ValueError(f"device cuda: no CUDA device here: {cuda.why_not}")
    if device != "auto":
        return device, "as asked" + (f": {cuda.name}" if device == "cuda" else "")  # type: ignore[return-value]
    if cuda.available:
        return "cuda", f"auto: CUDA device {cuda.name}"
    return "cpu", f"auto: {cuda.why_not}"


def resolve_dtype(dtype: Dtype | str, quantization: Quantization, cpu: CpuFeatures,
                  device: ResolvedDevice | str = "cpu") -> tuple[str, str]:
    """``--dtype``'s torch dtype name on the resolved ``device``, and why: on cuda ``auto`` is bf16
    (tensor cores, and half of float32's weight and KV bytes); on the CPU ``auto`` is bf16 where the
    CPU computes bf16 in hardware (without it torch emulates bf16, slower than float32:
    docs/performance.md#engine-settings-what-auto-picks), else float32; always float32 with
    --quantization fp16, int8 or bf16, whose kernels take float32 activations."""
    if dtype != "auto":
        return dtype, "as asked"
    if device == "cuda" and quantization not in FLOAT32_ACTIVATIONS:
        return "bfloat16", "auto: bf16 on a CUDA device"
    if quantization in FLOAT32_ACTIVATIONS:
        return "float32", f"auto: --quantization {quantization} takes float32 activations"
    if cpu.native_bf16:
        return "bfloat16", "auto: the CPU computes bf16 in hardware"
    return "float32", "auto: the CPU has no native bf16 (torch would emulate it)"


def kernels_skipped(setting: CpuKernels, dtype: torch.dtype, machine: Machine) -> str | None:
    """None when ``--cpu-kernels setting`` uses the kernels on this machine for a ``dtype`` language
    model, else why not. float32: ``auto`` leaves Intel's AVX-512 CPUs to MKL (there its products
    use AVX-512 and beat the kernels, AVX2) and takes them on AMD's, where the fused decode steps
    beat MKL's at 1-16 rows. bfloat16: ``auto`` takes the kernels on CPUs with native bf16
    (AVX512-BF16) but no AMX, the only CPUs they are known to beat torch's products on, and leaves
    other CPUs to torch (why, both: docs/performance.md#kernels). ``on`` takes the kernels wherever
    they build."""
    cpu = machine.cpu
    if setting == "off":
        return "--cpu-kernels off"
    if setting == "auto" and dtype == torch.bfloat16:
        if not cpu.has("avx512_bf16") or cpu.has("amx_bf16"):
            return "bf16 products measured against torch's only on AVX512-BF16 CPUs without AMX " \
                   "(--cpu-kernels on uses them)"
    elif setting == "auto" and cpu.avx512 and cpu.vendor != "AuthenticAMD":
        return "this CPU has AVX-512 (not AMD's), where MKL's products beat these AVX2 kernels on the Xeon " \
               "measured (--cpu-kernels on uses them)"
    return machine.kernels_unavailable


def kernels_off(setting: CpuKernels, machine: Machine) -> str | None:
    """Why quantized weights (int8, bf16) go without firsttoken's kernels, or None: they take them
    on any CPU the kernels build for, whatever ``kernels_skipped`` says of float32 (their
    alternative is no MKL product)."""
    return "--cpu-kernels off" if setting == "off" else machine.kernels_unavailable


def auto_quantization(model_dir: Path, dtype: torch.dtype, device: str, kernels_why_not: str | None
                      ) -> tuple[ResolvedQuantization, str]:
    """What ``--quantization auto`` applies, and why: "bf16" where the checkpoint stores its
    language model's linear weights in bf16 and the model runs float32 activations on the CPU with
    firsttoken's kernels (those weights at their own bytes: decode steps read half of float32's; the
    same values, widened exactly, never the activations rounded: float32 inference's arithmetic on
    every CPU, AVX512-BF16 ones included), else "none"."""
    if device != "cpu":
        return "none", f"auto: device {device}"
    if dtype != torch.float32:
        return (
            "none",
            f"auto: {str(dtype).removeprefix('torch.')} activations: weights in that dtype",
        )
    if kernels_why_not is not None:
        return "none", f"auto: firsttoken's kernels not used: {kernels_why_not}"
    stored = stored_linear_dtypes(model_dir)
    if stored != {"BF16"}:
        return "none", f"auto: the checkpoint's language-model linear weights are " \
                       f"{'/'.join(sorted(stored)) or 'absent'}"
    return "bf16", "auto: the checkpoint stores its language model's linear weights in bf16; float32 activations"


def keeps_row_major(quantization: str, kernels_why_not: str | None, cpu: CpuFeatures) -> bool:
    """Whether a float32 language model keeps its checkpoint's row-major weights instead of storing
    the widening ones input-major: where firsttoken's kernels take its decode products on a CPU
    without AVX-512. There the row-major loop streams each output's weights as one run: faster
    decode steps than the AVX2 input-major loop, and prefill through MKL level within the noise
    (why: docs/runs/notes/decode-kernels.md#float32-weights-row-major-on-avx2-cpus-session-32).
    AVX-512 CPUs keep input-major (their 16-wide input-major loop, im_range16, is the one shown
    faster there; row-major has not been compared on them), and so do MKL's decode products (its
    one-row path is faster input-major)."""
    return quantization == "none" and kernels_why_not is None and not cpu.avx512


def plan_model(
    model_dir: str | Path,
    dtype: Dtype | str,
    quantization: Quantization,
    cpu_kernels: CpuKernels,
    machine: Machine,
    device: Device | str = "cpu",
    attention_backend: AttentionBackendName | str = "sdpa",
    num_threads: int | None = None,
    load_format: LoadFormat = "auto",
) -> ModelPlan:
    """Every choice of how this checkpoint runs here. ``dtype``: a --dtype value (``auto`` included)
    or a torch dtype's name; ``device``: a --device value (``auto`` included: ``machine.cuda``
    decides); ``num_threads``: the engine's torch threads (1: fp16 weights take FBGEMM's one-thread
    entry point, cheaper per call). ValueError names what cannot run."""
    model_dir = Path(model_dir)
    check_choice("cpu_kernels", cpu_kernels, CpuKernels)
    check_choice("quantization", quantization, Quantization)
    check_choice("load_format", load_format, LoadFormat)
    device, device_why = resolve_device(device, machine.cuda)
    if attention_backend == "triton" and device != "cuda":
        raise ValueError(
            "attention_backend triton runs on cuda only (on the CPU its kernels run only under "
            "Triton's interpreter, for tests): use sdpa"
        )
    if device == "cuda" and quantization in FLOAT32_ACTIVATIONS:
        raise ValueError(
            f"quantization {quantization} runs on the CPU only: on cuda use none (or auto)"
        )
    name, dtype_why = resolve_dtype(dtype, quantization, machine.cpu, device)
    torch_dtype = TORCH_DTYPES[name]
    if quantization in FLOAT32_ACTIVATIONS and torch_dtype != torch.float32:
        raise ValueError(
            f"--quantization {quantization} runs float32 activations: use --dtype float32 (or auto)"
        )
    off = kernels_off(cpu_kernels, machine)
    quantization, quantization_why = _quantization(
        quantization, load_format, model_dir, torch_dtype, device, off
    )
    if quantization == "fp16" and machine.fp16_unavailable is not None:
        raise ValueError(f"--quantization fp16 is not available: {machine.fp16_unavailable}")
    unused = _kernels_unused(device, quantization, torch_dtype, name, off, cpu_kernels, machine)
    fp16_multithreaded = num_threads != 1 or not single_thread_entry_point()
    plan = ModelPlan(
        device=device,
        device_why=device_why,
        load_format=load_format,
        dtype=name,
        dtype_why=dtype_why,
        quantization=quantization,
        quantization_why=quantization_why,
        kernels_unused=unused,
        weights_input_major=device == "cpu"
        and torch_dtype == torch.float32
        and quantization == "none"
        and not keeps_row_major(quantization, unused, machine.cpu),
        fp16_multithreaded=fp16_multithreaded,
        attention_backend=attention_backend,
        fused_decode="not planned yet",
        products=_products(quantization, unused, fp16_multithreaded, machine, torch_dtype),
        sampler_kernels=device == "cpu" and cpu_kernels != "off",
    )
    family = family_of(model_dir)
    layout = (
        family.decoder_layout(load_model_config(model_dir))
        if family.decoder_layout is not None
        else None
    )
    return replace(plan, fused_decode=LayerMethods(plan, machine).fused_decode_unsupported(layout))


def _quantization(quantization: Quantization, load_format: LoadFormat, model_dir: Path,
                  torch_dtype: torch.dtype, device: str, off: str | None
                  ) -> tuple[Quantization, str]:
    """The quantization the plan runs, and why."""
    if quantization == "auto" and load_format == "dummy":
        return "none", "auto: --load-format dummy (no stored weights to read)"
    if quantization == "auto":
        return auto_quantization(model_dir, torch_dtype, device, off)
    return quantization, "as asked"


def _kernels_unused(device: str, quantization: str, torch_dtype: torch.dtype, name: str,
                    off: str | None, cpu_kernels: CpuKernels, machine: Machine) -> str | None:
    """Why the language model's decode products do not take firsttoken's kernels (None: they
    do)."""
    if device != "cpu":
        return f"device {device}"
    if quantization == "fp16":
        return "float16 weights (FBGEMM)"
    if quantization in ("int8", "bf16"):
        return off
    if torch_dtype in (torch.float32, torch.bfloat16):
        return kernels_skipped(cpu_kernels, torch_dtype, machine)
    return f"{name} weights"
