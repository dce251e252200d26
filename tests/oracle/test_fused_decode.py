"""A decode step's decoder layers in one C call (firsttoken/loading/fused_decode.py), bf16 and float32: as accurate
as the eager layers against a float64 model holding the same weights, a row bitwise the same whatever shares its
step, the paged cache written at the rows' slots only, and taken exactly where it applies."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from firsttoken.attention.base import AttentionMetadata
from firsttoken.kernels import cpu_linear
from firsttoken.kernels.cpu_features import CpuFeatures
from firsttoken.loading.fused_decode import FusedDecode
from firsttoken.loading.loader import load_model
from firsttoken.models.checkpoint import make_model
from firsttoken.models.decode import EAGER

BLOCK = 16


@pytest.fixture(scope="module", params=[("qwen2-vl", torch.bfloat16, "none"), ("qwen3-vl", torch.bfloat16, "none"),
                                        ("qwen2-vl", torch.float32, "none"), ("qwen3-vl", torch.float32, "none"),
                                        ("qwen2-vl", torch.float32, "bf16"), ("qwen2-vl", torch.float32, "int8")],
                ids=["qwen2-vl-bf16", "qwen3-vl-bf16", "qwen2-vl-fp32", "qwen3-vl-fp32", "qwen2-vl-bf16-weights",
                     "qwen2-vl-int8"])
def models(request, tmp_path_factory: pytest.TempPathFactory, kernel_built):
    """(model with the fused layers, float64 model holding the very same weights). bf16-weights: float32
    activations, the linear layers' weights bf16 (--quantization bf16). int8 (--quantization int8): no float64
    twin (its products quantize their inputs), None in its place: its reference is its own eager step."""
    family, dtype, quantization = request.param
    d: Path = make_model(tmp_path_factory.mktemp(f"fused-{family}"), size="tiny", seed=1, family=family)
    fused = load_model(d, dtype, cpu_kernels="on", quantization=quantization)
    assert isinstance(fused.decode, FusedDecode)
    if quantization == "int8":
        return fused, None
    ref = load_model(d, torch.float64, cpu_kernels="off")
    ref.load_state_dict({k: v.double() for k, v in fused.state_dict().items()})
    return fused, ref


def _cache(model, num_blocks: int = 48) -> list[torch.Tensor]:
    c = model.config
    return [torch.zeros(2, num_blocks, BLOCK, c.num_key_value_heads, c.head_dim, dtype=model.dtype)
            for _ in model.layers]


def _prefill(model, kv, lengths, tables, seed=0):
    """Each sequence's prompt through the eager layers (a prefill step): the cache the decode step reads."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].expand(3, -1)
    with torch.inference_mode():
        model(ids, pos, kv, AttentionMetadata.build(lengths, [0] * len(lengths), tables, BLOCK))


def _decode_inputs(model, lengths, tables, seed=1):
    """(input ids, positions, metadata) of one decode token per sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (len(lengths),), generator=g)
    pos = torch.tensor(lengths)[None].expand(3, -1)
    return ids, pos, AttentionMetadata.build([1] * len(lengths), lengths, tables, BLOCK)


def _decode(model, kv, lengths, tables, fused: bool, seed=1):
    """One decode token per sequence, as the runner asks for it (every row samples); returns (final hidden
    [M, hidden], logits [M, vocab] float64). ``fused`` False: the model's eager layers instead of its decode
    method."""
    ids, pos, meta = _decode_inputs(model, lengths, tables, seed)
    keep = model.decode
    model.decode = keep if fused else EAGER
    try:
        with torch.inference_mode():
            out = model.forward_step(ids, pos, kv, meta, all_logits=True)
            logits = out.logits if out.logits is not None else model.compute_logits(out.hidden)
            return out.hidden, logits.double()
    finally:
        model.decode = keep


# scattered, non-consecutive blocks; lengths across block boundaries
LENGTHS = [5, 33, 16, 70]
TABLES = [[7], [2, 9, 4], [11, 3], [20, 1, 30, 25, 14]]


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_as_accurate_as_the_eager_layers(models, rows):
    """Against float64 arithmetic on the same weights and the same cache, the fused step's logits err no more than
    the eager layers' (in bf16 both round every bf16 tensor; they sum in different orders) and pick the same
    token."""
    fused, ref = models
    lengths, tables = LENGTHS[:rows], TABLES[:rows]
    kv = _cache(fused)
    _prefill(fused, kv, lengths, tables)
    steps = fused.decode.steps
    _, got = _decode(fused, [t.clone() for t in kv], lengths, tables, fused=True)
    assert fused.decode.steps == steps + 1
    _, eager = _decode(fused, [t.clone() for t in kv], lengths, tables, fused=False)
    if ref is None:  # int8: the same row quantization and exact int32 products; norms and attention sum in
        # another order only, so the logits are the eager step's to float32 rounding
        assert (got - eager).abs().max().item() <= 1e-5 * eager.abs().max().item()
        assert torch.equal(got.argmax(-1), eager.argmax(-1))
        return
    _, want = _decode(ref, [t.double() for t in kv], lengths, tables, fused=False)
    err_fused, err_eager = (got - want).abs().max().item(), (eager - want).abs().max().item()
    slack = 0.02 if fused.dtype == torch.bfloat16 else 1e-5
    assert err_fused <= 1.5 * err_eager + slack, (err_fused, err_eager)
    top2 = want.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * err_fused
    assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided])


def test_the_final_norm_and_lm_head_ride_in_the_same_call(models):
    """Where the lm_head's method is one the fused layers run (the kernels', bf16 or int8 weights), the fused call
    also runs the final norm and the lm_head when every row of the step samples: its logits are bitwise what the
    eager lm_head gives for the step's hidden states (a subset of rows is computed as before). Asked for the hidden
    states alone, the call returns no logits."""
    fused, _ = models
    assert fused.decode.head is not None
    kv = _cache(fused)
    _prefill(fused, kv, LENGTHS, TABLES)
    ids, pos, meta = _decode_inputs(fused, LENGTHS, TABLES)
    steps = fused.decode.steps
    with torch.inference_mode():
        out = fused.forward_step(ids, pos, [t.clone() for t in kv], meta, all_logits=True)
        alone = fused.forward_step(ids, pos, [t.clone() for t in kv], meta)
        eager = fused.compute_logits(out.hidden).double()  # the eager lm_head, same kernel
        rows = fused.compute_logits(out.hidden[[1, 3]]).double()
    assert fused.decode.steps == steps + 2 and out.logits is not None and alone.logits is None
    logits = out.logits.double()
    assert torch.equal(eager, logits) and torch.equal(rows, logits[[1, 3]])
    # the final norm, in the call or after it: the same to rounding (the call sums in another order)
    torch.testing.assert_close(alone.hidden.float(), out.hidden.float(), rtol=1e-5, atol=1e-5)


def test_a_row_is_bitwise_the_same_whatever_shares_its_step(models):
    """A request's hidden state and cache writes do not depend on the other rows of its decode step, nor on the
    thread count."""
    fused, _ = models
    kv = _cache(fused)
    _prefill(fused, kv, LENGTHS, TABLES)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone_kv = [t.clone() for t in kv]
        alone, _ = _decode(fused, alone_kv, LENGTHS[2:3], TABLES[2:3], fused=True, seed=5)
        torch.set_num_threads(2)
        together_kv = [t.clone() for t in kv]
        ids_seed = 5  # the same token for row 2: decode rows drawn from one generator, row 2 fed alone above
        g = torch.Generator().manual_seed(ids_seed)
        token = torch.randint(0, fused.config.vocab_size, (1,), generator=g)
        ids = torch.cat([torch.tensor([3, 4]), token, torch.tensor([6])])
        meta = AttentionMetadata.build([1] * 4, LENGTHS, TABLES, BLOCK)
        with torch.inference_mode():
            together = fused.forward_step(ids, torch.tensor(LENGTHS)[None].expand(3, -1), together_kv, meta,
                                          all_logits=True).hidden  # as _decode asks
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together[2], alone[0])
    slot = TABLES[2][LENGTHS[2] // BLOCK] * BLOCK + LENGTHS[2] % BLOCK
    for a, b in zip(alone_kv, together_kv):
        assert torch.equal(a.view(2, -1, *a.shape[3:])[:, slot], b.view(2, -1, *b.shape[3:])[:, slot])


def test_the_cache_changes_at_the_rows_slots_only(models):
    fused, _ = models
    kv = _cache(fused)
    _prefill(fused, kv, LENGTHS, TABLES)
    after = [t.clone() for t in kv]
    eager = [t.clone() for t in kv]
    _decode(fused, after, LENGTHS, TABLES, fused=True)
    _decode(fused, eager, LENGTHS, TABLES, fused=False)
    slots = [t[n // BLOCK] * BLOCK + n % BLOCK for n, t in zip(LENGTHS, TABLES)]
    for layer, (old, new, ref) in enumerate(zip(kv, after, eager)):
        old, new, ref = (t.view(2, -1, *t.shape[3:]) for t in (old, new, ref))
        changed = (old != new).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
        assert sorted(changed) == sorted(slots), layer
        # the same keys and values as the eager layers wrote, up to their rounding differences
        torch.testing.assert_close(new[:, slots].float(), ref[:, slots].float(), rtol=0.05, atol=0.05)


def test_taken_for_pure_decode_steps_of_at_most_max_rows_only(models):
    """bf16: at most 16 rows with the AVX512-BF16 dot-product loop, 8 with the AVX2 loop (where the fused step beat
    the eager one), float32 16 (MAX_ROWS)."""
    fused, _ = models
    decoder = fused.decode
    dp = cpu_linear.built_kernels().bf16_dp
    assert decoder.max_rows == ((16 if dp else 8) if fused.dtype == torch.bfloat16 else 16)
    rows = decoder.max_rows + 1
    kv = _cache(fused, 64)
    lengths, tables = [3 + i % 8 for i in range(rows)], [[1 + i * 2] for i in range(rows)]
    _prefill(fused, kv, lengths, tables)
    steps = decoder.steps
    _decode(fused, kv, lengths, tables, fused=True)  # one row too many: the eager layers
    assert decoder.steps == steps
    _decode(fused, kv, [n + 1 for n in lengths[:-1]], tables[:-1], fused=True)
    assert decoder.steps == steps + 1
    # a step mixing a prefill chunk with a decode token: eager
    ids, pos = torch.arange(4), torch.tensor([9, 10, 11, 5])[None].expand(3, -1)
    meta = AttentionMetadata.build([3, 1], [9, 5], [[2], [1]], BLOCK)
    with torch.inference_mode():
        fused(ids, pos, kv, meta)
    assert decoder.steps == steps + 1


def test_only_with_the_kernels_and_not_for_fp16_weights(kernel_built, tiny_qwen2_vl_dir):
    def decode(dtype, **choices):
        return load_model(tiny_qwen2_vl_dir, dtype, **choices).decode

    for dtype in (torch.bfloat16, torch.float32):
        assert isinstance(decode(dtype, cpu_kernels="on"), FusedDecode)
        assert decode(dtype, cpu_kernels="off") is EAGER
    assert decode(torch.float16, cpu_kernels="on") is EAGER
    assert decode(torch.float32, cpu_kernels="on", quantization="fp16") is EAGER
    int8 = decode(torch.float32, cpu_kernels="on", quantization="int8")
    assert isinstance(int8, FusedDecode) and int8.head is not None
    assert decode(torch.float32, cpu_kernels="off", quantization="int8") is EAGER
    bf16_weights = decode(torch.float32, cpu_kernels="on", quantization="bf16")
    assert isinstance(bf16_weights, FusedDecode) and bf16_weights.head is not None
    assert decode(torch.float32, cpu_kernels="off", quantization="bf16") is EAGER


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_attention_loops_match_float64_attention(kernel_built, dtype):
    """The fused step's attention loops (the AVX-512 one where the CPU has AVX-512 and head_dim % 64 == 0, the AVX2
    one everywhere) against float64 softmax attention over cache rows scattered like a block table's: 1-100 keys
    (around the 8- and 16-key groups), 1, 4 and 6 query heads per KV head, head_dim 64 and 128, the second KV
    head. Where the CPU lacks AVX-512 the wide loop refuses instead of running."""
    lib = cpu_linear.built_kernels()
    flags = CpuFeatures.detect().flags or frozenset()
    assert lib.attention_avx512 == ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags)
    fn = lib.lib.ft_attend
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int]
    g = torch.Generator().manual_seed(0)
    slots, nkv, h = 160, 2, 1
    for d in (64, 128):
        keys = torch.randn(slots, nkv, d, generator=g).to(dtype)
        values = torch.randn(slots, nkv, d, generator=g).to(dtype)
        for heads in (1, 4, 6):
            q = torch.randn(heads, d, generator=g).to(dtype).float()
            for n in (1, 7, 15, 16, 17, 100):
                rows = torch.randperm(slots, generator=g)[:n]
                at = (rows * nkv * d).contiguous()
                scale = d ** -0.5
                k, v = keys[rows, h].double(), values[rows, h].double()
                want = torch.softmax(q.double() @ k.T * scale, -1) @ v
                for wide in ((0, 1) if lib.attention_avx512 else (0,)):
                    out = torch.empty(heads, d)
                    rc = fn(q.data_ptr(), heads, keys.data_ptr(), values.data_ptr(), at.data_ptr(), n, h, d, scale,
                            out.data_ptr(), int(dtype == torch.bfloat16), wide)
                    assert rc == 0
                    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=2e-5, msg=f"{d} {heads} {n} {wide}")
                if not lib.attention_avx512:
                    out = torch.empty(heads, d)
                    assert fn(q.data_ptr(), heads, keys.data_ptr(), values.data_ptr(), at.data_ptr(), n, h, d, scale,
                              out.data_ptr(), int(dtype == torch.bfloat16), 1) == -1
