"""Issue 39's Triton attention kernels under Triton's CPU interpreter, against float64 torch math and the SDPA backend.

TRITON_INTERPRET=1 must be set before triton's first import: triton reads it when it defines its own language
helpers and when our kernels are decorated. transformers' modeling modules import triton (through torch._dynamo)
when other test modules are collected, so tests/conftest.py sets it before any test module where CUDA is absent;
this module sets it too for a run outside that conftest. Where CUDA is present the same tests run the compiled
kernels on the device. Skipped only when triton is not installed.

Shapes stay small (the interpreter runs each program through NumPy): block size 16, few heads, short sequences.
fp32 tolerance: 1e-5 absolute against float64 math on N(0, 1) inputs (observed at most 8e-7); bf16: 3e-2
against float64 math on the bf16-rounded inputs (observed 8.5e-3).
"""

from __future__ import annotations

import os
import random
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():  # an earlier import keeps its mode (below)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from firsttoken.attention import triton_kernels as tk  # noqa: E402
from firsttoken.attention.base import AttentionMetadata  # noqa: E402
from firsttoken.attention.registry import get_backend  # noqa: E402
from firsttoken.attention.sdpa import write_kv  # noqa: E402
from firsttoken.attention.triton_backend import TritonBackend, vision_attention  # noqa: E402

if tk.INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():  # a GPU machine (tests/conftest.py leaves the interpreter off): compiled kernels
    DEVICE = "cuda"
else:
    raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it before any "
                       "test module; something imported triton before that)")

BLOCK_SIZE = 16
NUM_BLOCKS = 128
FP32_TOL = 1e-5
BF16_TOL = 3e-2


def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, context_len: int
                     ) -> torch.Tensor:
    """Float64 attention of one whole sequence (q/k/v [seq, heads, d], GQA by repetition); the rows of the tokens
    after ``context_len``, each over keys 0 .. its own position."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    seq = q.shape[0]
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)[context_len:]


def paged_case(query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
               seed: int, dtype: torch.dtype = torch.float32):
    """Sequences on shuffled cache blocks with their contexts already cached; returns the new tokens' q/k/v,
    the cache, the metadata, the scale and the float64 expected output."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    tables, news, expected = [], [], []
    for q_len, ctx_len in zip(query_lens, context_lens):
        seq_len = q_len + ctx_len
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        tables.append(blocks)
        q = torch.randn(seq_len, num_heads, head_dim, generator=gen).to(DEVICE, dtype)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        expected.append(causal_reference(q, k, v, scale, ctx_len))
        slots = torch.tensor([blocks[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(ctx_len)])
        write_kv(k[:ctx_len], v[:ctx_len], kv_cache, slots.long().to(DEVICE))
        news.append((q[ctx_len:], k[ctx_len:], v[ctx_len:]))
    meta = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK_SIZE, device=DEVICE)
    q, k, v = (torch.cat(parts) for parts in zip(*news))
    return q, k, v, kv_cache, meta, scale, torch.cat(expected)


def check_against_sdpa(q, k, v, kv_cache, meta, scale, out) -> None:
    """The SDPA backend on a copy of the cache as it was before the Triton forward (the forward rewrote the same
    slots with the same values, so the cache itself serves)."""
    reference = get_backend("sdpa").forward(q, k, v, kv_cache.clone(), meta, scale)
    torch.testing.assert_close(out, reference, atol=FP32_TOL, rtol=0)


# ------------------------------------------------------------------------------------------- (a) paged prefill

PREFILL_CASES = [
    # head_dim, heads, kv heads (GQA ratio), query lens, context lens
    # ratio 1: a chunk of 1 after a prefix ending mid-block, a whole block as a first chunk, a chunk ending mid-block
    pytest.param(64, 2, 2, [1, 16, 5], [21, 0, 40], id="d64-gqa1-chunk1-wholeblock-midblock"),
    # ratio 4, head_dim 80 (masked to 128): a whole-block chunk after a whole-block prefix; a first token alone
    pytest.param(80, 4, 1, [16, 1, 23], [16, 0, 37], id="d80-gqa4-blockaligned-first-token"),
    # ratio 7 (group padded to 8), head_dim 128: contexts across many blocks
    pytest.param(128, 7, 1, [3, 17], [70, 5], id="d128-gqa7-many-blocks"),
]


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,query_lens,context_lens", PREFILL_CASES)
def test_paged_prefill_matches_float64_and_sdpa(head_dim, num_heads, num_kv_heads, query_lens, context_lens) -> None:
    q, k, v, kv_cache, meta, scale, expected = paged_case(query_lens, context_lens, num_heads, num_kv_heads,
                                                          head_dim, seed=head_dim)
    assert not meta.is_pure_decode
    out = TritonBackend(block_m=16, block_n=32).forward(q, k, v, kv_cache, meta, scale)
    assert (out.double() - expected).abs().max().item() < FP32_TOL
    check_against_sdpa(q, k, v, kv_cache, meta, scale, out)
    # the chunk's keys landed where the block tables say
    torch.testing.assert_close(kv_cache[0].view(-1, num_kv_heads, head_dim)[meta.slot_mapping], k, atol=0, rtol=0)


def test_paged_prefill_query_tiles_split_a_chunk() -> None:
    """A chunk longer than one program's query tile (several tiles per sequence, the causal bound per tile)."""
    q, k, v, kv_cache, meta, scale, expected = paged_case([37], [9], 2, 1, 64, seed=5)
    out = tk.paged_prefill(q, *_written(k, v, kv_cache, meta), meta.query_start_loc, meta.seq_lens_tensor,
                           max(meta.query_lens), scale, block_m=16, block_n=16)
    assert (out.double() - expected).abs().max().item() < FP32_TOL


def _written(k, v, kv_cache, meta):
    write_kv(k, v, kv_cache, meta.slot_mapping)
    return kv_cache, meta.block_tables


def test_paged_prefill_bf16() -> None:
    q, k, v, kv_cache, meta, scale, expected = paged_case([20, 1], [11, 30], 4, 1, 64, seed=8, dtype=torch.bfloat16)
    out = TritonBackend(block_m=16, block_n=32).forward(q, k, v, kv_cache, meta, scale)
    assert out.dtype == torch.bfloat16
    assert (out.double() - expected).abs().max().item() < BF16_TOL


# ------------------------------------------------------------------------------------------------- (b) decode

DECODE_CASES = [
    # head_dim, heads, kv heads, context lens, splits
    # 64 sequences of tiny contexts (1..20 tokens: prefixes ending mid-block and on a block edge), one split
    pytest.param(64, 2, 2, [(i * 7) % 20 for i in range(64)], 1, id="d64-gqa1-64seqs"),
    # head_dim 80, ratio 4: contexts across many blocks, 4 splits (the 36-token context leaves a split empty)
    pytest.param(80, 4, 1, [199, 36, 128], 4, id="d80-gqa4-4splits"),
    # head_dim 128, ratio 7: 3 splits, one sequence of 1 token (its only key is itself)
    pytest.param(128, 7, 1, [150, 0], 3, id="d128-gqa7-3splits"),
]


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,context_lens,num_splits", DECODE_CASES)
def test_paged_decode_matches_float64_and_sdpa(head_dim, num_heads, num_kv_heads, context_lens, num_splits) -> None:
    q, k, v, kv_cache, meta, scale, expected = paged_case([1] * len(context_lens), context_lens, num_heads,
                                                          num_kv_heads, head_dim, seed=head_dim + 1)
    assert meta.is_pure_decode
    out = TritonBackend(num_splits=num_splits, block_n=16).forward(q, k, v, kv_cache, meta, scale)
    assert (out.double() - expected).abs().max().item() < FP32_TOL
    check_against_sdpa(q, k, v, kv_cache, meta, scale, out)


def test_decode_splits_agree_with_one_split() -> None:
    """Split-K partials merged by log-sum-exp equal the unsplit pass (up to fp32 summation order)."""
    q, k, v, kv_cache, meta, scale, expected = paged_case([1, 1], [90, 47], 4, 2, 64, seed=3)
    write_kv(k, v, kv_cache, meta.slot_mapping)
    one = tk.paged_decode(q, kv_cache, meta.block_tables, meta.seq_lens_tensor, scale, 1, block_n=16)
    five = tk.paged_decode(q, kv_cache, meta.block_tables, meta.seq_lens_tensor, scale, 5, block_n=16)
    torch.testing.assert_close(one, five, atol=FP32_TOL, rtol=0)
    assert (five.double() - expected).abs().max().item() < FP32_TOL


def test_decode_num_splits_heuristic() -> None:
    assert tk.decode_num_splits(100, 1, 8, num_sms=132) == 1  # short context: one split
    assert tk.decode_num_splits(32768, 1, 8, num_sms=132) == 32  # long context, few programs: capped
    assert tk.decode_num_splits(32768, 64, 8, num_sms=132) == 1  # the batch alone fills the device


# --------------------------------------------------------------------------------------------------- (c) vision

@pytest.mark.parametrize("head_dim", [80, 72], ids=["d80-qwen2vl", "d72-qwen3vl"])
def test_vision_varlen_windows_match_per_segment_sdpa(head_dim) -> None:
    """Two images cut into Qwen2.5-VL-like windows of unequal sizes (a 1-row segment included), each window
    attending over itself only, in the towers' layout [1, heads, patches, head_dim]; against the towers' own
    per-segment SDPA."""
    segments = [16, 8, 12, 4, 1, 23]  # image 1: windows 16, 8, 12, 4; image 2: windows 1, 23
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(1, 2, sum(segments), head_dim, generator=gen).to(DEVICE) for _ in range(3))
    out = vision_attention(q, k, v, segments)
    expected = torch.cat([torch.nn.functional.scaled_dot_product_attention(qi.double(), ki.double(), vi.double())
                          for qi, ki, vi in zip(q.split(segments, 2), k.split(segments, 2), v.split(segments, 2))],
                         dim=2)
    assert out.shape == q.shape
    assert (out.double() - expected).abs().max().item() < FP32_TOL


def test_varlen_attention_gqa_and_causal() -> None:
    """The varlen kernel's other options: GQA (ratio 4) and causal within each segment."""
    cu = torch.tensor([0, 5, 25], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(25, 4, 64, generator=gen).to(DEVICE)
    k, v = torch.randn(25, 1, 64, generator=gen).to(DEVICE), torch.randn(25, 1, 64, generator=gen).to(DEVICE)
    out = tk.varlen_attention(q, k, v, cu, 20, scale=0.1, causal=True, block_m=16, block_n=16)
    expected = torch.cat([causal_reference(q[a:b], k[a:b], v[a:b], 0.1, 0) for a, b in [(0, 5), (5, 25)]])
    assert (out.double() - expected).abs().max().item() < FP32_TOL


def test_backend_is_registered_by_name() -> None:
    assert isinstance(get_backend("triton"), TritonBackend)


def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    """The interpreter checks what the kernels compute, not that Triton's compiler takes them: lower each kernel
    (bf16, head_dim 80, GQA group 8) to an sm_90 cubin in a process without the interpreter (ptxas ships with
    triton). Also checked by hand with Triton 3.6.0, the GPU machine's version: every kernel, fp32 and bf16,
    head_dim 64/80/128."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while it is unset
    result = subprocess.run(
        [sys.executable, "-m", "firsttoken.attention.triton_aot", "--arch", "90", "--dtype", "bf16",
         "--head-dim", "80", "--group", "8"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == 4, result.stdout


def test_gpu_kernels_check_script_runs_its_plumbing_and_refuses_without_cuda(tmp_path) -> None:
    """benchmarks/gpu/kernels_check.py: tiny shapes under the interpreter (every case within tolerance, JSON
    written), and, without CUDA, one line and exit status 2."""
    import json
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "kernels_check.py"
    out = tmp_path / "kernels.json"
    smoke = subprocess.run([sys.executable, str(script), "--out", str(out), "--interpret-smoke"],
                           capture_output=True, text=True, timeout=300)
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    results = json.loads(out.read_text())
    assert results["interpret_smoke"] and len(results["cases"]) == 6
    assert all(case["ok"] for case in results["cases"])
    if torch.cuda.is_available():
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    refused = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "none.json")], env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and not (tmp_path / "none.json").exists()
    assert refused.stdout == "" and refused.stderr.count("\n") == 1 and "no CUDA device" in refused.stderr


def test_tiny_model_through_the_triton_backend_matches_the_sdpa_backend(tiny_model_dir) -> None:
    """The backend under the model code's own calls (the tiny Qwen2-VL: 2 layers, 4 heads over 2 KV heads,
    head_dim 16, M-RoPE applied before attention): a prompt prefilled in two chunks (the second after a whole
    block) beside a whole prompt, then a mixed step (a chunk and a decode token: the prefill kernel), then pure
    decode steps (the decode kernels). Same greedy tokens and logits within 1e-4 (logits have std ~10) of the
    SDPA backend's; observed 2e-5."""
    from firsttoken.loading.loader import load_model
    from firsttoken.runner.kv_cache import allocate_kv_caches

    block = 16
    tables = [[5, 2], [7]]
    steps = [[16, 9], [7, 1], [1, 1], [1, 1]]  # query lens per step: sequence 0's prompt is 23 tokens, 1's is 9
    gen = torch.Generator().manual_seed(0)
    runs = {}
    for name, backend in (("sdpa", None), ("triton", TritonBackend(num_splits=2, block_n=16))):
        model = load_model(tiny_model_dir, torch.float32, attn_backend=backend, cpu_kernels="off")
        config = model.config
        if not runs:
            prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (23, 9)]
        caches = allocate_kv_caches(config, 10, block, torch.float32, "cpu")
        tokens, context, logits_per_step = [list(p) for p in prompts], [0, 0], []
        for query_lens in steps:
            ids, positions = [], []
            for i, q in enumerate(query_lens):
                ids += tokens[i][context[i]:context[i] + q]
                positions += range(context[i], context[i] + q)
            meta = AttentionMetadata.build(query_lens, context, [t[:-(-(c + q) // block)] for t, c, q in
                                                                 zip(tables, context, query_lens)], block)
            with torch.no_grad():
                hidden = model(torch.tensor(ids), torch.tensor(positions).expand(3, -1).contiguous(), caches, meta)
                logits = model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1])
            logits_per_step.append(logits)
            for i, q in enumerate(query_lens):
                context[i] += q
                if context[i] == len(tokens[i]):  # the prompt's (or the last token's) last row: sample greedily
                    tokens[i].append(int(logits[i].argmax()))
        runs[name] = tokens, logits_per_step
    assert runs["triton"][0] == runs["sdpa"][0]
    for ours, reference in zip(runs["triton"][1], runs["sdpa"][1]):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
