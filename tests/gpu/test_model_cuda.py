"""The engine on --device cuda: the tiny model in fp32 gives the CPU's greedy tokens, and a published shape with
--load-format dummy (weights drawn on the device) serves requests in bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from firsttoken.llm import LLM
from firsttoken.models.checkpoint import make_dummy_model
from tests.published_configs import QWEN2_VL_2B

PROMPTS = ["The capital of France is", "Count: one, two, three,", "A"]


def greedy(llm: LLM, prompts: list[str] = PROMPTS) -> list[tuple[int, ...]]:
    """Each prompt's greedy tokens (up to 24), the requests run one at a time; a failed request fails the test."""
    results = [llm.complete(p, {"temperature": 0, "max_tokens": 24}) for p in prompts]
    assert [r.error for r in results] == [None] * len(prompts)
    assert all(r.token_ids for r in results)
    return [r.token_ids for r in results]


def test_tiny_model_fp32_on_cuda_gives_the_cpus_greedy_tokens(tiny_model_dir: Path) -> None:
    on_cpu = LLM(tiny_model_dir, device="cpu", dtype="float32", cpu_kernels="off", kv_cache_memory="16MiB")
    on_gpu = LLM(tiny_model_dir, device="cuda", dtype="float32", kv_cache_memory="16MiB")
    assert on_gpu.engine.resolved.model.device == "cuda"
    assert next(on_gpu.engine.executor.runner.model.parameters()).device.type == "cuda"
    assert on_gpu.engine.executor.runner.kv_caches[0].device.type == "cuda"
    assert greedy(on_gpu) == greedy(on_cpu)


def test_auto_is_cuda_and_bf16_here(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, kv_cache_memory="16MiB")
    assert (llm.engine.resolved.model.device, llm.engine.resolved.model.dtype) == ("cuda", "bfloat16")
    greedy(llm)


@pytest.mark.parametrize("config", [QWEN2_VL_2B], ids=["qwen2-vl-2b"])
def test_dummy_weights_of_a_published_shape_serve_on_the_device(tmp_path: Path, config: dict) -> None:
    full = {**config, "architectures": ["Qwen2VLForConditionalGeneration"]}
    model_dir = make_dummy_model(tmp_path / "dummy", json.loads(json.dumps(full)))
    llm = LLM(model_dir, load_format="dummy", kv_cache_memory="1GiB")
    assert llm.engine.resolved.model.load_format == "dummy"
    weights = llm.engine.executor.runner.model.parameters()
    assert sum(p.numel() for p in weights) == 2_208_985_600
    assert torch.cuda.memory_allocated() > 4 * 10**9  # 2.2 B bf16 parameters are on the device
    greedy(llm)


def test_an_image_request_on_cuda_gives_the_cpus_greedy_tokens(tiny_model_dir: Path) -> None:
    """The vision tower on the device (pixels copied through pinned memory) and its rows in the prefill."""
    from PIL import Image

    image = Image.new("RGB", (96, 64))
    image.putdata([((x * 7) % 256, (y * 11) % 256, ((x + y) * 5) % 256) for y in range(64) for x in range(96)])
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "What is this?"}]}]
    tokens = {}
    for device in ("cpu", "cuda"):
        llm = LLM(tiny_model_dir, device=device, dtype="float32", cpu_kernels="off", kv_cache_memory="16MiB")
        out = llm.chat(messages, {"temperature": 0, "max_tokens": 16})
        assert out.error is None and out.usage.prompt_tokens > 20
        tokens[device] = out.token_ids
    assert tokens["cuda"] == tokens["cpu"]


def test_the_triton_backend_gives_the_sdpa_backends_greedy_tokens(tiny_model_dir: Path) -> None:
    """--attention-backend triton in the engine (chunked prefill, mixed and pure-decode steps) on the device, fp32."""
    runs = {}
    for backend in ("sdpa", "triton"):
        llm = LLM(tiny_model_dir, device="cuda", dtype="float32", attention_backend=backend, kv_cache_memory="16MiB",
                  max_batched_tokens=16)  # the long prompt prefills in chunks of at most 16 tokens
        assert llm.engine.resolved.model.attention_backend == backend
        runs[backend] = greedy(llm, [*PROMPTS, "one two three four five six seven " * 8])
    assert runs["triton"] == runs["sdpa"]
