"""The one resolve step (engine/resolve.py): every ``auto`` settled once, from the flags, the checkpoint and the
machine it is given; the engine runs with exactly that, logs it once as one block, and serves it as plain JSON."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from firsttoken.config import CacheConfig, EngineConfig
from firsttoken.engine.engine import LLMEngine
from firsttoken.engine.resolve import resolve_engine_config
from firsttoken.inputs.processor import load_tokenizer
from firsttoken.models.checkpoint import make_model
from tests.conftest import require_program
from tests.helpers import CPU_CLASSES, machine_with_cpu

AVX2 = {"avx2", "fma"}
NATIVE_BF16 = AVX2 | {"avx512f", "avx512_bf16"}


@pytest.fixture(scope="module")
def bf16_published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint stored in bf16, as Qwen-VL checkpoints are published."""
    return make_model(tmp_path_factory.mktemp("bf16-published"), size="tiny", seed=3, dtype="bfloat16")


def test_dtype_auto_follows_the_cpu_and_the_kv_pool_follows_the_dtype(tiny_model_dir: Path):
    config = EngineConfig(cache=CacheConfig(kv_cache_memory_bytes=4 << 20))
    bf16 = resolve_engine_config(config, tiny_model_dir, machine_with_cpu(flags=NATIVE_BF16, vendor="AuthenticAMD"))
    fp32 = resolve_engine_config(config, tiny_model_dir, machine_with_cpu(flags=AVX2, vendor="AuthenticAMD"))
    assert (bf16.model.dtype, fp32.model.dtype) == ("bfloat16", "float32")
    assert "native bf16" in fp32.model.dtype_why and "in hardware" in bf16.model.dtype_why
    assert bf16.model.quantization == fp32.model.quantization == "none"  # a float32 checkpoint
    assert 2 * bf16.kv.kv_bytes_per_token == fp32.kv.kv_bytes_per_token  # the cache holds activations' dtype
    assert bf16.kv.num_blocks >= 2 * fp32.kv.num_blocks - 1
    assert bf16.encoder_cache_tokens >= 2 * fp32.encoder_cache_tokens - 1
    assert bf16.requested == fp32.requested == config  # the flags as given, beside what they became
    explicit = resolve_engine_config(EngineConfig(dtype="float32"), tiny_model_dir,
                                     machine_with_cpu(flags=NATIVE_BF16, vendor="AuthenticAMD"))
    assert explicit.model.dtype == "float32" and explicit.model.dtype_why == "as asked"


def test_quantization_auto_reads_the_checkpoint_and_the_kernels(bf16_published: Path, tiny_model_dir: Path):
    require_program("cc", "gcc", "gcc")  # the kernels that read bf16 weights are built with it
    machine = machine_with_cpu(flags=AVX2, vendor="AuthenticAMD")
    assert machine.kernels is not None
    auto = resolve_engine_config(EngineConfig(), bf16_published, machine)
    assert (auto.model.dtype, auto.model.quantization, auto.model.fused_decode) == ("float32", "bf16", None)
    assert resolve_engine_config(EngineConfig(), tiny_model_dir, machine).model.quantization == "none"
    without = resolve_engine_config(EngineConfig(), bf16_published, machine.without_kernels("no compiler (test)"))
    assert without.model.quantization == "none" and "no compiler (test)" in without.model.quantization_why
    assert "no compiler (test)" in without.model.fused_decode


# Per CPU class: --dtype auto on a float32 checkpoint, and what computes its decode products (the arithmetic named
# where the CPU decides it); a bf16 checkpoint under auto; the same checkpoint under --dtype float32.
FLOAT32_KERNELS = "firsttoken's few-rows AVX2 kernels"
BF16_DOT_PRODUCTS = "firsttoken's few-rows kernels: bf16 rows and weights, float32 sums rounded to bf16, as " \
                    "AVX512-BF16 dot products (bf16 denormals read as zero)"
BF16_WEIGHTS = "bf16 weights (each widened exactly to float32, float32 activations and sums: float32 inference's " \
               "arithmetic on every CPU): by firsttoken's kernels"
PER_CPU_CLASS = {  # class: (auto dtype, its products, a bf16 checkpoint's (quantization, products) under auto)
    "avx2": ("float32", FLOAT32_KERNELS, ("bf16", BF16_WEIGHTS)),
    "avx512": ("float32", "torch's (few-rows kernels not used: this CPU has AVX-512 (not AMD's)", ("bf16", BF16_WEIGHTS)),
    "avx512-bf16": ("bfloat16", BF16_DOT_PRODUCTS, ("none", BF16_DOT_PRODUCTS)),
    "amx": ("bfloat16", "torch's (few-rows kernels not used: bf16 products measured against torch's only",
            ("none", "torch's (few-rows kernels not used: bf16 products measured")),
}


@pytest.mark.parametrize("cpu_class", CPU_CLASSES)
def test_each_cpu_class_resolves_its_dtype_and_states_the_arithmetic_of_its_products(
        cpu_class: str, tiny_model_dir: Path, bf16_published: Path):
    """What each CPU class this project meets resolves, by injection, and the arithmetic its decode products compute
    stated where the choice is made (the start-up block and GET /v1/engine/config). A bf16 checkpoint run with float32
    activations keeps float32 inference's arithmetic on every class, AVX512-BF16 ones included: its rows are never
    rounded to bf16."""
    require_program("cc", "gcc", "gcc")  # the kernels the plan reads are built with it
    machine = machine_with_cpu(**CPU_CLASSES[cpu_class])
    dtype, products, (bf16_quantization, bf16_products) = PER_CPU_CLASS[cpu_class]
    config = EngineConfig(cache=CacheConfig(kv_cache_memory_bytes=4 << 20))
    float32_checkpoint = resolve_engine_config(config, tiny_model_dir, machine)
    assert (float32_checkpoint.model.dtype, float32_checkpoint.model.quantization) == (dtype, "none")
    assert float32_checkpoint.model.products.startswith(products)
    bf16_checkpoint = resolve_engine_config(config, bf16_published, machine)
    assert (bf16_checkpoint.model.dtype, bf16_checkpoint.model.quantization) == (dtype, bf16_quantization)
    assert bf16_checkpoint.model.products.startswith(bf16_products)
    as_float32 = resolve_engine_config(EngineConfig(dtype="float32", cache=config.cache), bf16_published, machine)
    assert (as_float32.model.dtype, as_float32.model.quantization) == ("float32", "bf16")
    assert as_float32.model.products == BF16_WEIGHTS
    served = json.loads(json.dumps(as_float32.as_dict()))  # GET /v1/engine/config
    assert served["model"]["products"] == BF16_WEIGHTS
    assert f"decode steps' products: {BF16_WEIGHTS}" in as_float32.describe()


def test_the_resolved_configuration_is_plain_json_and_one_line_per_choice(tiny_model_dir: Path):
    resolved = resolve_engine_config(EngineConfig(num_threads=2), tiny_model_dir,
                                     machine_with_cpu(flags=AVX2, vendor="AuthenticAMD"))
    served = json.loads(json.dumps(resolved.as_dict(), allow_nan=False))
    assert served["model"]["dtype"] == "float32" and served["num_threads"] == 2 and served["decode_threads"] == 1
    assert served["kv"]["num_tokens"] == resolved.kv.num_blocks * resolved.kv.block_size
    assert served["requested"]["dtype"] == "auto" and served["encoder_cache_tokens"] == resolved.encoder_cache_tokens
    head, *lines = resolved.describe().splitlines()
    assert head == "engine configuration:"
    assert [line.split(":")[0].strip() for line in lines] == [
        "cpu", "device", "weights", "dtype", "quantization", "decode steps' products", "decode steps' decoder layers",
        "float32 weights' layout", "threads", "cuda graphs", "KV cache", "encoder cache"]


def test_the_engine_runs_with_what_it_resolved_and_logs_it_once(tiny_model_dir: Path, caplog):
    machine = machine_with_cpu(flags=NATIVE_BF16, vendor="AuthenticAMD")
    config = EngineConfig(cpu_kernels="off", cache=CacheConfig(kv_cache_memory_bytes=16 << 20))
    with caplog.at_level(logging.INFO, logger="firsttoken"):
        engine = LLMEngine(tiny_model_dir, config, load_tokenizer(tiny_model_dir).backend_tokenizer, machine=machine)
    blocks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine configuration:")]
    assert blocks == [engine.resolved.describe()]
    resolved = engine.resolved
    assert resolved.model.dtype == "bfloat16" and engine.executor.runner.model.dtype == torch.bfloat16
    assert engine.executor.runner.kv_caches[0].dtype == torch.bfloat16
    assert engine.capacity == resolved.kv and engine.config is resolved.requested
    again = LLMEngine(tiny_model_dir, resolved, load_tokenizer(tiny_model_dir).backend_tokenizer, machine=machine)
    assert again.resolved is resolved  # an already resolved configuration is taken as it is


def test_cpu_kernels_off_neither_builds_nor_reads_the_kernels(tiny_model_dir: Path):
    """--cpu-kernels off uses none of firsttoken's kernels, so resolving it does not build them (no compiler run, no
    log line about them) and settles the same plan as on a machine where they are built."""
    import subprocess
    import sys

    from firsttoken.loading.plan_values import Machine

    off = EngineConfig(cpu_kernels="off")
    assert Machine.detect(build_kernels=False).kernels is None
    plans = {resolve_engine_config(off, tiny_model_dir, m).model for m in (Machine.detect(build_kernels=False),
                                                                           Machine.detect())}
    assert len(plans) == 1 and next(iter(plans)).kernels_unused == "--cpu-kernels off"
    probe = ("import sys; from firsttoken.config import EngineConfig; from firsttoken.kernels import cpu_linear; "
             "from firsttoken.engine.resolve import resolve_engine_config; "
             "resolve_engine_config(EngineConfig(cpu_kernels='off'), sys.argv[1]); "
             "print(cpu_linear._kernel.cache_info().currsize)")
    done = subprocess.run([sys.executable, "-c", probe, str(tiny_model_dir)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"]  # the kernels were never asked for
