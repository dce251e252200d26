"""The one resolve step: the flags (``EngineConfig``), the checkpoint and the machine -> what the
engine runs with.

``resolve_engine_config`` settles, once: the device (``--device auto``: cuda where the ``Machine``
value has a CUDA device), the model's dtype, quantization, kernels and decode layers
(loading/load_plan.py's ``plan_model``, the only code that decides ``auto``), torch's threads, the KV
pool's blocks and context length, the encoder cache's size in tokens, and the decode batch sizes
captured as CUDA graphs. The engine is built from the ``ResolvedEngineConfig``, logs ``describe()``
once at start-up as one block, and ``GET /v1/engine/config`` reports ``as_dict()``; nothing
downstream derives any of it again.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from firsttoken.config import EngineConfig
from firsttoken.device_memory import DeviceMemory, kv_pool_from_device
from firsttoken.kernels.cpu_features import CpuFeatures
from firsttoken.loading.load_plan import plan_model, resolve_device, resolve_dtype
from firsttoken.loading.plan_values import TORCH_DTYPES, CudaFacts, Machine, ModelPlan
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.registry import family_named, load_model_config
from firsttoken.runner.cuda_graphs import capture_sizes
from firsttoken.runner.model_runner import ThreadPlan

log = logging.getLogger("firsttoken.engine")


@dataclass(frozen=True)
class KVCapacity:
    """What the KV pool holds; printed at start-up."""

    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    max_model_len: int
    decode_reserve_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, input_len: int) -> int:
        """Requests of input_len tokens admitted at once (prompt + decode reserve, whole blocks)."""
        need = min(input_len + self.decode_reserve_tokens, self.max_model_len)
        return self.num_blocks // -(-need // self.block_size)

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.kv_bytes_per_token} bytes/token, {self.num_tokens * self.kv_bytes_per_token / 2**20:.0f} MiB; "
            f"max_model_len {self.max_model_len}; max concurrency at max_model_len: "
            f"{self.max_concurrency(self.max_model_len)}"
        )


def activation_device(config: EngineConfig, cuda: CudaFacts | None = None) -> str:
    """The device these flags resolve to on this machine (``plan_model``'s answer), for a check
    before the model loads. ValueError for --device cuda where there is none."""
    device, _ = resolve_device(config.device, cuda or CudaFacts.detect())
    return device


def activation_dtype(
    config: EngineConfig, cpu: CpuFeatures | None = None, cuda: CudaFacts | None = None
) -> str:
    """The model's activations' dtype, and so the KV cache's, that these flags resolve to on this
    machine's CPU and CUDA device (the same answer ``plan_model`` gives: it does not depend on the
    checkpoint), for a check before the model loads. ValueError for --device cuda where there is
    none."""
    device, _ = resolve_device(config.device, cuda or CudaFacts.detect())
    name, _ = resolve_dtype(config.dtype, config.quantization, cpu or CpuFeatures.detect(), device)
    return name


def kv_dtype_bytes(config: EngineConfig, cpu: CpuFeatures | None = None) -> int:
    """Bytes per element of the KV cache for these flags on this CPU."""
    return TORCH_DTYPES[activation_dtype(config, cpu)].itemsize


def plan_kv_capacity(model: ModelConfig, config: EngineConfig, dtype_bytes: int | None = None,
                     num_blocks: int | None = None) -> KVCapacity:
    """The KV pool of ``config.cache`` for this architecture; ``dtype_bytes``: the cache's element
    size (default: what these flags resolve to on this machine); ``num_blocks``: the pool's blocks
    when they were sized from the device (``kv_blocks_from_device``), else ``--kv-cache-memory``'s
    bytes (1GiB when not given) decide."""
    per_token = model.kv_bytes_per_token(
        kv_dtype_bytes(config) if dtype_bytes is None else dtype_bytes
    )
    block_size = config.cache.block_size
    if num_blocks is None:
        num_blocks = config.cache.kv_pool_bytes // (per_token * block_size)
    if num_blocks < 1:
        raise ValueError("kv_cache_memory is smaller than one KV block")
    max_len = min(model.max_position_embeddings, num_blocks * block_size)
    if config.scheduler.max_model_len is not None:
        if config.scheduler.max_model_len > max_len:
            raise ValueError(
                f"max_model_len {config.scheduler.max_model_len} exceeds what the model and KV pool allow ({max_len})"
            )
        max_len = config.scheduler.max_model_len
    return KVCapacity(
        num_blocks, block_size, per_token, max_len, config.scheduler.decode_reserve_tokens
    )


def kv_blocks_from_device(
    model: ModelConfig, config: EngineConfig, dtype_bytes: int, device: DeviceMemory
) -> int:
    """The KV pool's blocks on a CUDA device where --kv-cache-memory is not given:
    device_memory.py's ``kv_pool_from_device`` (the function ``firsttoken plan --memory`` calls too)
    with --gpu-memory-utilization, the measured (or, in tests, injected) ``device`` facts and the
    encoder cache's bytes. A pool that cannot hold one request of --max-model-len tokens (when
    given; else the context is capped by the pool, as on the CPU) is a DeviceMemoryTooSmall (a
    ValueError), one line."""
    cache = config.cache
    encoder = cache.encoder_cache_memory_bytes if cache.enable_encoder_cache else 0
    max_len = config.scheduler.max_model_len
    min_blocks = -(-max_len // cache.block_size) if max_len is not None else 1
    return kv_pool_from_device(
        device.total_bytes,
        cache.gpu_memory_utilization,
        device.in_use_after_load_bytes,
        device.profile_peak_bytes,
        encoder,
        model.kv_bytes_per_token(dtype_bytes),
        cache.block_size,
        min_blocks,
    ).num_blocks


def resolve_cuda_graphs(
    config: EngineConfig, device: str, attention_backend: str
) -> tuple[tuple[int, ...], str]:
    """--cuda-graphs: the decode batch sizes captured (empty: off) and why. auto is on for cuda with
    the Triton backend, whose decode reads lengths and block tables from device tensors at a fixed
    grid."""
    if config.cuda_graphs == "off":
        return (), "--cuda-graphs off"
    if device != "cuda":
        return (), f"auto: device {device} runs every step eagerly"
    if attention_backend != "triton":
        return (), (f"auto: the {attention_backend} backend's decode changes shape with the longest context, which "
                    "a graph cannot replay; --attention-backend triton captures")
    return capture_sizes(config.scheduler.max_num_seqs), "auto: cuda with the triton backend"


@dataclass(frozen=True)
class ResolvedEngineConfig:
    """``EngineConfig`` with everything it leaves to ``auto`` or a default settled for this
    checkpoint here."""

    requested: EngineConfig  # the flags as given
    model: ModelPlan  # dtype, quantization, kernels, decode layers, each with why
    cpu: str  # the CPU features the choices read (CpuFeatures.summary)
    # torch's intra-op threads for prefill and vision steps (and the kernels' own workers)
    num_threads: int
    # torch's threads in steps that only decode (runner/model_runner.py's ThreadPlan)
    decode_threads: int
    kv: KVCapacity
    encoder_cache_tokens: int  # visual tokens' embeddings the encoder cache holds (0: off)
    # decode batch sizes captured as CUDA graphs (empty: every step eager)
    cuda_graph_sizes: tuple[int, ...] = ()
    cuda_graphs_why: str = "off"
    # the device's facts the KV pool was sized from (cuda), else None
    device_memory: DeviceMemory | None = None

    @property
    def sizes_kv_from_device(self) -> bool:
        """The KV pool is what --gpu-memory-utilization of the device leaves (cuda,
        --kv-cache-memory not given)."""
        return self.model.device == "cuda" and self.requested.cache.kv_cache_memory_bytes is None

    @property
    def needs_device_memory(self) -> bool:
        """The pool is to be sized from the device and has not been: ``kv`` is provisional (1GiB,
        its context not checked against --max-model-len) until start-up resolves again with the
        measured facts (engine.py)."""
        return self.sizes_kv_from_device and self.device_memory is None

    def describe(self) -> str:
        """The start-up block: one line per choice."""
        lines = [f"cpu: {self.cpu}", *self.model.describe_lines,
                 f"threads: {self.num_threads} (decode-only steps {self.decode_threads})",
                 "cuda graphs: " + (f"decode batches {', '.join(map(str, self.cuda_graph_sizes))} "
                                    f"({self.cuda_graphs_why})" if self.cuda_graph_sizes
                                    else f"off ({self.cuda_graphs_why})"),
                 *self._device_memory_lines(),
                 self.kv.describe(),
                 f"encoder cache: {self.encoder_cache_tokens} visual tokens"
                 + ("" if self.requested.cache.enable_encoder_cache else " (off)")]
        return "engine configuration:\n  " + "\n  ".join(lines)

    def _device_memory_lines(self) -> list[str]:
        m = self.device_memory
        if m is None or not self.sizes_kv_from_device:
            return []
        return [f"device memory: {m.total_bytes / 2**20:.0f} MiB x {self.requested.cache.gpu_memory_utilization:g} "
                f"utilization; {m.in_use_after_load_bytes / 2**20:.0f} MiB in use after loading, profiling peak "
                f"{m.profile_peak_bytes / 2**20:.0f} MiB (the KV pool is what is left)"]

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON: what GET /v1/engine/config returns."""
        out = dataclasses.asdict(self)
        out["kv"]["num_tokens"] = self.kv.num_tokens
        out["cuda_graph_sizes"] = list(self.cuda_graph_sizes)  # as JSON carries it
        return out


def resolve_engine_config(
    config: EngineConfig,
    model_dir: str | Path,
    machine: Machine | None = None,
    model_config: ModelConfig | None = None,
    device_memory: DeviceMemory | None = None,
) -> ResolvedEngineConfig:
    """What an engine over ``model_dir`` runs with, on ``machine`` (default: this one). ValueError
    names what cannot run (a KV pool smaller than one block, fp16 without FBGEMM, ...).

    The KV pool: ``--kv-cache-memory`` when given; else on cuda what --gpu-memory-utilization of the
    device leaves (``kv_blocks_from_device``) by ``device_memory``, the facts
    ``device_memory.measure_device_memory`` measures after loading the weights and one profiling
    forward (tests inject them); else 1GiB (the CPU, and cuda until the start-up measures the
    device: ``needs_device_memory``; the engine does, after loading the weights, and resolves again
    with the facts). Nothing measures the device inside this step."""
    machine = machine or Machine.for_flags(config.cpu_kernels, config.device)
    model_config = model_config or load_model_config(model_dir)
    threads = ThreadPlan(config.num_threads, config.decode_threads)
    plan = plan_model(
        model_dir,
        config.dtype,
        config.quantization,
        config.cpu_kernels,
        machine,
        config.device,
        config.attention_backend,
        num_threads=threads.threads,
        load_format=config.load_format,
    )
    # the KV cache's and the encoder's
    dtype_bytes = torch.tensor([], dtype=plan.torch_dtype).element_size()
    num_blocks = None
    from_device = plan.device == "cuda" and config.cache.kv_cache_memory_bytes is None
    if from_device and device_memory is not None:
        num_blocks = kv_blocks_from_device(model_config, config, dtype_bytes, device_memory)
    # --max-model-len is checked against the measured pool
    provisional = from_device and device_memory is None
    sized = (
        dataclasses.replace(
            config, scheduler=dataclasses.replace(config.scheduler, max_model_len=None)
        )
        if provisional
        else config
    )
    capacity = plan_kv_capacity(model_config, sized, dtype_bytes, num_blocks)
    per_token = family_named(model_config.family).encoder_bytes_per_token(model_config, dtype_bytes)
    encoder_tokens = (
        config.cache.encoder_cache_memory_bytes // per_token
        if config.cache.enable_encoder_cache
        else 0
    )
    graph_sizes, graphs_why = resolve_cuda_graphs(config, plan.device, plan.attention_backend)
    return ResolvedEngineConfig(
        config,
        plan,
        machine.cpu.summary(),
        threads.threads,
        threads.decode_threads,
        capacity,
        encoder_tokens,
        graph_sizes,
        graphs_why,
        device_memory if from_device else None,
    )
