"""--quantization fp16: the language model's linear layers hold float16 weights (FBGEMM), activations float32. Not
exact, so its quality is checked against transformers' float32 forward on the oracle prompts: the same top-1 token
at (nearly) every prompt position, and the same greedy continuation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from firsttoken.models.loader import load_model
from firsttoken.models.quant import Fp16Linear
from tests.oracle import test_qwen2_vl_parity as parity
from tests.oracle.test_qwen2_vl_parity import (
    PROMPTS,
    TinyRunner,
    generate_ids,
    greedy_ids,
    make_prompt,
    max_diff,
    ref_logits,
)

ref = parity.ref  # the transformers float32 reference (a module fixture)


@pytest.fixture(scope="module")
def fp16(tiny_qwen2_vl_dir: Path):
    return load_model(tiny_qwen2_vl_dir, torch.float32, quantization="fp16")


def test_every_language_model_linear_is_float16_and_the_vision_tower_is_untouched(fp16, tiny_qwen2_vl_dir: Path):
    linears = [n for n, m in fp16.named_modules() if isinstance(m, nn.Linear)]
    packed = [n for n, m in fp16.named_modules() if isinstance(m, Fp16Linear)]
    assert linears and all(n.startswith("visual.") for n in linears)
    # 2 layers x (qkv, o, gate_up, down) + lm_head
    assert len(packed) == 2 * 4 + 1 and "lm_head" in packed
    exact = load_model(tiny_qwen2_vl_dir, torch.float32)
    pixels = torch.randn(16, exact.visual.patch_embed.proj.in_features)
    with torch.no_grad():
        assert torch.equal(fp16.visual(pixels, [(1, 4, 4)]), exact.visual(pixels, [(1, 4, 4)]))


@pytest.mark.parametrize("name", list(PROMPTS))
def test_fp16_weights_keep_the_top1_token_at_every_prompt_position(ref, fp16, name: str):
    prompt = make_prompt(fp16.config, PROMPTS[name], seed=6)
    runner = TinyRunner(fp16)
    got = runner.prefill(runner.add(prompt), chunk=32)
    expected = ref_logits(ref, fp16.config, prompt)
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    rel = max_diff(got, expected) / expected.abs().max().item()
    print(f"fp16 weights, {name} ({len(prompt.ids)} positions): top-1 agreement {agree:.4f}, "
          f"max|Δlogit| {max_diff(got, expected):.2e} ({rel:.1e} of the largest logit)")
    assert agree >= 0.99
    assert rel <= 1e-2


@pytest.mark.parametrize("name", ["text", "one_image"])
def test_fp16_greedy_decode_matches_generate(ref, fp16, name: str):
    prompt = make_prompt(fp16.config, PROMPTS[name], seed=3)
    assert greedy_ids(fp16, prompt, 32) == generate_ids(ref, fp16.config, prompt, 32)


def test_fp16_with_tied_embeddings_packs_a_float16_lm_head_and_keeps_lookups_float32(tiny_qwen2_vl_tied_dir: Path):
    from transformers import Qwen2VLForConditionalGeneration

    tied_ref = Qwen2VLForConditionalGeneration.from_pretrained(
        tiny_qwen2_vl_tied_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model = load_model(tiny_qwen2_vl_tied_dir, torch.float32, quantization="fp16")
    assert isinstance(model.lm_head, Fp16Linear) and model.embed_tokens.weight.dtype == torch.float32
    prompt = make_prompt(model.config, PROMPTS["one_image"], seed=4)
    runner = TinyRunner(model)
    got = runner.prefill(runner.add(prompt), chunk=32)
    expected = ref_logits(tied_ref, model.config, prompt)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.99


def test_fp16_refuses_bfloat16_activations(tiny_qwen2_vl_dir: Path):
    with pytest.raises(ValueError, match="float32"):
        load_model(tiny_qwen2_vl_dir, torch.bfloat16, quantization="fp16")


def test_the_one_thread_kernel_gives_the_same_logits(fp16, tiny_qwen2_vl_dir: Path):
    one = load_model(tiny_qwen2_vl_dir, torch.float32, quantization="fp16", num_threads=1)
    assert not one.lm_head.multithreaded and fp16.lm_head.multithreaded
    prompt = make_prompt(fp16.config, PROMPTS["one_image"], seed=7)
    a, b = TinyRunner(fp16), TinyRunner(one)
    assert torch.equal(a.prefill(a.add(prompt), chunk=32), b.prefill(b.add(prompt), chunk=32))
