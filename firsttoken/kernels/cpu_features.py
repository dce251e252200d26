"""What firsttoken reads of the CPU it runs on, as one plain value.

``CpuFeatures.detect()`` reads it once (Linux: /proc/cpuinfo's flags and vendor; the architecture;
torch's own dispatch level where the flags cannot be read). Everything that decides by the CPU (the
kernels' build, the resolve step's ``auto`` choices in loading/load_plan.py) takes a ``CpuFeatures`` as
an argument, so a test states the CPU it means
(``CpuFeatures(flags=frozenset({"avx2", "fma", "avx512f"}), vendor="GenuineIntel")``) instead of
patching detection.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CpuFeatures:
    arch: str = "x86_64"  # platform.machine(), lower case
    # /proc/cpuinfo's feature flags; None where they cannot be read
    flags: frozenset[str] | None = None
    # /proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD), None where unreadable
    vendor: str | None = None
    # torch.backends.cpu.get_cpu_capability(): read where the flags are not
    torch_capability: str = ""

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def detect() -> CpuFeatures:
        """This machine's (read once per process)."""
        return CpuFeatures(
            platform.machine().lower(),
            _cpuinfo_flags(),
            _cpuinfo_field("vendor_id"),
            torch.backends.cpu.get_cpu_capability(),
        )

    def has(self, flag: str) -> bool:
        return self.flags is not None and flag in self.flags

    @property
    def avx2_fma(self) -> bool:
        """AVX2 and FMA (its flags; where they cannot be read, torch's own dispatch level): what the
        kernels need."""
        if self.arch not in ("x86_64", "amd64"):
            return False
        if self.flags is not None:
            return {"avx2", "fma"} <= self.flags
        return self.torch_capability in ("AVX2", "AVX512")

    @property
    def avx512(self) -> bool:
        return self.has("avx512f")

    @property
    def native_bf16(self) -> bool:
        """bf16 computed in hardware (AVX512-BF16 or AMX). Without it (e.g. an AVX-512 CPU lacking
        avx512_bf16) torch emulates bf16, slower than fp32, so ``--dtype auto`` takes float32 there
        (why: docs/performance.md#engine-settings-what-auto-picks)."""
        return self.has("avx512_bf16") or self.has("amx_bf16")

    @property
    def int8_dot_products(self) -> bool:
        """VNNI or AMX int8 instructions (AVX-512 VNNI, AVX-VNNI, AMX-INT8): where oneDNN's
        torch._int_mm may be exact (loading/quant.py checks it)."""
        return any(self.has(f) for f in ("avx512_vnni", "avx_vnni", "amx_int8"))

    def summary(self) -> str:
        """The flags that decide firsttoken's choices, for the start-up block."""
        wanted = (
            "avx2",
            "fma",
            "avx512f",
            "avx512_bf16",
            "amx_bf16",
            "avx512_vnni",
            "avx_vnni",
            "amx_int8",
        )
        shown = (
            [f for f in wanted if self.has(f)] if self.flags is not None else ["(flags unreadable)"]
        )
        return f"{self.arch} {self.vendor or 'unknown vendor'}: {' '.join(shown) or 'none of ' + ' '.join(wanted)}"


def _cpuinfo_flags() -> frozenset[str] | None:
    line = _cpuinfo_field("flags")
    return None if line is None else frozenset(line.split())


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
