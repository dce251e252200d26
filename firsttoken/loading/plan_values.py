"""The plan's values (loading/load_plan.py): the ``Machine`` it reads and the ``ModelPlan`` it settles,
plain data apart from the rules that decide them, so that loading/methods.py, which plan.py asks,
names them without a circle."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

from firsttoken.config import LoadFormat, ResolvedDevice, ResolvedDtype, ResolvedQuantization
from firsttoken.kernels.cpu_features import CpuFeatures
from firsttoken.kernels.cpu_linear import built_kernels, kernel_unavailable
from firsttoken.loading.quant import fp16_supported, int_mm_exact

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        # float64: tests' twins
                                        "float16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True)
class CudaFacts:
    """What the plan reads of the machine's CUDA device: whether torch can use one, and which
    (device 0). Read once by ``detect`` (the only place that asks torch.cuda); tests pass a value of
    their own."""

    available: bool
    name: str | None = None  # device 0's name, e.g. "NVIDIA H200"
    why_not: str | None = None  # why torch sees no CUDA device, where it sees none

    @staticmethod
    def detect() -> CudaFacts:
        if not torch.cuda.is_available():
            build = torch.version.cuda
            return CudaFacts(
                False,
                why_not="torch.cuda.is_available() is False (torch "
                f"{torch.__version__}, {'CUDA ' + build if build else 'built without CUDA'})",
            )
        return CudaFacts(True, name=torch.cuda.get_device_name(0))

    @staticmethod
    def absent(why: str = "no CUDA device (test)") -> CudaFacts:
        return CudaFacts(False, why_not=why)


@dataclass(frozen=True)
class Machine:
    """What the plan reads of the machine it runs on."""

    cpu: CpuFeatures
    # firsttoken's kernels (kernels/cpu_linear.py), built and self-checked here; None where not
    kernels: Any
    kernels_unavailable: str | None  # why not, or None
    int_mm_exact: bool  # torch._int_mm multiplies int8 exactly here (loading/quant.py)
    fp16_unavailable: str | None  # why FBGEMM's fp16 GEMM cannot run here, or None
    # the CUDA device --device auto/cuda would use
    cuda: CudaFacts = CudaFacts(False, why_not="not probed")

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def detect(build_kernels: bool = True) -> Machine:
        """This machine: the kernels are built (or found in the cache) and checked against torch
        once per process. ``build_kernels`` False (--cpu-kernels off, which uses none of them): they
        are not built."""
        cpu = CpuFeatures.detect()
        if build_kernels:
            kernels, why = built_kernels(), kernel_unavailable()
        else:
            kernels, why = None, "--cpu-kernels off"
        return Machine(cpu, kernels, why, int_mm_exact(cpu), fp16_supported(), CudaFacts.detect())

    @staticmethod
    def for_flags(cpu_kernels: str, device: str) -> Machine:
        """This machine as ``detect`` reads it for these --cpu-kernels and --device values: the
        kernels are built only where they may be used, so neither --cpu-kernels off nor a run that
        resolves to cuda compiles them."""
        on_cpu = device == "cpu" or (device == "auto" and not CudaFacts.detect().available)
        return Machine.detect(build_kernels=cpu_kernels != "off" and on_cpu)

    def with_cpu(self, cpu: CpuFeatures) -> Machine:
        """This machine's kernels and probes, deciding as if its CPU were ``cpu`` (tests of the
        rules)."""
        return replace(self, cpu=cpu)

    def with_cuda(self, cuda: CudaFacts) -> Machine:
        """This machine as one whose CUDA device is ``cuda`` (tests of the device rules, on any
        machine)."""
        return replace(self, cuda=cuda)

    def without_kernels(self, why: str) -> Machine:
        """This machine as one where firsttoken's kernels cannot be built, for ``why``."""
        return replace(self, kernels=None, kernels_unavailable=why)


@dataclass(frozen=True)
class ModelPlan:
    """A checkpoint's settled choices on this machine, each with its reason (what the start-up block
    says)."""

    device: ResolvedDevice
    device_why: str
    # auto: the checkpoint's weights; dummy: random ones of its config's shapes
    load_format: LoadFormat
    # a torch dtype's name (tests' float64 twins aside: float32, bfloat16, float16)
    dtype: ResolvedDtype | str
    dtype_why: str
    quantization: ResolvedQuantization
    quantization_why: str
    # why firsttoken's kernels do not compute the language model's decode products
    kernels_unused: str | None
    # widening float32 weights stored input-major (MKL's one-row products)
    weights_input_major: bool
    # --quantization fp16: FBGEMM's multithreaded entry point (not one torch thread)
    fp16_multithreaded: bool
    attention_backend: str
    # why a pure-decode step's decoder layers do not run as one call, or None: they do
    fused_decode: str | None
    # what computes the language model's products, in words (int8: which loop, which prefill path)
    products: str
    # the sampler's argmax / top-k through the kernels' one-pass loop where they are built
    sampler_kernels: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def describe_lines(self) -> list[str]:
        """The start-up block's lines about the model."""
        lines = [
            f"device: {self.device} ({self.device_why})",
            "weights: "
            + (
                "random (--load-format dummy)"
                if self.load_format == "dummy"
                else "the checkpoint's"
            ),
            f"dtype: {self.dtype} ({self.dtype_why})",
            f"quantization: {self.quantization} ({self.quantization_why})",
            f"decode steps' products: {self.products}",
        ]
        if self.device == "cpu":
            lines.append("decode steps' decoder layers: " + (
                "one fused call" if self.fused_decode is None else f"eager ({self.fused_decode})"))
            lines.append("float32 weights' layout: " + (
                "widening ones input-major (MKL's one-row products)" if self.weights_input_major
                else "the checkpoint's"))
        return lines
