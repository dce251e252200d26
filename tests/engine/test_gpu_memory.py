"""--gpu-memory-utilization (issue 39, deliverable 4): the KV pool from a device's memory. One pure function
(device_memory.kv_pool_from_device) does the arithmetic for both the engine's resolve step and `firsttoken plan
--memory`; here, on the CPU, its table of cases, the resolve step on an injected CUDA machine with injected device
facts giving plan's block count for the same inputs, and the engine's start-up order (load, profiling forward,
measure, resolve, allocate) driven with injected facts. The measurement on a real device is
tests/gpu/test_memory_cuda.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from firsttoken.cli.main import build_parser, main
from firsttoken.config import CacheConfig, EngineConfig, SchedulerConfig
from firsttoken.device_memory import DeviceMemory, DeviceMemoryTooSmall, KvPool, kv_pool_from_device
from firsttoken.engine.engine import LLMEngine
from firsttoken.engine.resolve import resolve_engine_config
from firsttoken.runner.executor import InProcessExecutor
from firsttoken.runner.profile import ProfileStep
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
    assert unmeasured.needs_device_memory and not resolved.needs_device_memory
    assert unmeasured.kv.num_blocks == GiB // (BF16_2B_TOKEN * 16)  # provisional until start-up measures the device
    # a --max-model-len that 1GiB would not hold is not refused before the device is measured
    long = EngineConfig(load_format="dummy", scheduler=SchedulerConfig(max_model_len=32768))
    assert resolve_engine_config(long, dummy_2b, machine.with_cuda(H200)).needs_device_memory


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


# ---- start-up's order: load -> profiling forward -> measure -> resolve -> allocate ---------------------------------

class OnTheCpu(InProcessExecutor):
    """The real executor with a cuda-resolved plan's model put on the CPU, recording start-up's calls."""

    calls: list[str]

    def __init__(self, model_dir, model_config, plan, *args, **kwargs) -> None:
        super().__init__(model_dir, model_config, dataclasses.replace(plan, device="cpu"), *args, **kwargs)
        self.calls = ["load"]
        self.steps: list[ProfileStep] = []

    def profile_step(self, step: ProfileStep) -> None:
        self.calls.append("profile")
        self.steps.append(step)
        super().profile_step(step)

    def allocate_kv_cache(self, num_blocks: int, cuda_graph_sizes: tuple[int, ...] = (),
                          max_model_len: int = 0) -> None:
        self.calls.append(f"allocate {num_blocks}")
        super().allocate_kv_cache(num_blocks, cuda_graph_sizes, max_model_len)


class InjectedDevice:
    """measure_device_memory's seam: runs load and profile in its order and reports the given facts."""

    def __init__(self, facts: DeviceMemory) -> None:
        self.facts = facts
        self.calls: list[str] = []

    def __call__(self, load, profile) -> DeviceMemory:
        load()
        self.calls.append("measured after load")
        profile()
        self.calls.append("measured peak")
        return self.facts


def tiny_plan(tiny_model_dir: Path, device: int, util: float, encoder: int, max_batched_tokens: int):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    inputs = PlanInputs(peak_concurrency=4, device_memory_bytes=device, memory_utilization=util, dtype="bfloat16",
                        encoder_cache_memory_bytes=encoder, max_batched_tokens=max_batched_tokens)
    return make_plan(config, inputs)


def cuda_engine(model_dir: Path, machine: Machine, device: InjectedDevice, config: EngineConfig,
                image_tokens: int = 64) -> LLMEngine:
    return LLMEngine(model_dir, config, tokenizer=None, machine=machine.with_cuda(H200), measure_memory=device,
                     profile_image_tokens=image_tokens, executor_factory=OnTheCpu)  # type: ignore[arg-type]


@pytest.mark.parametrize("device, util, encoder, max_batched_tokens", [
    (64 * MiB, 0.9, 4 * MiB, 256),
    (48 * MiB, 0.75, 0, 128),
])
def test_start_up_on_cuda_profiles_then_allocates_the_pool_plan_memory_computes(tiny_model_dir, machine, tmp_path,
                                                                                capsys, device, util, encoder,
                                                                                max_batched_tokens):
    """The engine on an injected CUDA machine, without --kv-cache-memory: the weights load, one profiling forward
    runs at the budgets' largest step (the real forward, on the CPU here), the injected device facts (plan's paper
    figures) are read, and the pool allocated is plan --memory's, through the library and the CLI."""
    plan = tiny_plan(tiny_model_dir, device, util, encoder, max_batched_tokens)
    probe = InjectedDevice(DeviceMemory(device, plan.weights_bytes, plan.workspace.peak_bytes))
    config = EngineConfig(
        cache=CacheConfig(gpu_memory_utilization=util, encoder_cache_memory_bytes=encoder,
                          enable_encoder_cache=encoder > 0),
        scheduler=SchedulerConfig(max_batched_tokens=max_batched_tokens, max_model_len=plan.max_model_len,
                                  max_num_seqs=8, step_time_target="off"))
    engine = cuda_engine(tiny_model_dir, machine, probe, config)
    executor = engine.executor
    assert isinstance(executor, OnTheCpu)
    assert executor.calls == ["load", "profile", f"allocate {plan.num_kv_blocks}"]
    assert probe.calls == ["measured after load", "measured peak"]
    assert executor.steps == [ProfileStep(num_tokens=max_batched_tokens, image_tokens=64, num_sampled_rows=8)]
    assert engine.resolved.model.device == "cuda" and engine.resolved.device_memory == probe.facts
    assert engine.resolved.kv.num_blocks == engine.scheduler.kv.num_blocks == plan.num_kv_blocks > 0
    assert executor.runner.kv_caches[0].shape[1] == plan.num_kv_blocks  # the tensors allocated
    assert engine.resolved.as_dict()["device_memory"]["profile_peak_bytes"] == plan.workspace.peak_bytes
    assert "device memory: " in engine.resolved.describe()

    cfg = tmp_path / "config.json"
    cfg.write_text((tiny_model_dir / "config.json").read_text())
    assert main(["plan", "--config", str(cfg), "--memory", str(device), "--gpu-memory-utilization", str(util),
                 "--peak-concurrency", "4", "--encoder-cache-memory", str(encoder), "--max-batched-tokens",
                 str(max_batched_tokens), "--dtype", "bfloat16", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["num_kv_blocks"] == engine.resolved.kv.num_blocks


@pytest.mark.parametrize("facts, scheduler, match", [
    (DeviceMemory(8 * MiB, 8 * MiB, 0), SchedulerConfig(), "^no room for a KV pool on the device: 8 MiB x 0.9"),
    (DeviceMemory(64 * MiB, 4 * MiB, 50 * MiB), SchedulerConfig(), "^no room for a KV pool on the device"),
    # 57.6 MiB usable - 4 - 4 - 512 MiB of encoder cache by default: nothing left
    (DeviceMemory(64 * MiB, 4 * MiB, 4 * MiB), SchedulerConfig(), "^no room"),
    (DeviceMemory(1024 * MiB, 4 * MiB, 4 * MiB), SchedulerConfig(max_model_len=2**22),
     "^the KV pool the device leaves holds .* fewer than the 262144 one max-length request needs"),
])
def test_a_device_that_leaves_no_pool_stops_start_up_in_one_line(tiny_model_dir, machine, facts, scheduler, match):
    config = EngineConfig(scheduler=scheduler)
    with pytest.raises(DeviceMemoryTooSmall, match=match) as err:
        cuda_engine(tiny_model_dir, machine, InjectedDevice(facts), config)
    assert "\n" not in str(err.value)


def test_on_the_cpu_start_up_neither_profiles_nor_measures(tiny_model_dir, machine):
    """The CPU path is unchanged: the weights load and the default 1GiB pool is allocated; the measuring seam and
    the profiling forward are never called."""

    def never(load, profile):
        raise AssertionError("the CPU path measured a device")

    calls: list[str] = []

    class Recording(InProcessExecutor):
        def profile_step(self, step: ProfileStep) -> None:
            calls.append("profile")

    engine = LLMEngine(tiny_model_dir, EngineConfig(), tokenizer=None,  # type: ignore[arg-type]
                       machine=machine.with_cuda(CudaFacts.absent("no CUDA (test)")), measure_memory=never,
                       executor_factory=Recording)
    assert calls == [] and engine.resolved.device_memory is None and not engine.resolved.needs_device_memory
    per_token = engine.resolved.kv.kv_bytes_per_token
    assert engine.resolved.kv.num_blocks == GiB // (per_token * 16)
    assert engine.executor.runner.kv_caches[0].shape[1] == engine.resolved.kv.num_blocks
