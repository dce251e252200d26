"""The few-rows float32 kernel of decode steps (firsttoken/kernels/cpu_linear.py): built once, checked against
torch, bitwise the same for a row whatever shares its product, and absent cleanly where it cannot be built."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import subprocess
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.kernels import cpu_linear
from firsttoken.kernels.cpu_features import CpuFeatures
from firsttoken.kernels.cpu_linear import MAX_ROWS, MAX_ROWS_BF16, MAX_ROWS_BF16_DP, kernel_takes
from firsttoken.loading.kernel_linear import FewRowsKernel
from firsttoken.loading.loader import load_model
from firsttoken.loading.load_plan import kernels_skipped
from firsttoken.loading.plan_values import Machine
from firsttoken.models.linear import Linear
from tests.conftest import require_program
from tests.helpers import layers_with, machine_with_cpu, torch_layers

AVX2_FMA = CpuFeatures(flags=frozenset({"avx2", "fma"}), vendor="AuthenticAMD")  # what the kernels need


def _few_rows(model) -> dict[str, Linear]:
    return layers_with(model, FewRowsKernel)


def _linear(in_features: int, out_features: int, bias: bool, input_major: bool = False, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) / in_features**0.5  # outputs of order 1
    weight = nn.Parameter(w.t().contiguous().t() if input_major else w, requires_grad=False)
    b = nn.Parameter(torch.randn(out_features, generator=g), requires_grad=False) if bias else None
    return Linear.of(weight, b, FewRowsKernel(cpu_linear.built_kernels()))


@pytest.mark.parametrize("input_major", [True, False], ids=["input-major", "row-major"])
@pytest.mark.parametrize("in_features,out_features,bias", [(64, 48, True), (176, 64, False), (512, 96, True)])
def test_matches_torch_for_every_row_count(kernel_built, in_features, out_features, bias, input_major):
    layer = _linear(in_features, out_features, bias, input_major)
    x = torch.randn(MAX_ROWS + 4, in_features)
    with torch.inference_mode():
        for rows in range(1, MAX_ROWS + 5):
            got, want = layer(x[:rows]), F.linear(x[:rows], layer.weight, layer.bias)
            assert got.shape == want.shape == (rows, out_features)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if rows > MAX_ROWS:  # prefill-sized inputs are torch's own product
                assert torch.equal(got, want)


@pytest.mark.parametrize("input_major", [True, False], ids=["input-major", "row-major"])
def test_leading_dims_and_strided_rows(kernel_built, input_major):
    layer = _linear(64, 32, True, input_major)
    x = torch.randn(2, 3, 128)[..., ::2]  # not contiguous in the last dim
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    rows = torch.randn(4, 96)[:, :64]  # row stride 96, unit column stride: read in place
    with torch.inference_mode():
        torch.testing.assert_close(layer(rows), F.linear(rows, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("input_major", [True, False], ids=["input-major", "row-major"])
def test_a_row_is_bitwise_the_same_whatever_shares_its_step(kernel_built, input_major):
    """A request's products do not depend on how many others are decoding beside it, nor on the thread count."""
    layer = _linear(512, 80, True, input_major)
    x = torch.randn(MAX_ROWS, 512)
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            alone = layer(x[3:4])
            for rows in (4, 5, 8, 9, MAX_ROWS):
                assert torch.equal(layer(x[:rows])[3], alone[0])
            assert torch.equal(layer(x[2:5])[1], alone[0])  # as the second row of three, not only the fourth
            torch.set_num_threads(2)
            assert torch.equal(layer(x)[3], alone[0])
    finally:
        torch.set_num_threads(before)


def test_autograd_inputs_take_torch(kernel_built):
    layer = _linear(64, 16, False)
    layer.weight.requires_grad_(True)
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()  # F.linear: gradients flow
    assert x.grad is not None and layer.weight.grad is not None


def test_built_once_and_reused(kernel_built, tmp_path, monkeypatch):
    monkeypatch.setenv("FIRSTTOKEN_CACHE", str(tmp_path))
    builds = []
    real_run = subprocess.run

    def counting_run(cmd, *args, **kwargs):
        builds.append(cmd)
        return real_run(cmd, *args, **kwargs)

    for _ in range(2):
        kernel, reason = cpu_linear._build(CpuFeatures.detect(), run=counting_run)
        assert reason is None and kernel is not None
    assert len(builds) == 1  # the second load found the cached library
    files = [p.name for p in (tmp_path / "kernels").iterdir()]
    assert len(files) == 1 and files[0].startswith("cpu_linear-") and files[0].endswith(".so")  # no temporary left


def test_a_failing_compiler_says_why(tmp_path, monkeypatch):
    require_program("false", "coreutils")
    monkeypatch.setenv("FIRSTTOKEN_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    kernel, reason = cpu_linear._build(CpuFeatures.detect())
    if not CpuFeatures.detect().avx2_fma:
        assert kernel is None and "AVX2" in reason
        return
    assert kernel is None and reason.startswith("false failed")
    assert not list((tmp_path / "kernels").glob("*"))  # nothing half-built left behind


def test_an_unwritable_cache_says_why(tmp_path, monkeypatch):
    require_program("cc", "gcc", "gcc")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("FIRSTTOKEN_CACHE", str(blocker))  # kernels/ cannot be made under a file
    kernel, reason = cpu_linear._build(AVX2_FMA)
    assert kernel is None and "failed" in reason and str(blocker) in reason


def test_a_cpu_without_avx2_says_so():
    kernel, reason = cpu_linear._build(CpuFeatures(flags=frozenset({"sse4_2", "avx"})))
    assert kernel is None and "AVX2" in reason
    assert not CpuFeatures(arch="aarch64", flags=frozenset({"avx2", "fma"})).avx2_fma


def test_no_compiler_says_which_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    monkeypatch.delenv("CC", raising=False)
    kernel, reason = cpu_linear._build(AVX2_FMA)
    assert kernel is None and "gcc" in reason


def test_load_model_uses_it_for_the_language_model_only(kernel_built, tiny_qwen2_vl_dir):
    model = load_model(tiny_qwen2_vl_dir, torch.float32, cpu_kernels="on")
    lm = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith("visual.")]
    vision = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("visual.")]
    assert lm and sorted(_few_rows(model)) == sorted(lm)
    # the layouts: on AVX-512 CPUs widening weights input-major, the down projection row-major; on AVX2 ones every
    # weight keeps the checkpoint's row-major layout (plan.keeps_row_major)
    layer = model.layers[0]
    widening = (layer.mlp.gate_up_proj.weight, layer.self_attn.qkv_proj.weight)
    if CpuFeatures.detect().avx512:
        assert all(w.t().is_contiguous() for w in widening)
    else:
        assert all(w.is_contiguous() for w in widening)
    assert layer.mlp.down_proj.weight.is_contiguous()
    assert vision and all(n in torch_layers(model) for n in vision)
    off = load_model(tiny_qwen2_vl_dir, torch.float32, cpu_kernels="off")
    assert not _few_rows(off)
    # a decode step's rows: the same logits to rounding, the same argmax
    hidden = torch.randn(5, model.config.hidden_size)
    with torch.inference_mode():
        a, b = model.compute_logits(hidden), off.compute_logits(hidden)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def _bf16_linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(torch.bfloat16)
    b = nn.Parameter(torch.randn(out_features, generator=g).to(torch.bfloat16), requires_grad=False) if bias else None
    return Linear.of(nn.Parameter(w, requires_grad=False), b, FewRowsKernel(cpu_linear.built_kernels()))


# K % 32 == 0 takes the AVX512-BF16 dot-product loop where the CPU has it; K = 80 the AVX2 loop everywhere
@pytest.mark.parametrize("in_features,out_features,bias", [(64, 48, True), (80, 48, True), (512, 1408, False),
                                                           (1408, 512, True)])
def test_bf16_rows_are_the_exact_sums_rounded_once(kernel_built, in_features, out_features, bias):
    """bf16 weights and rows: each output is the float32 sum of the exact products, rounded to bf16 once (torch's
    bf16 product rounds its own float32 sums: the same to within one bf16 step); more rows than the kernel takes
    go to torch's own product."""
    limit = cpu_linear.built_kernels().max_rows_bf16
    layer = _bf16_linear(in_features, out_features, bias)
    x = torch.randn(limit + 3, in_features).to(torch.bfloat16)
    b = None if layer.bias is None else layer.bias.double()
    with torch.inference_mode():
        for rows in range(1, limit + 4):
            got = layer(x[:rows])
            assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
            exact = F.linear(x[:rows].double(), layer.weight.double(), b)
            if rows > limit:
                assert torch.equal(got, F.linear(x[:rows], layer.weight, layer.bias))
            else:  # float32 sums: within 1e-5 of exact before the one rounding to bf16 (2^-8 relative)
                torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5)
                torch.testing.assert_close(got, F.linear(x[:rows], layer.weight, layer.bias), rtol=2**-7, atol=1e-2)


def test_bf16_row_is_bitwise_the_same_whatever_shares_its_step(kernel_built):
    limit = cpu_linear.built_kernels().max_rows_bf16
    layer = _bf16_linear(512, 80, True)
    x = torch.randn(limit, 512).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            alone = layer(x[2:3])
            for rows in range(3, limit + 1):
                assert torch.equal(layer(x[:rows])[2], alone[0])
            torch.set_num_threads(2)
            assert torch.equal(layer(x)[2], alone[0])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("in_features", [96, 80], ids=["k%32==0", "k%32!=0"])
def test_bf16_kernel_row_is_the_same_bits_at_every_place_and_count(kernel_built, in_features):
    """Whichever loop the CPU takes, a row's outputs are the same bits whether it is alone, first, last or in the
    middle of 1-40 rows (the dot-product loop reads 16 rows a pass: 40 takes three passes, the last of 8), at one
    thread or two; the lanes' sums come out in the right outputs (37 outputs: not a multiple of any vector)."""
    kernel = cpu_linear._kernel()[0]
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, in_features, generator=g).to(torch.bfloat16)
    bias = torch.randn(37, generator=g)
    x = torch.randn(40, in_features, generator=g).to(torch.bfloat16).float()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([kernel.linear(x[i:i + 1], w, bias) for i in range(40)])
        torch.testing.assert_close(alone.double(), F.linear(x.double(), w.double(), bias.double()), rtol=1e-5,
                                   atol=1e-5)
        for start, count in [(0, 2), (5, 3), (1, 8), (3, 9), (0, 16), (7, 17), (0, 40)]:
            assert torch.equal(kernel.linear(x[start:start + count], w, bias), alone[start:start + count])
        torch.set_num_threads(2)
        assert torch.equal(kernel.linear(x, w, bias), alone)
    finally:
        torch.set_num_threads(before)


def test_bf16_dot_product_loop_where_the_cpu_has_avx512_bf16(kernel_built):
    """The kernel takes AVX512-BF16 dot products exactly where the CPU reports avx512_bf16 (and then lets bf16
    products of up to MAX_ROWS_BF16_DP rows take the kernels; the AVX2 loop MAX_ROWS_BF16)."""
    has = CpuFeatures.detect().has("avx512_bf16")
    assert cpu_linear.built_kernels().bf16_dp == has
    assert cpu_linear.built_kernels().max_rows_bf16 == (MAX_ROWS_BF16_DP if has else MAX_ROWS_BF16)


def test_float32_rows_against_bf16_weights_are_float32_arithmetic_on_this_cpu(kernel_built):
    """--quantization bf16's products (float32 activations, bf16 weights): on whatever CPU this runs, the kernels
    compute float32's product of the widened weights, K % 32 == 0 included (where an AVX512-BF16 CPU has dot
    products, which would round the rows to bf16), for every row count the kernels take and both thread counts.
    Rows holding bf16 values may take the dot products: the same values, sums in another order."""
    kernel = cpu_linear.built_kernels()
    g = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    try:
        for n, k in ((64, 64), (40, 128), (96, 48)):
            weight = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
            bias = torch.randn(n, generator=g)
            x = torch.randn(MAX_ROWS, k, generator=g)  # float32 values, almost none of them a bf16 value
            x16 = x.to(torch.bfloat16).float()
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for rows in (1, 2, 5, MAX_ROWS):
                    want = F.linear(x[:rows].double(), weight.double(), bias.double())
                    got = kernel.linear(x[:rows], weight, bias)
                    # float32 sums of K exact products: within K float32 roundings of the float64 product
                    tolerance = k * 2**-24 * (x[:rows].abs() @ weight.float().abs().t() + bias.abs())
                    assert ((got.double() - want).abs() <= tolerance.double()).all(), (n, k, threads, rows)
                    want16 = F.linear(x16[:rows], weight.float(), bias)
                    torch.testing.assert_close(kernel.linear(x16[:rows], weight, bias, bf16_rows=True), want16,
                                               rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("flags,used", [({"avx2", "avx512f", "avx512_bf16"}, True),
                                         ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, False),
                                         ({"avx2", "avx512f"}, False), ({"avx2"}, False)],
                         ids=["avx512-bf16", "amx", "avx512", "avx2"])
def test_auto_takes_bf16_kernels_where_they_were_measured(kernel_built, tiny_qwen2_vl_dir, flags, used):
    """bf16: auto takes the kernels on AVX512-BF16 CPUs without AMX (measured there), not elsewhere; on takes them
    everywhere; the float32 rule is its own."""
    machine = machine_with_cpu(flags=flags | {"fma"}, vendor="AuthenticAMD")
    model = load_model(tiny_qwen2_vl_dir, torch.bfloat16, cpu_kernels="auto", machine=machine)
    layers = _few_rows(model).values()
    assert bool(layers) == used
    assert all(m.weight.dtype == torch.bfloat16 for m in layers)
    assert _few_rows(load_model(tiny_qwen2_vl_dir, torch.bfloat16, cpu_kernels="on", machine=machine))


def test_bf16_model_logits_with_and_without_the_kernels(kernel_built, tiny_qwen2_vl_dir):
    on = load_model(tiny_qwen2_vl_dir, torch.bfloat16, cpu_kernels="on")
    off = load_model(tiny_qwen2_vl_dir, torch.bfloat16, cpu_kernels="off")
    assert isinstance(on.lm_head.method, FewRowsKernel) and not _few_rows(off)
    hidden = torch.randn(3, on.config.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        a, b = on.compute_logits(hidden), off.compute_logits(hidden)
    torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=2e-2)


def test_tied_lm_head_shares_the_embeddings(kernel_built, tiny_qwen2_vl_tied_dir):
    model = load_model(tiny_qwen2_vl_tied_dir, torch.float32, cpu_kernels="on")
    assert isinstance(model.lm_head.method, FewRowsKernel)
    assert model.lm_head.weight is model.embed_tokens.weight  # no copy
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.embed_tokens.weight),
                                   rtol=1e-5, atol=1e-5)


def test_not_for_fp16_or_the_vision_tower(kernel_built, tiny_qwen2_vl_dir):
    bf16 = load_model(tiny_qwen2_vl_dir, torch.bfloat16, cpu_kernels="on")
    assert not any(name.startswith("visual.") for name in _few_rows(bf16))
    fp16 = load_model(tiny_qwen2_vl_dir, torch.float32, quantization="fp16", cpu_kernels="on")
    assert not _few_rows(fp16)


def test_unavailable_kernel_falls_back_and_the_log_says_why(tiny_qwen2_vl_dir, caplog):
    from firsttoken.config import EngineConfig
    from firsttoken.engine.engine import LLMEngine
    from firsttoken.inputs.processor import load_tokenizer

    machine = Machine.detect().without_kernels("no C compiler on PATH (test)")
    model = load_model(tiny_qwen2_vl_dir, torch.float32, cpu_kernels="on", machine=machine)
    assert not _few_rows(model)
    assert model.layers[0].mlp.gate_up_proj.weight.t().is_contiguous()  # MKL's one-row layout all the same
    with caplog.at_level(logging.INFO, logger="firsttoken.engine"):
        LLMEngine(tiny_qwen2_vl_dir, EngineConfig(dtype="float32", cpu_kernels="on"),
                  load_tokenizer(tiny_qwen2_vl_dir).backend_tokenizer, machine=machine)
    assert "few-rows kernels not used: no C compiler on PATH (test)" in caplog.text


@pytest.mark.parametrize("avx512,vendor", [(False, "GenuineIntel"), (True, "GenuineIntel"), (False, "AuthenticAMD"),
                                           (True, "AuthenticAMD")])
def test_auto_leaves_intel_avx512_cpus_to_mkl(kernel_built, tiny_qwen2_vl_dir, avx512, vendor):
    """float32: auto takes the kernels on AVX2-only CPUs and AMD's AVX-512 ones (measured on both) and leaves
    Intel's AVX-512 CPUs to MKL (it won on a Xeon); on takes them everywhere; off nowhere."""
    machine = machine_with_cpu(flags={"avx2", "fma"} | ({"avx512f"} if avx512 else set()), vendor=vendor)
    used = {setting: bool(_few_rows(load_model(tiny_qwen2_vl_dir, torch.float32, cpu_kernels=setting,
                                               machine=machine)))
            for setting in ("auto", "on", "off")}
    mkl = avx512 and vendor == "GenuineIntel"
    assert used == {"auto": not mkl, "on": True, "off": False}
    reason = kernels_skipped("auto", torch.float32, machine)
    assert (reason is None) == (not mkl) and (not mkl or "--cpu-kernels on" in reason)


def test_the_kernels_take_only_the_shapes_and_layouts_they_fit():
    # (in, out, dtype, input-major): row-major needs K % 16, input-major K % 8 and N % 8 (float32; bfloat16
    # row-major only); no float16
    layers = [(64, 8, torch.float32, False), (24, 8, torch.float32, False), (24, 8, torch.float32, True),
              (24, 12, torch.float32, True), (64, 8, torch.bfloat16, False), (24, 8, torch.bfloat16, False),
              (64, 8, torch.float16, False), (24, 8, torch.bfloat16, True)]
    assert [kernel_takes(n, k, dtype, im) for k, n, dtype, im in layers] == [True, False, True, False, True, False,
                                                                              False, False]
    for k, n, dtype, im in layers:  # the same rule read off a weight's strides
        w = torch.zeros(n, k, dtype=dtype)
        assert cpu_linear.kernel_applies(w.t().contiguous().t() if im else w) == kernel_takes(n, k, dtype, im)


def test_topk_kernel_is_torchs_topk_and_argmax(kernel_built):
    """The sampler's top-k (ft_topk): torch.topk's values and ids, largest first, for rows of any length (not a
    multiple of the 8-lane pass) and k from 1 (argmax: the first maximum among ties) to TOPK_MAX (beyond: torch's);
    ties in index order; -inf is a value like any other, NaN is never chosen (a row with fewer than k other values is
    left to torch)."""
    kernel = cpu_linear._kernel()[0]
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 100, 16064):
        row = torch.randn(n, generator=g) * 3
        for k in sorted({1, 2, 5, 20, 64, 256, n} & set(range(1, min(n, 256) + 1))):
            vals, ids = kernel.topk(row, k)
            want_vals, want_ids = torch.topk(row, k)
            assert torch.equal(vals, want_vals) and torch.equal(ids, want_ids), (n, k)
    ties = torch.tensor([1.0, 3.0, 2.0, 3.0, 3.0, float("-inf"), 0.5, 3.0, 2.0, 1.0])
    vals, ids = kernel.topk(ties, 5)
    assert ids.tolist() == [1, 3, 4, 7, 2] and vals.tolist() == [3.0, 3.0, 3.0, 3.0, 2.0]
    assert kernel.topk(ties, 1)[1].tolist() == [int(torch.argmax(ties))] == [1]
    assert kernel.topk(ties, 10)[1].tolist()[-1] == 5  # -inf last, still a value
    nan = torch.tensor([0.5, float("nan"), 2.0, float("nan")])
    assert kernel.topk(nan, 2)[1].tolist() == [2, 0] and kernel.topk(nan, 3) is None
    assert kernel.topk(torch.randn(10)[::2], 1) is None  # not contiguous: torch's
    assert kernel.topk(torch.randn(1000), cpu_linear.TOPK_MAX + 1) is None


def test_input_major_avx512_loop_is_bitwise_the_avx2_loop(kernel_built):
    """Where the CPU has AVX-512, input-major float32 products take 16 outputs a pass with the same operations per
    output as the 8-wide AVX2 loop: the same bits for every row count, widths that are and are not multiples of 16,
    with and without bias, at one and two threads. Elsewhere the switch reports the AVX2 loop and changes nothing."""
    kernel = cpu_linear._kernel()[0]
    switch = kernel.lib.ft_im16
    switch.restype, switch.argtypes = ctypes.c_int, [ctypes.c_int]
    flags = CpuFeatures.detect().flags or frozenset()
    assert bool(switch(-1)) == ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags)
    g = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    try:
        for n, k in ((48, 64), (40, 176), (1408, 512)):
            weight = (torch.randn(n, k, generator=g) / k**0.5).t().contiguous().t()  # input-major
            bias = torch.randn(n, generator=g)
            x = torch.randn(16, k, generator=g)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for rows in (1, 2, 3, 8, 16):
                    for b in (None, bias):
                        switch(0)
                        avx2 = kernel.linear(x[:rows], weight, b)
                        switch(1)
                        assert torch.equal(kernel.linear(x[:rows], weight, b), avx2), (n, k, threads, rows)
    finally:
        switch(1)
        torch.set_num_threads(before)


# ---- the kernels' own threads (ft_parallel) -------------------------------------------------------------------------
def _products() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """One weight per loop the pool runs: float32 row-major and input-major, bf16 row-major (the dot-product loop
    where the CPU has it)."""
    g = torch.Generator().manual_seed(7)
    w32 = torch.randn(1000, 512, generator=g)
    return [("f32-rm", torch.randn(6, 512, generator=g), w32),
            ("f32-im", torch.randn(6, 512, generator=g), w32.t().contiguous().t()),
            ("bf16", torch.randn(6, 512, generator=g), torch.randn(1000, 512, generator=g).to(torch.bfloat16))]


def _product(kernel: cpu_linear._Kernel, x: torch.Tensor, w: torch.Tensor, threads: int) -> torch.Tensor:
    cpu_linear.set_kernel_threads(threads)
    try:
        return kernel.linear(x, w, None)
    finally:
        cpu_linear.set_kernel_threads(None)


def test_int8_products_on_the_kernels_own_threads_are_bitwise_openmps(kernel_built):
    """--quantization int8's products in a fused decode step run on the kernels' own threads: the same numbers."""
    from firsttoken.loading.quant import Int8Weights, int_mm_exact

    g = torch.Generator().manual_seed(8)
    method = Int8Weights(cpu_linear.built_kernels(), int_mm_exact(CpuFeatures.detect()))
    layer = Linear.of(torch.randn(1000, 512, generator=g), torch.randn(1000, generator=g), method)
    x = torch.randn(6, 512, generator=g)
    kernel = cpu_linear._kernel()[0]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        omp = kernel.int8_linear(x, layer.qweight, layer.scale, layer.bias)
        torch.set_num_threads(1)
        for threads in (2, 3):
            cpu_linear.set_kernel_threads(threads)
            try:
                assert torch.equal(kernel.int8_linear(x, layer.qweight, layer.scale, layer.bias), omp), threads
            finally:
                cpu_linear.set_kernel_threads(None)
    finally:
        torch.set_num_threads(before)


def test_kernel_threads_are_set_per_thread_apart_from_torch(kernel_built):
    """set_kernel_threads (ThreadPlan sets it per step) decides the kernels' threads, not torch's count."""
    kernel = cpu_linear._kernel()[0]
    x, w = _products()[0][1:]
    before = kernel.pool_stats()
    torch_threads = torch.get_num_threads()
    one = _product(kernel, x, w, 1)
    assert kernel.pool_stats()["regions"] == before["regions"]  # one thread: the caller alone, no region
    two = _product(kernel, x, w, 2)
    after = kernel.pool_stats()
    assert after["regions"] == before["regions"] + 1 and after["workers"] >= 1
    assert torch.get_num_threads() == torch_threads and torch.equal(one, two)


def test_a_region_never_waits_for_a_worker(kernel_built):
    """Workers are optional: with them held (as if pre-empted before taking any work) every product still completes,
    the caller having done all of it, bitwise the same."""
    kernel = cpu_linear._kernel()[0]
    for name, x, w in _products():
        alone = _product(kernel, x, w, 1)
        kernel.lib.ft_pool_hold(1)
        try:
            items = kernel.pool_stats()["worker_items"]
            held = _product(kernel, x, w, 2)
            assert kernel.pool_stats()["worker_items"] == items, name
        finally:
            kernel.lib.ft_pool_hold(0)
        assert torch.equal(held, alone), name
        assert torch.equal(_product(kernel, x, w, 2), alone), name


def test_concurrent_callers_each_get_their_own_products(kernel_built):
    """Several threads calling the kernels at once (two engines in one process): one runs its regions on the pool,
    the others alone; every result is bitwise the single-thread one."""
    kernel = cpu_linear._kernel()[0]
    products = _products()
    expected = [_product(kernel, x, w, 1) for _, x, w in products]
    failures: list[str] = []

    def caller(c: int) -> None:
        for i in range(40):
            name, x, w = products[(c + i) % len(products)]
            if not torch.equal(_product(kernel, x, w, 2), expected[(c + i) % len(products)]):
                failures.append(f"caller {c} call {i} ({name})")

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_a_forked_child_starts_its_own_workers(kernel_built):
    """fork copies the pool's state but not its threads: the child's first region starts a worker of its own."""
    kernel = cpu_linear._kernel()[0]
    _, x, w = _products()[2]
    expected = _product(kernel, x, w, 1)
    assert torch.equal(_product(kernel, x, w, 2), expected) and kernel.pool_stats()["workers"] >= 1  # the parent's
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        workers_before, workers_after, same = pool.apply(_child_product, (x, w, expected))
    assert (workers_before, workers_after, same) == (0, 1, True)


def _child_product(x: torch.Tensor, w: torch.Tensor, expected: torch.Tensor) -> tuple[int, int, bool]:
    kernel = cpu_linear._kernel()[0]
    before = kernel.pool_stats()["workers"]
    out = _product(kernel, x, w, 2)
    return before, kernel.pool_stats()["workers"], bool(torch.equal(out, expected))


def test_no_more_threads_than_cpus_the_process_may_use(kernel_built):
    """A process limited to one CPU (taskset, a container's cpuset) asking for two threads gets one: no worker is
    started to spin against the caller."""
    x, w = _products()[0][1:]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        workers, regions, same = pool.apply(_one_cpu_product, (x, w, _product(cpu_linear._kernel()[0], x, w, 1)))
    assert (workers, regions, same) == (0, 0, True)


def _one_cpu_product(x: torch.Tensor, w: torch.Tensor, expected: torch.Tensor) -> tuple[int, int, bool]:
    import os

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    kernel = cpu_linear._kernel()[0]
    out = _product(kernel, x, w, 2)
    stats = kernel.pool_stats()
    return stats["workers"], stats["regions"], bool(torch.equal(out, expected))


def test_a_cgroup_cpu_quota_caps_the_kernels_threads(kernel_built, tmp_path):
    """A container limited with --cpus sees its host's every core: the quota (cgroup v2 cpu.max, else v1's
    cfs_quota_us / cfs_period_us), rounded up, is the most threads the kernels' workers use."""
    quota = cpu_linear._kernel()[0].lib.ft_quota_cpus

    def write(name: str, text: str) -> bytes:
        (tmp_path / name).write_text(text)
        return str(tmp_path / name).encode()

    missing = str(tmp_path / "absent").encode()
    assert quota(write("max2", "200000 100000\n"), missing, missing) == 2
    assert quota(write("max15", "150000 100000\n"), missing, missing) == 2  # 1.5 CPUs: two threads
    assert quota(write("unlimited", "max 100000\n"), missing, missing) == 0
    assert quota(missing, write("q", "300000\n"), write("p", "100000\n")) == 3  # cgroup v1
    assert quota(missing, write("q1", "-1\n"), write("p1", "100000\n")) == 0  # v1, no quota
    assert quota(missing, missing, missing) == 0
