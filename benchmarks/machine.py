"""What a benchmark records about the machine it ran on: CPU model, the SIMD flags that decide matmul kernels,
cores, load. Results from different machines are only comparable with these beside them."""

from __future__ import annotations

import os
import re
from pathlib import Path

# as `grep -o -E 'avx512[a-z_0-9]*|amx[a-z_0-9]*|avx2' /proc/cpuinfo | sort -u`
SIMD_FLAGS = re.compile(r"\b(avx512[a-z_0-9]*|amx[a-z_0-9]*|avx2)\b")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags() -> list[str]:
    return sorted(set(SIMD_FLAGS.findall(_cpuinfo())))


def cpu_model() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def machine_info() -> dict[str, object]:
    """CPU, flags, logical cores and the 1/5/15-minute load average when called (a shared machine is noisy)."""
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
