"""The decode-step shortcuts compute what the plain ops compute: RMSNorm on a few rows (models/layers.py) equals
torch's rms_norm bit for bit (fp32), and only widening fp32 linears are re-laid out input-major (models/linear.py:
same values)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from firsttoken.models.layers import SMALL_NORM_ELEMENTS, RMSNorm, SwiGLUMLP
from firsttoken.models.linear import TORCH, Linear, TorchLinear, store_input_major


@pytest.mark.parametrize("shape", [(1, 512), (8, 512), (3, 8, 64), (5, 2, 128), (1, 3584), (129, 512)])
def test_rms_norm_equals_torch_rms_norm_bit_for_bit(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = torch.randn(shape[-1], generator=gen)
    x = torch.randn(*shape, generator=gen) * 4
    expected = F.rms_norm(x, norm.weight.shape, norm.weight, 1e-6)
    with torch.inference_mode():
        assert torch.equal(norm(x), expected)
    assert torch.equal(norm(x), expected)  # outside inference mode too (the cached constants are shared)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 512), (4, 512), (3, 8, 64), (129, 512)])
def test_rms_norm_of_half_precision_rows_equals_the_reference_composite_bit_for_bit(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    norm.weight.data = torch.randn(shape[-1], generator=gen).to(dtype)
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    x32 = x.float()  # transformers: fp32, x * rsqrt(mean(x^2) + eps), cast back, times the weight
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    with torch.inference_mode():
        assert torch.equal(norm(x), expected)


def test_small_and_large_inputs_take_different_paths_and_agree():
    norm = RMSNorm(512, 1e-5)
    rows = SMALL_NORM_ELEMENTS // 512
    x = torch.randn(rows + 1, 512)
    assert torch.equal(norm(x[:rows]), norm(x)[:rows])


def test_only_widening_linears_are_stored_input_major_with_the_same_values():
    layers = {"up": Linear(4, 12), "down": Linear(12, 4), "square": Linear(6, 6), "bf16": Linear(4, 12)}
    layers["bf16"].weight.data = layers["bf16"].weight.data.to(torch.bfloat16)
    before = {name: layer.weight.clone() for name, layer in layers.items()}
    assert {name: store_input_major(layer) for name, layer in layers.items()} == {
        "up": True, "down": False, "square": True, "bf16": False}
    assert layers["up"].weight.t().is_contiguous() and layers["square"].weight.t().is_contiguous()
    assert layers["down"].weight.is_contiguous() and layers["bf16"].weight.is_contiguous()
    assert all(torch.equal(before[name], layer.weight) for name, layer in layers.items())
    assert not store_input_major(layers["up"])  # already input-major
    # the method that stores them so computes what torch's product on the checkpoint's layout computes
    x = torch.randn(3, 4)
    up = Linear.of(before["up"].clone(), None, TorchLinear(input_major=True))
    assert up.weight.t().is_contiguous()
    torch.testing.assert_close(up(x), Linear.of(before["up"].clone(), None, TORCH)(x), rtol=1e-6, atol=1e-6)


def test_swiglu_is_down_of_silu_gate_times_up():
    torch.manual_seed(0)
    mlp = SwiGLUMLP(16, 24)
    x = torch.randn(3, 16)
    gate, up = F.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
    assert torch.equal(mlp(x), F.linear(F.silu(gate) * up, mlp.down_proj.weight))


@pytest.mark.parametrize("avx512", [False, True], ids=["avx2", "avx512"])
def test_float32_weights_stay_row_major_where_the_kernels_decode_without_avx512(tiny_model_dir, avx512):
    """Where firsttoken's kernels take the decode products on an AVX2 CPU, the widening decoder weights keep the
    checkpoint's row-major layout (that loop streams them faster); elsewhere (AVX-512, MKL's products, quantized
    weights) they are stored input-major as before; the vision tower's always keep the checkpoint's. The values
    never change."""
    from firsttoken.loading.fused_decode import FusedDecode
    from firsttoken.loading.loader import load_model
    from firsttoken.loading.load_plan import keeps_row_major
    from tests.conftest import require_program
    from tests.helpers import machine_with_cpu

    require_program("cc", "gcc", "gcc")  # the kernels are built with it
    machine = machine_with_cpu(flags={"avx2", "fma"} | ({"avx512f"} if avx512 else set()), vendor="AuthenticAMD")
    assert keeps_row_major("none", None, machine.cpu) is not avx512
    assert not keeps_row_major("none", "--cpu-kernels off", machine.cpu)
    assert not keeps_row_major("int8", None, machine.cpu)
    on = load_model(tiny_model_dir, torch.float32, cpu_kernels="on", machine=machine)
    off = load_model(tiny_model_dir, torch.float32, cpu_kernels="off", machine=machine)
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        w_on, w_off = on.get_submodule(f"layers.0.{name}").weight, off.get_submodule(f"layers.0.{name}").weight
        assert torch.equal(w_on, w_off)
        assert w_off.t().is_contiguous() and not w_off.is_contiguous()  # MKL's decode products: input-major
        assert w_on.is_contiguous() is not avx512
    assert off.visual.blocks[0].mlp.fc1.weight.is_contiguous()  # a widening vision weight: as the checkpoint's
    assert isinstance(on.decode, FusedDecode)  # the fused decode layers take either layout
