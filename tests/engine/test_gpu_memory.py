"""--gpu-memory-utilization (issue 39, deliverable 4): the KV pool from a device's memory. One pure function
(device_memory.kv_pool_from_device) does the arithmetic for both the engine's resolve step and `firsttoken plan
--memory`; here, on the CPU, its table of cases, and the resolve step on an injected CUDA machine with injected device
facts giving plan's block count for the same inputs. The measurement on a real device is tests/gpu/test_memory_cuda.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from firsttoken.cli.main import build_parser, main
from firsttoken.config import CacheConfig, EngineConfig, SchedulerConfig
from firsttoken.device_memory import DeviceMemory, DeviceMemoryTooSmall, KvPool, kv_pool_from_device
from firsttoken.engine.resolve import resolve_engine_config
from firsttoken.loading.plan_values import CudaFacts, Machine
from firsttoken.models.checkpoint import make_dummy_model
from firsttoken.tools.plan import PlanInputs, make_plan
from tests.published_configs import QWEN2_VL_2B

GiB, MiB = 2**30, 2**20
H200 = CudaFacts(True, name="NVIDIA H200 (injected)")
BF16_2B_TOKEN = 28 * 2 * 2 * 128 * 2  # Qwen2-VL-2B's KV bytes per token in bf16 (14,336)


@pytest.mark.parametrize("total, util, in_use, peak, encoder, per_token, block, expected", [
    # usable 90 GiB - 10 - 5 - 1 = 74 GiB, whole MiB; 74 GiB // (1 KiB x 16)
    (100 * GiB, 0.9, 10 * GiB, 5 * GiB, 1 * GiB, 1024, 16,
     KvPool(int(100 * GiB * 0.9), int(100 * GiB * 0.9) - 16 * GiB, int(100 * GiB * 0.9) // MiB * MiB - 16 * GiB,
            (int(100 * GiB * 0.9) // MiB * MiB - 16 * GiB) // (1024 * 16))),
    # utilization 1: all of it; no encoder cache
    (8 * GiB, 1.0, 2 * GiB, 1 * GiB, 0, 2048, 16, KvPool(8 * GiB, 5 * GiB, 5 * GiB, 5 * GiB // (2048 * 16))),
    # free is rounded down to a whole MiB before it is cut into blocks
    (64 * MiB + 123, 1.0, 0, 0, 0, 4096, 16, KvPool(64 * MiB + 123, 64 * MiB + 123, 64 * MiB, 1024)),
    # under a MiB the pool is whole blocks
    (3 * 65536 + 10, 1.0, 0, 0, 0, 4096, 16, KvPool(3 * 65536 + 10, 3 * 65536 + 10, 3 * 65536, 3)),
    # Qwen2-VL-2B in bf16 on an H200 (141 GiB) at 0.9: 6 GiB in use, 2 GiB peak, 512 MiB encoder cache
    (141 * GiB, 0.9, 6 * GiB, 2 * GiB, 512 * MiB, BF16_2B_TOKEN, 16,
     KvPool(int(141 * GiB * 0.9), int(141 * GiB * 0.9) - 8 * GiB - 512 * MiB,
            (int(141 * GiB * 0.9) - 8 * GiB - 512 * MiB) // MiB * MiB,
            (int(141 * GiB * 0.9) - 8 * GiB - 512 * MiB) // MiB * MiB // (BF16_2B_TOKEN * 16))),
])
def test_the_pool_is_what_utilization_leaves(total, util, in_use, peak, encoder, per_token, block, expected):
    got = kv_pool_from_device(total, util, in_use, peak, encoder, per_token, block)
    assert got == expected
    assert all(isinstance(v, int) for v in got)  # ints out
    assert got.pool_bytes <= got.free_bytes and got.num_blocks * per_token * block <= got.pool_bytes


@pytest.mark.parametrize("args, match", [
    ((1, 0.5, 0, 0, 0, 1, 16), "^no room for a KV pool on the device"),  # usable = int(0.5) = 0
    ((10 * GiB, 0.5, 5 * GiB, 0, 0, 1024, 16), "^no room for a KV pool"),  # the weights take all of usable
    ((10 * GiB, 0.9, 8 * GiB, 1 * GiB, 0, 1024, 16), "^no room for a KV pool"),  # the peak takes the rest (-1 GiB)
    ((10 * GiB, 0.9, 8 * GiB, 0, 1 * GiB - 16 * 1024 + 1, 1024, 16), "^no room"),  # one byte short of one block
    ((10 * GiB, 0.9, 8 * GiB, 0, 0, 1024, 16, 10**6), "^the KV pool the device leaves holds 65536 blocks .* fewer "
                                                          "than the 1000000 one max-length request needs"),
])
def test_a_device_that_leaves_no_pool_is_a_one_line_error(args, match):
    with pytest.raises(DeviceMemoryTooSmall, match=match) as err:
        kv_pool_from_device(*args)
    assert "\n" not in str(err.value)


def test_one_block_exactly_fits_and_utilization_is_checked():
    assert kv_pool_from_device(10 * GiB, 0.9, 8 * GiB, 0, 1 * GiB - 16 * 1024, 1024, 16).num_blocks == 1
    for util in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be > 0 and <= 1"):
            kv_pool_from_device(GiB, util, 0, 0, 0, 1024, 16)
    with pytest.raises(ValueError, match="^gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=0)
    with pytest.raises(ValueError):
        DeviceMemory(0, 0, 0)


@pytest.fixture(scope="module")
def dummy_2b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {**QWEN2_VL_2B, "architectures": ["Qwen2VLForConditionalGeneration"], "image_token_id": 151655,
              "vision_start_token_id": 151652, "vision_end_token_id": 151653, "eos_token_id": 151645}
    return make_dummy_model(tmp_path_factory.mktemp("dummy-2b"), config)


@pytest.fixture(scope="module")
def machine() -> Machine:
    return Machine.detect(build_kernels=False)


@pytest.mark.parametrize("device, util, encoder, max_batched_tokens", [
    (80 * GiB, 0.9, 512 * MiB, 2048),
    (141 * GiB, 0.9, 512 * MiB, 8192),
    (24 * GiB, 0.75, 1 * GiB, 4096),
    (16 * GiB, 1.0, 0, 2048),
])
def test_the_engine_sizes_the_pool_plan_memory_reports(dummy_2b, machine, tmp_path, capsys, device, util, encoder,
                                                        max_batched_tokens):
    """The issue's test: for the same device, utilization and budgets, with the device facts being plan's paper
    figures (in use after load = its weights, the profiling peak = its step workspace), the resolve step on an
    injected CUDA machine gives plan --memory's block count, through the library and through the CLI."""
    inputs = PlanInputs(peak_concurrency=8, device_memory_bytes=device, memory_utilization=util, dtype="bfloat16",
                        encoder_cache_memory_bytes=encoder, max_batched_tokens=max_batched_tokens)
    plan = make_plan(QWEN2_VL_2B, inputs)
    facts = DeviceMemory(total_bytes=device, in_use_after_load_bytes=plan.weights_bytes,
                         profile_peak_bytes=plan.workspace.peak_bytes)
    config = EngineConfig(
        load_format="dummy",
        cache=CacheConfig(gpu_memory_utilization=util, encoder_cache_memory_bytes=encoder),
        scheduler=SchedulerConfig(max_batched_tokens=max_batched_tokens, max_model_len=plan.max_model_len))
    resolved = resolve_engine_config(config, dummy_2b, machine.with_cuda(H200), device_memory=facts)
    assert resolved.model.device == "cuda" and resolved.kv.kv_bytes_per_token == plan.kv_bytes_per_token
    assert resolved.kv.num_blocks == plan.num_kv_blocks > 0

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN2_VL_2B))
    assert main(["plan", "--config", str(cfg), "--memory", str(device), "--gpu-memory-utilization", str(util),
                 "--peak-concurrency", "8", "--encoder-cache-memory", str(encoder), "--max-batched-tokens",
                 str(max_batched_tokens), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["num_kv_blocks"] == resolved.kv.num_blocks


def test_a_pool_short_of_one_max_length_request_stops_start_up(dummy_2b, machine):
    config = EngineConfig(load_format="dummy", scheduler=SchedulerConfig(max_model_len=32768))
    facts = DeviceMemory(total_bytes=8 * GiB, in_use_after_load_bytes=6 * GiB, profile_peak_bytes=512 * MiB)
    # 7.2 GiB usable - 6.5 GiB - 512 MiB encoder cache = ~205 MiB: 936 blocks of 16, under 32768 / 16 = 2048
    with pytest.raises(ValueError, match="fewer than the 2048 one max-length request needs"):
        resolve_engine_config(config, dummy_2b, machine.with_cuda(H200), device_memory=facts)


def test_on_cuda_a_given_kv_cache_memory_wins_and_an_unmeasured_device_keeps_the_default_pool(dummy_2b, machine):
    given = EngineConfig(load_format="dummy", cache=CacheConfig(kv_cache_memory_bytes=GiB, gpu_memory_utilization=0.5))
    facts = DeviceMemory(total_bytes=141 * GiB, in_use_after_load_bytes=6 * GiB, profile_peak_bytes=2 * GiB)
    resolved = resolve_engine_config(given, dummy_2b, machine.with_cuda(H200), device_memory=facts)
    assert resolved.kv.num_blocks == GiB // (BF16_2B_TOKEN * 16)
    unmeasured = resolve_engine_config(EngineConfig(load_format="dummy"), dummy_2b, machine.with_cuda(H200))
    assert unmeasured.kv.num_blocks == GiB // (BF16_2B_TOKEN * 16)  # 1GiB until start-up measures the device


def test_on_the_cpu_the_flag_changes_nothing(tiny_model_dir: Path, machine: Machine):
    cpu = machine.with_cuda(CudaFacts.absent("no CUDA (test)"))
    facts = DeviceMemory(total_bytes=141 * GiB, in_use_after_load_bytes=6 * GiB, profile_peak_bytes=2 * GiB)
    blocks = set()
    for util in (0.9, 0.5, 1.0):
        for kv in (None, GiB):  # not given is 1GiB on the CPU, as before
            config = EngineConfig(cache=CacheConfig(kv_cache_memory_bytes=kv, gpu_memory_utilization=util))
            resolved = resolve_engine_config(config, tiny_model_dir, cpu, device_memory=facts)
            assert resolved.model.device == "cpu"
            blocks.add(resolved.kv.num_blocks)
    per_token = resolved.kv.kv_bytes_per_token
    assert blocks == {GiB // (per_token * 16)}


def test_serve_help_lists_the_flag_and_its_default():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = " ".join(serve.format_help().split())
    entry = text.split("--gpu-memory-utilization X ")[-1]  # its help entry (the usage line has "X]")
    entry = entry.split("--no-prefix-cache")[0]
    assert entry.startswith("share of the CUDA device's memory") and "(default: 0.9)" in entry
    kv_entry = text.split("--kv-cache-memory SIZE ")[-1].split("--gpu-memory-utilization X ")[0]
    assert "default: 1GiB on the CPU" in kv_entry
