"""The KV pool from a device's memory (``--gpu-memory-utilization``): one pure function that both
the engine's resolve step (engine/resolve.py, on CUDA) and ``firsttoken plan --memory``
(tools/plan.py) call, so they agree by construction, and the one function that measures its inputs
on a CUDA device.

    usable   = int(total_bytes x utilization)
    free     = usable - in_use_after_load_bytes - profile_peak_bytes - encoder_cache_bytes
    pool     = free rounded down to a whole MiB (to a whole block below 1 MiB)
    blocks   = pool // (kv_bytes_per_token x block_size)

The MiB rounding is plan's: its printed ``--kv-cache-memory`` flag then gives ``serve`` the very
same pool. The device facts come in as a ``DeviceMemory`` value: measured by
``measure_device_memory`` on the engine's CUDA path (bytes in use once the weights are loaded, and
the extra peak of one profiling forward), estimated on paper by plan (its weights and step
workspace); tests pass their own. Nothing here asks torch about a device except
``measure_device_memory``, which only the CUDA path calls.

This module imports no engine, scheduler or kv code (tools/plan.py's rule), and torch only inside
``measure_device_memory``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

MIB = 2**20
GPU_MEMORY_UTILIZATION = 0.9  # --gpu-memory-utilization's default (vLLM's too)


class DeviceMemoryTooSmall(ValueError):
    """What the device leaves after weights, the profiling peak and the encoder cache is no KV pool
    (or too small a one for a single max-length request). The message is one line, for a start-up
    error."""


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as the KV pool's sizing reads it, bytes.

    total_bytes: the device's whole memory (torch.cuda.mem_get_info's total).
    in_use_after_load_bytes: what is in use once the weights (and everything else loading leaves)
    are on it, as
        seen by the device (total - free), so the CUDA context and other processes count too.
    profile_peak_bytes: the extra peak the allocator saw during one profiling forward at the largest
    step the
        budgets allow, above what was allocated before it (plan: its step workspace estimate).
    """

    total_bytes: int
    in_use_after_load_bytes: int
    profile_peak_bytes: int

    def __post_init__(self) -> None:
        if self.total_bytes <= 0:
            raise ValueError("total_bytes must be positive")
        if self.in_use_after_load_bytes < 0 or self.profile_peak_bytes < 0:
            raise ValueError("in_use_after_load_bytes and profile_peak_bytes must be >= 0")


class KvPool(NamedTuple):
    usable_bytes: int  # total x utilization
    free_bytes: int  # usable - in use after load - profile peak - encoder cache
    pool_bytes: int  # free, rounded down to a whole MiB (a flag serve reads exactly)
    num_blocks: int  # pool // block bytes


def kv_pool_from_device(
    total_bytes: int,
    utilization: float,
    in_use_after_load_bytes: int,
    profile_peak_bytes: int,
    encoder_cache_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    min_blocks: int = 1,
) -> KvPool:
    """The KV pool a device leaves (formula: the module docstring). ``min_blocks``: the fewest
    blocks that are still a pool (the engine: one request of max_model_len tokens; plan: 1).
    DeviceMemoryTooSmall, one line, when usable is not positive or the pool has fewer blocks than
    that."""
    if not 0 < utilization <= 1:
        raise ValueError("gpu_memory_utilization must be > 0 and <= 1")
    if kv_bytes_per_token < 1 or block_size < 1 or min_blocks < 1:
        raise ValueError("kv_bytes_per_token, block_size and min_blocks must be >= 1")
    block_bytes = kv_bytes_per_token * block_size
    usable = int(total_bytes * utilization)
    free = usable - in_use_after_load_bytes - profile_peak_bytes - encoder_cache_bytes
    terms = (f"{_mib(total_bytes)} x {utilization:g} utilization = {_mib(usable)} usable, less "
             f"{_mib(in_use_after_load_bytes)} in use after loading, {_mib(profile_peak_bytes)} profiling peak and "
             f"{_mib(encoder_cache_bytes)} encoder cache")
    if usable <= 0 or free < block_bytes:
        raise DeviceMemoryTooSmall(
            f"no room for a KV pool on the device: {terms} leaves {_mib(free)}, under one "
            f"{_mib(block_bytes)} block; raise --gpu-memory-utilization, or lower "
            "--max-batched-tokens, --image-max-tokens or --encoder-cache-memory"
        )
    pool = free // MIB * MIB if free >= MIB else free // block_bytes * block_bytes
    blocks = pool // block_bytes
    if blocks < min_blocks:
        raise DeviceMemoryTooSmall(
            f"the KV pool the device leaves holds {blocks} blocks ({terms}), fewer than the "
            f"{min_blocks} one max-length request needs; lower --max-model-len or raise "
            "--gpu-memory-utilization"
        )
    return KvPool(usable, free, pool, blocks)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / MIB:.0f} MiB"


class MeasureDeviceMemory(Protocol):
    """What start-up calls to learn the device's facts (engine.py): ``load()`` puts the weights on
    the device, ``profile()`` runs the profiling forward; ``measure_device_memory`` on CUDA, tests
    return injected facts."""

    def __call__(
        self, load: Callable[[], object], profile: Callable[[], object]
    ) -> DeviceMemory: ...


def measure_device_memory(load: Callable[[], object], profile: Callable[[], object],
                          device: int | str = 0) -> DeviceMemory:
    """The device facts, measured on CUDA (only the CUDA path calls this): ``load()`` puts the
    weights on the device; then bytes in use = total - free (torch.cuda.mem_get_info, so the CUDA
    context counts); then ``profile()`` runs one forward at the largest step the budgets allow, and
    its peak is the allocator's max_memory_allocated above what was allocated before it. Only
    long-standing torch.cuda calls (torch 2.11)."""
    import torch

    load()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile()
    torch.cuda.synchronize(device)
    peak = max(0, torch.cuda.max_memory_allocated(device) - before)
    return DeviceMemory(int(total), int(in_use), int(peak))
