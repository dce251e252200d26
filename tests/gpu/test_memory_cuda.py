"""--gpu-memory-utilization on a real device (issue 39, deliverable 4): measure_device_memory around the tiny model's
load and a profiling forward, the pool kv_blocks_from_device sizes from those facts allocated on the device, and
then at least (1 - utilization) of the device is still free. Not yet run on a GPU (it is only compiled here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from firsttoken.config import CacheConfig, EngineConfig
from firsttoken.device_memory import measure_device_memory
from firsttoken.engine.resolve import kv_blocks_from_device
from firsttoken.llm import LLM
from firsttoken.models.registry import load_model_config

SLACK = 64 * 2**20  # the caching allocator rounds its segments up (2 MiB small, 20 MiB large): what a peak may add


@pytest.mark.parametrize("utilization", [0.5, 0.8])
def test_the_pool_sized_from_the_device_leaves_one_minus_utilization_free(tiny_model_dir: Path,
                                                                         utilization: float) -> None:
    holder: dict[str, LLM] = {}

    def load() -> None:
        holder["llm"] = LLM(tiny_model_dir, device="cuda", dtype="float32", kv_cache_memory="16MiB")

    def profile() -> None:  # one forward of a 2,000-token prompt: the largest step serve's 2048-token budget runs
        result = holder["llm"].complete("hello " * 2000, {"temperature": 0, "max_tokens": 1})
        assert result.error is None

    facts = measure_device_memory(load, profile, 0)
    free, total = torch.cuda.mem_get_info(0)
    assert facts.total_bytes == total and facts.in_use_after_load_bytes > 0 and facts.profile_peak_bytes > 0
    config = EngineConfig(device="cuda", dtype="float32",
                          cache=CacheConfig(gpu_memory_utilization=utilization, enable_encoder_cache=False))
    model_config = load_model_config(tiny_model_dir)
    blocks = kv_blocks_from_device(model_config, config, 4, facts)
    pool_bytes = blocks * model_config.kv_bytes_per_token(4) * config.cache.block_size
    pool = torch.empty(pool_bytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize(0)
    free_after, _ = torch.cuda.mem_get_info(0)
    del pool
    assert free_after >= (1 - utilization) * total - SLACK, (facts, pool_bytes, free_after)


def test_start_up_measures_the_device_and_allocates_what_it_leaves(tiny_model_dir: Path) -> None:
    """The engine's own start-up on cuda without --kv-cache-memory: weights, one profiling forward at the budgets'
    largest step (2048 tokens, a 1280-token image), the facts measured, the pool that leaves allocated; afterwards at
    least (1 - utilization) of the device is free and requests are served."""
    import gc

    utilization = 0.3
    llm = LLM(tiny_model_dir, device="cuda", dtype="float32", gpu_memory_utilization=utilization)
    resolved = llm.engine.resolved
    facts = resolved.device_memory
    assert facts is not None and facts.in_use_after_load_bytes > 0 and facts.profile_peak_bytes > 0
    kv = llm.engine.executor.runner.kv_caches
    assert kv[0].shape[1] == resolved.kv.num_blocks  # sdpa: no graphs, so no scratch block
    torch.cuda.synchronize(0)
    free, total = torch.cuda.mem_get_info(0)
    assert free >= (1 - utilization) * total - SLACK, (facts, resolved.kv, free)
    out = llm.complete("hello " * 50, {"temperature": 0, "max_tokens": 4})
    assert out.error is None
    del llm, kv
    gc.collect()
    torch.cuda.empty_cache()
