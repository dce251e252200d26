"""--device and --load-format (issue 39): the device is settled once by the resolve step from a ``Machine`` value
(its ``CudaFacts``), so these run on any CPU with the CUDA device injected; dummy weights come from config.json
alone, so a published model's shape is built and checked here without its 4 GB of weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from firsttoken.attention.registry import get_backend
from firsttoken.config import CacheConfig, EngineConfig
from firsttoken.device_memory import DeviceMemory
from firsttoken.engine.resolve import resolve_engine_config
from firsttoken.loading.loader import dummy_tensor
from firsttoken.loading.plan_values import CudaFacts, Machine
from firsttoken.models.checkpoint import make_dummy_model
from firsttoken.models.registry import family_of, load_model_config
from firsttoken.models.recipe import TOKEN_IDS
from tests.helpers import CPU_CLASSES, cpu_features_of
from tests.published_configs import QWEN2_VL_2B

H200 = CudaFacts(True, name="NVIDIA H200 (injected)")
SMALL_KV = CacheConfig(kv_cache_memory_bytes=4 << 20)


@pytest.fixture(scope="module")
def machine() -> Machine:
    return Machine.detect(build_kernels=False)


@pytest.fixture(scope="module")
def dummy_tiny(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny checkpoint's config.json with the demo tokenizer and no weights."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return make_dummy_model(tmp_path_factory.mktemp("dummy-tiny"), config)


@pytest.fixture(scope="module")
def dummy_2b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2-VL-2B-Instruct's published shape (tests/unit/test_plan.py's config), no weights."""
    config = {**QWEN2_VL_2B, "architectures": ["Qwen2VLForConditionalGeneration"], "image_token_id": 151655,
              "vision_start_token_id": 151652, "vision_end_token_id": 151653, "eos_token_id": 151645}
    return make_dummy_model(tmp_path_factory.mktemp("dummy-2b"), config)


@pytest.mark.parametrize("cpu_class", CPU_CLASSES)
def test_auto_takes_the_cuda_device_the_machine_has_and_bf16_there(tiny_model_dir: Path, machine: Machine,
                                                                   cpu_class: str):
    """Beside any CPU: the CUDA device and bf16 on it; without one, the CPU's own dtype (float32 where the CPU has no
    native bf16, whose KV bytes per token are twice the GPU's)."""
    machine = machine.with_cpu(cpu_features_of(cpu_class))
    on_gpu = resolve_engine_config(EngineConfig(cache=SMALL_KV), tiny_model_dir, machine.with_cuda(H200))
    on_cpu = resolve_engine_config(EngineConfig(cache=SMALL_KV), tiny_model_dir,
                                   machine.with_cuda(CudaFacts.absent("no CUDA (test)")))
    assert (on_gpu.model.device, on_gpu.model.dtype, on_gpu.model.quantization) == ("cuda", "bfloat16", "none")
    assert on_cpu.model.device == "cpu" and on_cpu.model.device_why == "auto: no CUDA (test)"
    assert on_gpu.model.kernels_unused == "device cuda" and not on_gpu.model.sampler_kernels
    cpu_dtype = "bfloat16" if cpu_class in ("avx512-bf16", "amx") else "float32"
    assert on_cpu.model.dtype == cpu_dtype
    assert on_gpu.kv.kv_bytes_per_token * (2 if cpu_dtype == "float32" else 1) == on_cpu.kv.kv_bytes_per_token
    assert "device: cuda (auto: CUDA device NVIDIA H200 (injected))" in on_gpu.describe().splitlines()[2]
    served = json.loads(json.dumps(on_gpu.as_dict()))  # GET /v1/engine/config
    assert served["model"]["device"] == "cuda" and served["requested"]["device"] == "auto"
    explicit = resolve_engine_config(EngineConfig(device="cpu", cache=SMALL_KV), tiny_model_dir,
                                     machine.with_cuda(H200))
    assert explicit.model.device == "cpu" and explicit.model.device_why == "as asked"


def test_device_cuda_without_one_is_a_one_line_error(tiny_model_dir: Path, machine: Machine):
    with pytest.raises(ValueError, match=r"^device cuda: no CUDA device here: nothing plugged in$"):
        resolve_engine_config(EngineConfig(device="cuda"), tiny_model_dir,
                              machine.with_cuda(CudaFacts.absent("nothing plugged in")))
    with pytest.raises(ValueError, match="quantization int8 runs on the CPU only"):
        EngineConfig(device="cuda", quantization="int8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks a machine without CUDA")
def test_serve_device_cuda_here_exits_2_with_one_line():
    done = subprocess.run([sys.executable, "-m", "firsttoken.cli.main", "serve", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("firsttoken serve: --device cuda: no CUDA device here: ")


def test_dummy_weights_serve_a_request_from_config_json_alone(dummy_tiny: Path):
    from firsttoken.llm import LLM

    assert not list(dummy_tiny.glob("*.safetensors"))
    llm = LLM(dummy_tiny, load_format="dummy", device="cpu", kv_cache_memory="4MiB", num_threads=1)
    assert llm.engine.resolved.model.load_format == "dummy"
    runner = llm.engine.executor.runner
    assert runner.device == torch.device("cpu") and runner.kv_caches[0].device == runner.device
    ids = torch.arange(5)
    assert runner._to_device(ids) is ids  # the CPU path copies nothing
    out = llm.complete("The sky is", {"temperature": 0, "max_tokens": 6})
    assert out.usage.completion_tokens == 6
    again = LLM(dummy_tiny, load_format="dummy", device="cpu", kv_cache_memory="4MiB", num_threads=1)
    assert again.complete("The sky is", {"temperature": 0, "max_tokens": 6}).text == out.text  # seeded by name


def test_without_dummy_a_weightless_directory_is_refused(dummy_tiny: Path):
    from firsttoken.cli.serve_checks import check_checkpoint
    from firsttoken.cli.usage import UsageError

    with pytest.raises(UsageError, match="no \\*.safetensors"):
        check_checkpoint("--model", dummy_tiny)
    assert check_checkpoint("--model", dummy_tiny, weights=False).num_hidden_layers > 0


def test_a_published_shape_builds_on_meta_with_its_published_parameter_count(dummy_2b: Path, machine: Machine):
    config = load_model_config(dummy_2b)
    assert config.image_token_id == TOKEN_IDS["<|image_pad|>"]  # the demo tokenizer's placeholder
    with torch.device("meta"):
        model = family_of(dummy_2b).build(config, get_backend("sdpa"))
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == 2_208_985_600  # Qwen2-VL-2B-Instruct's (tied embeddings)
    for name, p in params.items():  # what --load-format dummy makes for each, without allocating
        made = dummy_tensor(name, p.shape, torch.bfloat16, "meta")
        assert made.shape == p.shape and made.dtype == torch.bfloat16
    # on cuda the pool comes from the device's memory (--gpu-memory-utilization): its facts are injected
    facts = DeviceMemory(total_bytes=141 * 2**30, in_use_after_load_bytes=6 * 2**30, profile_peak_bytes=2 * 2**30)
    resolved = resolve_engine_config(EngineConfig(load_format="dummy"), dummy_2b, machine.with_cuda(H200),
                                     device_memory=facts)
    assert (resolved.model.device, resolved.model.dtype, resolved.model.load_format) == ("cuda", "bfloat16", "dummy")
    assert resolved.kv.kv_bytes_per_token == 28 * 2 * 2 * 128 * 2  # layers x K,V x kv heads x head_dim x bf16


def test_the_triton_backend_is_a_cuda_option(tiny_model_dir: Path, machine: Machine):
    config = EngineConfig(attention_backend="triton", cache=SMALL_KV)
    on_gpu = resolve_engine_config(config, tiny_model_dir, machine.with_cuda(H200))
    assert on_gpu.model.attention_backend == "triton" and on_gpu.as_dict()["model"]["attention_backend"] == "triton"
    with pytest.raises(ValueError, match="^attention_backend triton runs on cuda only"):
        resolve_engine_config(config, tiny_model_dir, machine.with_cuda(CudaFacts.absent()))


def test_make_model_dummy_config_writes_a_weightless_directory_that_resolves(tmp_path: Path, machine: Machine):
    from firsttoken.cli.main import main

    config = tmp_path / "published.json"
    config.write_text(json.dumps({**QWEN2_VL_2B, "architectures": ["Qwen2VLForConditionalGeneration"]}))
    out = tmp_path / "qwen2-vl-2b-dummy"
    assert main(["make-model", str(out), "--dummy-config", str(config)]) == 0
    assert not list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()
    resolved = resolve_engine_config(EngineConfig(load_format="dummy", cache=SMALL_KV), out, machine)
    assert resolved.model.load_format == "dummy" and resolved.kv.max_model_len > 0
    assert main(["make-model", str(out), "--dummy-config", str(config)]) == 0  # its own output may be rewritten


def test_the_kernels_are_built_only_where_they_may_be_used():
    """Machine.for_flags: --cpu-kernels off and --device cuda build nothing (on cuda the kernels are never used);
    on this machine --device auto is the CPU, so the kernels are built as before."""
    assert Machine.for_flags("off", "cpu") is Machine.detect(build_kernels=False)
    assert Machine.for_flags("auto", "cuda") is Machine.detect(build_kernels=False)
    assert Machine.for_flags("auto", "cpu") is Machine.detect(build_kernels=True)
    expected = Machine.detect(build_kernels=not torch.cuda.is_available())
    assert Machine.for_flags("auto", "auto") is expected
