"""--quantization fp16: the language model's linear layers hold float16 weights (FBGEMM), activations float32. Not
exact, so its quality is checked against transformers' float32 forward on the oracle prompts: the same top-1 token
at (nearly) every prompt position, and the same greedy continuation.

--quantization int8: the linear layers of the language model and the vision tower hold per-row int8 weights, each
input row is quantized with its own scale, products are exact int32. Checked the same way, with the bounds this
2-layer, 64-wide checkpoint meets (its top-1 agreement is 97-98% per prompt: its logits have a median top-1/top-2 gap
of ~1.5 and int8 moves the largest logit by ~1.5%); docs/performance.md has the `small` checkpoint's figures. And the
arithmetic: a row's outputs are bitwise the same whichever path computes them (the few-rows kernel, torch._int_mm,
the torch twins of the kernels) and whatever shares the product."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from firsttoken.kernels import cpu_linear
from firsttoken.kernels.cpu_features import CpuFeatures
from firsttoken.loading import quant
from firsttoken.loading.fused_decode import FusedDecode
from firsttoken.loading.loader import load_model, stored_linear_dtypes
from firsttoken.loading.load_plan import plan_model
from firsttoken.loading.plan_values import Machine
from firsttoken.loading.quant import Bf16Weights, Fp16Weights, Int8Weights, dequantize_rows, quantize_rows
from firsttoken.models.checkpoint import make_model
from firsttoken.models.decode import EAGER
from firsttoken.models.linear import Linear
from tests.conftest import require_program
from tests.helpers import layers_with, torch_layers
from tests.oracle.parity import (
    PROMPTS,
    TinyRunner,
    generate_ids,
    greedy_ids,
    make_prompt,
    max_diff,
    ref_logits,
)


@pytest.fixture(scope="module")
def ref(tiny_qwen2_vl_dir: Path):
    """The transformers float32 reference."""
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(
        tiny_qwen2_vl_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _against_transformers(ref, model, name: str, label: str) -> tuple[float, float]:
    """The oracle prompt's prefill logits against transformers' float32 ones: (top-1 agreement over its positions,
    max |Δlogit| / the largest logit), printed."""
    prompt = make_prompt(model.config, PROMPTS[name], seed=6)
    runner = TinyRunner(model)
    got = runner.prefill(runner.add(prompt), chunk=32)
    expected = ref_logits(ref, model.config, prompt)
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    rel = max_diff(got, expected) / expected.abs().max().item()
    print(f"{label}, {name} ({len(prompt.ids)} positions): top-1 agreement {agree:.4f}, "
          f"max|Δlogit| {max_diff(got, expected):.2e} ({rel:.1e} of the largest logit)")
    return agree, rel


def _assert_the_vision_tower_is_float32s(model, model_dir: Path) -> None:
    exact = load_model(model_dir, torch.float32)
    pixels = torch.randn(16, exact.visual.patch_embed.proj.in_features)
    with torch.no_grad():
        assert torch.equal(model.visual(pixels, [(1, 4, 4)]).main, exact.visual(pixels, [(1, 4, 4)]).main)


@pytest.fixture(scope="module")
def fp16(tiny_qwen2_vl_dir: Path):
    return load_model(tiny_qwen2_vl_dir, torch.float32, quantization="fp16")


def test_every_language_model_linear_is_float16_and_the_vision_tower_is_untouched(fp16, tiny_qwen2_vl_dir: Path):
    linears = torch_layers(fp16)
    packed = list(layers_with(fp16, Fp16Weights))
    assert linears and all(n.startswith("visual.") for n in linears)
    # 2 layers x (qkv, o, gate_up, down) + lm_head
    assert len(packed) == 2 * 4 + 1 and "lm_head" in packed
    _assert_the_vision_tower_is_float32s(fp16, tiny_qwen2_vl_dir)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_fp16_weights_keep_the_top1_token_at_every_prompt_position(ref, fp16, name: str):
    agree, rel = _against_transformers(ref, fp16, name, "fp16 weights")
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
    assert isinstance(model.lm_head.method, Fp16Weights) and model.embed_tokens.weight.dtype == torch.float32
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
    assert not one.lm_head.method.multithreaded and fp16.lm_head.method.multithreaded
    prompt = make_prompt(fp16.config, PROMPTS["one_image"], seed=7)
    a, b = TinyRunner(fp16), TinyRunner(one)
    assert torch.equal(a.prefill(a.add(prompt), chunk=32), b.prefill(b.add(prompt), chunk=32))


# ---------------------------------------------------------------- bf16 weights, float32 activations


@pytest.fixture(scope="module")
def bf16w(tiny_qwen2_vl_dir: Path, kernel_built):
    return load_model(tiny_qwen2_vl_dir, torch.float32, quantization="bf16")


def _bf16_checkpoint(model_dir: Path, cpu_kernels: str = "off") -> nn.Module:
    """The float32 model whose language-model linear weights hold bf16 values: what float32 inference of a checkpoint
    published in bf16 computes with."""
    model = load_model(model_dir, torch.float32, cpu_kernels=cpu_kernels)
    with torch.no_grad():
        for name, sub in model.named_modules():
            if isinstance(sub, nn.Linear) and not name.startswith("visual."):
                sub.weight.copy_(sub.weight.to(torch.bfloat16).float())
    return model


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_qwen2_vl_dir: Path):
    return _bf16_checkpoint(tiny_qwen2_vl_dir)


def test_every_language_model_linear_holds_bf16_weights_and_the_rest_stays_float32(bf16w, tiny_qwen2_vl_dir: Path):
    linears = torch_layers(bf16w)
    halves = layers_with(bf16w, Bf16Weights)
    assert linears and all(n.startswith("visual.") for n in linears)
    assert len(halves) == 2 * 4 + 1 and "lm_head" in halves  # 2 layers x (qkv, o, gate_up, down) + lm_head
    assert all(m.weight.dtype == torch.bfloat16 and m.weight.is_contiguous() for m in halves.values())
    assert all(m.bias is None or m.bias.dtype == torch.float32 for m in halves.values())
    assert bf16w.embed_tokens.weight.dtype == torch.float32 and bf16w.norm.weight.dtype == torch.float32
    _assert_the_vision_tower_is_float32s(bf16w, tiny_qwen2_vl_dir)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_bf16_weights_compute_what_float32_computes_on_a_bf16_checkpoint(bf16w, bf16_checkpoint, name: str):
    """For a checkpoint whose weights are bf16 values, bf16 storage changes nothing but the order of float32 sums:
    prefill (weights widened for torch's product) and the decode steps (the kernels, the fused layers) give the
    float32 model's logits to rounding and its greedy tokens."""
    prompt = make_prompt(bf16w.config, PROMPTS[name], seed=6)
    a, b = TinyRunner(bf16w), TinyRunner(bf16_checkpoint)
    got, want = a.prefill(a.add(prompt), chunk=32), b.prefill(b.add(prompt), chunk=32)
    assert max_diff(got, want) <= 1e-5 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    steps = bf16w.decode.steps
    assert greedy_ids(bf16w, prompt, 24) == greedy_ids(bf16_checkpoint, prompt, 24)
    assert bf16w.decode.steps > steps  # the decode steps took the fused layers


@pytest.mark.parametrize("name", list(PROMPTS))
def test_bf16_weights_of_a_float32_checkpoint_keep_the_top1_token(ref, bf16w, name: str):
    """A float32 checkpoint's weights are rounded to bf16: close to transformers' float32 forward, not equal."""
    agree, rel = _against_transformers(ref, bf16w, name, "bf16 weights")
    assert agree >= 0.99
    assert 0 < rel <= 1e-2


def test_bf16_weights_without_the_kernels_give_the_same_tokens(bf16w, tiny_qwen2_vl_dir: Path):
    off = load_model(tiny_qwen2_vl_dir, torch.float32, quantization="bf16", cpu_kernels="off")
    assert off.decode is EAGER and off.lm_head.method.kernels is None
    prompt = make_prompt(off.config, PROMPTS["one_image"], seed=8)
    a, b = TinyRunner(bf16w), TinyRunner(off)
    got, want = a.prefill(a.add(prompt), chunk=32), b.prefill(b.add(prompt), chunk=32)
    assert max_diff(got, want) <= 1e-5 * want.abs().max().item()
    assert greedy_ids(bf16w, prompt, 16) == greedy_ids(off, prompt, 16)


def test_bf16_weights_with_tied_embeddings_get_a_bf16_lm_head_and_keep_lookups_float32(tiny_qwen2_vl_tied_dir: Path,
                                                                                         kernel_built):
    model = load_model(tiny_qwen2_vl_tied_dir, torch.float32, quantization="bf16")
    assert isinstance(model.lm_head.method, Bf16Weights) and model.lm_head.weight.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == torch.float32
    assert isinstance(model.decode, FusedDecode) and model.decode.head is model.lm_head
    rows = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = rows @ model.embed_tokens.weight.to(torch.bfloat16).float().T
        torch.testing.assert_close(model.lm_head(rows), want, rtol=1e-5, atol=1e-5)  # the kernel: 3 rows
        torch.testing.assert_close(model.lm_head(rows.repeat(8, 1)), want.repeat(8, 1), rtol=1e-5, atol=1e-5)


def test_bf16_weights_refuse_bfloat16_activations(tiny_qwen2_vl_dir: Path):
    with pytest.raises(ValueError, match="float32"):
        load_model(tiny_qwen2_vl_dir, torch.bfloat16, quantization="bf16")


@pytest.fixture(scope="module")
def bf16_published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint stored in bf16, as Qwen-VL checkpoints are published."""
    return make_model(tmp_path_factory.mktemp("bf16-published"), size="tiny", seed=2, dtype="bfloat16")


def test_auto_takes_bf16_weights_only_for_a_bf16_checkpoint_with_float32_activations(
        bf16_published: Path, tiny_qwen2_vl_dir: Path, kernel_built):
    assert stored_linear_dtypes(bf16_published) == {"BF16"} and stored_linear_dtypes(tiny_qwen2_vl_dir) == {"F32"}

    def auto_plan(model_dir: Path, dtype: str, cpu_kernels: str = "auto"):
        return plan_model(model_dir, dtype, "auto", cpu_kernels, Machine.detect())

    assert auto_plan(bf16_published, "float32").quantization == "bf16"
    auto = load_model(bf16_published, torch.float32, quantization="auto")
    assert isinstance(auto.lm_head.method, Bf16Weights) and len(layers_with(auto, Bf16Weights)) == 2 * 4 + 1
    assert isinstance(auto.decode, FusedDecode) and auto.embed_tokens.weight.dtype == torch.float32
    # a float32 checkpoint, bf16 activations, or no kernels: the weights stay in the model's dtype
    assert auto_plan(tiny_qwen2_vl_dir, "float32").quantization == "none"
    assert not layers_with(load_model(tiny_qwen2_vl_dir, torch.float32, quantization="auto"), Bf16Weights)
    as_bf16 = load_model(bf16_published, torch.bfloat16, quantization="auto")
    assert auto_plan(bf16_published, "bfloat16").quantization == "none"
    assert not layers_with(as_bf16, Bf16Weights) and as_bf16.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert auto_plan(bf16_published, "float32", cpu_kernels="off").quantization == "none"
    off = load_model(bf16_published, torch.float32, quantization="auto", cpu_kernels="off")
    assert not layers_with(off, Bf16Weights) and off.lm_head.weight.dtype == torch.float32


def test_auto_on_a_bf16_checkpoint_is_float32_inference_of_it(bf16_published: Path, kernel_built):
    """transformers' float32 forward of the bf16 checkpoint (its weights widened) against --quantization auto's
    (the same weights kept bf16, float32 sums): the same logits to rounding, the same greedy continuation."""
    from transformers import Qwen2VLForConditionalGeneration

    ref32 = Qwen2VLForConditionalGeneration.from_pretrained(bf16_published, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    auto = load_model(bf16_published, torch.float32, quantization="auto")
    for name in ("text", "one_image"):
        prompt = make_prompt(auto.config, PROMPTS[name], seed=6)
        runner = TinyRunner(auto)
        got = runner.prefill(runner.add(prompt), chunk=32)
        want = ref_logits(ref32, auto.config, prompt)
        assert max_diff(got, want) <= 1e-4 * want.abs().max().item(), name
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert greedy_ids(auto, prompt, 24) == generate_ids(ref32, auto.config, prompt, 24)


# ---------------------------------------------------------------- int8


@pytest.fixture(scope="module")
def int8(tiny_qwen2_vl_dir: Path):
    return load_model(tiny_qwen2_vl_dir, torch.float32, quantization="int8")


def test_every_linear_but_the_patch_embedding_is_int8_in_both_towers(int8, tiny_qwen2_vl_dir: Path):
    exact = load_model(tiny_qwen2_vl_dir, torch.float32)
    linears = [n for n, m in exact.named_modules() if isinstance(m, nn.Linear)]
    packed = list(layers_with(int8, Int8Weights))
    left = torch_layers(int8)
    assert left == ["visual.patch_embed.proj"]  # the towers read its weight's dtype
    assert sorted(packed) == sorted(set(linears) - set(left))
    # 2 LM layers x (qkv, o, gate_up, down) + lm_head; vision: 4 blocks x (qkv, proj, fc1, fc2) + the merger's 2
    assert len([n for n in packed if not n.startswith("visual.")]) == 2 * 4 + 1
    assert len([n for n in packed if n.startswith("visual.")]) == exact.config.vision.depth * 4 + 2
    assert int8.embed_tokens.weight.dtype == torch.float32  # lookups stay float32


def test_int8_vision_tower_is_close_to_float32_but_not_equal(int8, tiny_qwen2_vl_dir: Path):
    exact = load_model(tiny_qwen2_vl_dir, torch.float32)
    pixels = torch.randn(64, exact.visual.patch_embed.proj.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = int8.visual(pixels, [(1, 8, 8)]).main, exact.visual(pixels, [(1, 8, 8)]).main
    rel = max_diff(got, want) / want.abs().max().item()
    print(f"int8 vision tower: max|Δ| {max_diff(got, want):.2e} ({rel:.1e} of the largest output)")
    assert got.shape == want.shape and not torch.equal(got, want)
    assert rel <= 5e-2


@pytest.mark.parametrize("name", list(PROMPTS))
def test_int8_weights_keep_the_top1_token_at_most_prompt_positions(ref, int8, name: str):
    agree, rel = _against_transformers(ref, int8, name, "int8 weights")
    assert agree >= 0.9
    assert rel <= 5e-2


def test_int8_with_tied_embeddings_packs_an_int8_lm_head_and_keeps_lookups_float32(tiny_qwen2_vl_tied_dir: Path):
    from transformers import Qwen2VLForConditionalGeneration

    tied_ref = Qwen2VLForConditionalGeneration.from_pretrained(
        tiny_qwen2_vl_tied_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model = load_model(tiny_qwen2_vl_tied_dir, torch.float32, quantization="int8")
    assert isinstance(model.lm_head.method, Int8Weights) and model.embed_tokens.weight.dtype == torch.float32
    prompt = make_prompt(model.config, PROMPTS["one_image"], seed=4)
    runner = TinyRunner(model)
    got = runner.prefill(runner.add(prompt), chunk=32)
    expected = ref_logits(tied_ref, model.config, prompt)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9


def test_int8_refuses_bfloat16_activations(tiny_qwen2_vl_dir: Path):
    with pytest.raises(ValueError, match="float32"):
        load_model(tiny_qwen2_vl_dir, torch.bfloat16, quantization="int8")


def _int8_method(use_kernels: bool = True, int_mm_exact: bool | None = None) -> Int8Weights:
    """--quantization int8's method on this machine (``use_kernels`` False: --cpu-kernels off); ``int_mm_exact``
    False: as on a CPU where torch._int_mm is not exact (default: this CPU's)."""
    exact = quant.int_mm_exact(CpuFeatures.detect()) if int_mm_exact is None else int_mm_exact
    return Int8Weights(cpu_linear.built_kernels() if use_kernels else None, exact)


def _int8_layer(in_features: int, out_features: int, use_kernels: bool, seed: int = 0,
                int_mm_exact: bool | None = None) -> Linear:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    return Linear.of(weight, torch.randn(out_features, generator=g), _int8_method(use_kernels, int_mm_exact))


@pytest.fixture(scope="module")
def int8_kernels() -> None:
    require_program("cc", "gcc", "gcc")
    assert cpu_linear.kernel_unavailable() is None


@pytest.mark.parametrize("int_mm", ["as this CPU", "not exact"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("shape", [(64, 48), (512, 768), (1408, 512), (72, 40), (40, 36)])
def test_an_int8_row_is_bitwise_the_same_alone_batched_and_on_every_path(int8_kernels, shape, threads, int_mm,
                                                                        torch_threads):
    # K and N multiples of 16: the AVX-512 VNNI few-rows loop where the CPU has it; (72, 40): the AVX2 loop;
    # (40, 36): no kernel (N % 8), exact products by torch for every row count. "not exact": as on a CPU without
    # VNNI, where torch._int_mm saturates and prefill takes the kernel (or, without it, float64)
    exact = False if int_mm == "not exact" else None
    torch_threads(threads)  # the kernels split columns by torch's count
    k, n = shape
    fast = _int8_layer(k, n, use_kernels=True, int_mm_exact=exact)
    twins = _int8_layer(k, n, use_kernels=False, int_mm_exact=exact)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 2, 40)[:, None]
    with torch.no_grad():
        every = fast(x)  # 40 rows: prefill's path
        q, row_scale = quantize_rows(x)  # an independent reference: exact products in int64
        reference = dequantize_rows((q.long() @ quant.weight_kn(fast).long()).int(), row_scale, fast.scale, fast.bias)
        assert torch.equal(every, reference)
        assert torch.equal(twins(x), every)  # --cpu-kernels off: the same numbers from torch's ops alone
        for rows in (1, 2, 5, 8, 16, 17):  # the few-rows kernel up to 16 rows, then _int_mm again
            assert torch.equal(fast(x[:rows]), every[:rows])
            assert torch.equal(fast(x[-rows:]), every[-rows:])  # with other batch-mates
            assert torch.equal(twins(x[:rows]), every[:rows])
        assert torch.equal(fast(x[3:4].expand(4, k)), every[3:4].expand(4, n))  # one row read 4 times (row stride 0)


def test_int8_products_at_the_ends_of_the_range_are_exact(int8_kernels):
    # every input and weight at +-127, signs arranged so neighbouring products add up (the largest pair sums the
    # AVX2 loops form in 16 bits: 2 x 127 x 127) and cancel; N = 64 and 96: the 32-column loop, 40: the 8-column one
    kernel = cpu_linear._kernel()[0]
    for n in (40, 64, 96):
        k = 64
        signs = torch.tensor([1, 1, -1, -1, 1, -1, -1, 1], dtype=torch.int8)
        q = torch.stack([torch.full((k,), 127, dtype=torch.int8), -torch.full((k,), 127, dtype=torch.int8),
                         127 * signs.repeat(k // 8), torch.zeros(k, dtype=torch.int8)])
        weight = torch.full((k, n), 127, dtype=torch.int8)
        weight[:, 1::2] = -127
        weight[::3] *= -1
        weight[:, 5] = 127 * signs.repeat(k // 8)
        row_scale, col_scale = torch.ones(4), torch.ones(n)
        want = (q.long() @ weight.long()).float()
        for rows in (1, 2, 4):
            got = kernel.int8_products(q[:rows].contiguous(), row_scale[:rows], weight, col_scale, None)
            assert torch.equal(got, want[:rows]), (n, rows)
            if n % 32 == 0:  # the weight in the AVX2 loop's blocks (kept so on CPUs without VNNI)
                blocked = cpu_linear.int8_pack(weight)
                got = kernel.int8_products(q[:rows].contiguous(), row_scale[:rows], blocked, col_scale, None)
                assert torch.equal(got, want[:rows]), (n, rows, "blocked")


def test_int8_weights_in_blocks_are_the_same_bytes_and_the_same_products(int8_kernels, torch_threads):
    # int8_pack moves bytes (int8_unpack gives the weight back); products from the blocks equal the [K, N] ones,
    # bitwise, for 1 to 40 rows (blocks of 16 rows and a rest) and 1 or 3 of the kernels' threads; an int8 layer
    # keeps its weight in blocks exactly where every product of it takes the blocked loop
    g = torch.Generator().manual_seed(5)
    kernel = cpu_linear._kernel()[0]
    for k, n in ((64, 32), (512, 768), (1408, 512)):
        weight = torch.randint(-127, 128, (k, n), generator=g, dtype=torch.int8)
        blocked = cpu_linear.int8_pack(weight)
        assert blocked.shape == (n // 32, k // 8, 256) and torch.equal(cpu_linear.int8_unpack(blocked), weight)
        assert sorted(blocked.flatten().tolist()) == sorted(weight.flatten().tolist())
        scale, bias = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
        x = torch.randn(40, k, generator=g)
        for threads in (1, 3):
            torch_threads(threads)  # the kernels split columns by torch's count
            for rows in (1, 2, 7, 16, 17, 40):
                assert torch.equal(kernel.int8_linear(x[:rows], blocked, scale, bias),
                                   kernel.int8_linear(x[:rows], weight, scale, bias)), (k, n, threads, rows)
    layer = Linear.of(torch.randn(64, 48, generator=g), None, _int8_method())
    assert (layer.qweight.dim() == 3) == (not kernel.int8_vnni and not quant.int_mm_exact(CpuFeatures.detect()))
    x = torch.randn(3, 48, generator=g)
    with_kernels = layer(x)
    layer.method = _int8_method(use_kernels=False)  # switched off after the weight was packed: torch alone, the
    assert torch.equal(layer(x), with_kernels)  # same numbers
    assert quant.weight_kn(layer).shape == (48, 64)
    assert Linear.of(torch.randn(40, 48), None, _int8_method()).qweight.dim() == 2


def test_int8_rows_are_quantized_each_with_its_own_scale(int8_kernels):
    x = torch.tensor([[0.0] * 8, [1.0, -2.0, 0.5, 0.0, 0.0, 0.0, 0.0, 127.0], [1e-3, -1e-3] * 4])
    kernel = cpu_linear._kernel()[0]
    q, scales = quantize_rows(x, kernel)
    assert torch.equal((q, scales)[1], torch.tensor([1.0, 1.0, 1e-3 / 127]))  # an all-zero row keeps scale 1
    assert q[0].abs().max() == 0 and q[1].tolist() == [1, -2, 0, 0, 0, 0, 0, 127]  # 0.5 rounds half to even
    assert q[2].tolist() == [127, -127] * 4
    assert all(torch.equal(a, b) for a, b in zip((q, scales), quantize_rows(x)))  # the torch twin
    acc = torch.randint(-2**20, 2**20, (3, 8), dtype=torch.int32)
    col, bias = torch.rand(8) + 0.5, torch.randn(8)
    assert torch.equal(dequantize_rows(acc, scales, col, bias, kernel), dequantize_rows(acc, scales, col, bias))
    assert torch.equal(dequantize_rows(acc, scales, col, None, kernel), acc.float() * scales[:, None] * col)


def test_int8_cpu_kernels_off_gives_the_same_logits(tiny_qwen2_vl_dir: Path, int8_kernels):
    fast = load_model(tiny_qwen2_vl_dir, torch.float32, quantization="int8")
    twins = load_model(tiny_qwen2_vl_dir, torch.float32, quantization="int8", cpu_kernels="off")
    assert fast.lm_head.method.kernels is not None and twins.lm_head.method.kernels is None
    prompt = make_prompt(fast.config, PROMPTS["one_image"], seed=7)
    a, b = TinyRunner(fast), TinyRunner(twins)
    assert torch.equal(a.prefill(a.add(prompt), chunk=32), b.prefill(b.add(prompt), chunk=32))


def test_int8_rows_with_nan_or_infinity_give_nan_and_tiny_rows_give_the_bias(int8_kernels):
    fast, twins = _int8_layer(64, 48, use_kernels=True), _int8_layer(64, 48, use_kernels=False)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    x[1, 60] = float("nan")  # in the last vector: the kernel's max must not hide it
    x[2, 3] = float("inf")
    x[3, 0] = -float("inf")
    x[4] = 1e-39  # subnormal: 1 / scale would overflow
    kernel = cpu_linear._kernel()[0]
    for rows in (x, x[1:5]):
        for got in (quantize_rows(rows, kernel), quantize_rows(rows)):
            q, scales = got
            assert q.abs().max() <= 127
        (qk, sk), (qt, st) = quantize_rows(x, kernel), quantize_rows(x)
        assert torch.equal(qk, qt) and torch.equal(sk.isnan(), st.isnan())
        assert sk[1:4].isnan().all() and (qk[1:4] == 0).all() and sk[4] == 1 and (qk[4] == 0).all()
    with torch.no_grad():
        for layer in (fast, twins):
            for rows in (x, x.repeat(4, 1)):  # the few-rows kernel, then prefill's path
                out = layer(rows)[:6]
                assert out[1:4].isnan().all()
                assert torch.equal(out[4], layer.bias) and torch.isfinite(out[[0, 5]]).all()
