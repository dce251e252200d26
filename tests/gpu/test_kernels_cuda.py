"""The Triton attention kernels compiled for the device, against firsttoken's SDPA backend on the same device at
realistic shapes (Qwen2-VL-7B's language model: 28 query heads over 4 KV heads, head_dim 128; Qwen3-VL-8B's: 32 over
8), and the unit tests' boundary cases (tests/unit/test_triton_attention.py) compiled rather than interpreted.

Tolerances: fp32 1e-4 absolute (the kernels take IEEE dots; SDPA's own float32 kernels differ in summation order
over thousands of keys), bf16 3e-2 against the float32 SDPA result on the same bf16-rounded inputs."""

from __future__ import annotations

import random

import pytest
import torch

from firsttoken.attention import triton_kernels as tk
from firsttoken.attention.base import AttentionMetadata
from firsttoken.attention.registry import get_backend
from firsttoken.attention.sdpa import write_kv
from firsttoken.attention.triton_backend import TritonBackend

# The unit tests' cases, collected here too: on this machine they run the compiled kernels on cuda.
from tests.unit.test_triton_attention import (  # noqa: F401
    test_decode_splits_agree_with_one_split,
    test_paged_decode_matches_float64_and_sdpa,
    test_paged_prefill_bf16,
    test_paged_prefill_matches_float64_and_sdpa,
    test_paged_prefill_query_tiles_split_a_chunk,
    test_varlen_attention_gqa_and_causal,
    test_vision_varlen_windows_match_per_segment_sdpa,
)

BLOCK_SIZE = 16
FP32_TOL = 1e-4
BF16_TOL = 3e-2
SHAPES = {"qwen2-vl-7b": (28, 4, 128), "qwen3-vl-8b": (32, 8, 128)}  # query heads, KV heads, head_dim


def test_the_kernels_are_compiled_here() -> None:
    assert not tk.INTERPRETED and torch.cuda.is_available()


def paged_batch(query_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, seed: int):
    """q/k/v of the new tokens, a cache on shuffled blocks holding each sequence's context, and the metadata."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = sum(-(-(q + c) // BLOCK_SIZE) for q, c in zip(query_lens, context_lens)) + 8
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    kv_cache = torch.zeros(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device="cuda")
    tables = []
    for q_len, ctx_len in zip(query_lens, context_lens):
        blocks = [free.pop() for _ in range(-(-(q_len + ctx_len) // BLOCK_SIZE))]
        tables.append(blocks)
        if ctx_len:
            k = torch.randn(ctx_len, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
            v = torch.randn(ctx_len, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
            slots = torch.tensor([blocks[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(ctx_len)],
                                 device="cuda")
            write_kv(k, v, kv_cache, slots)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen, device="cuda").to(dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK_SIZE, device="cuda")
    return q, k, v, kv_cache, meta


REALISTIC = [  # query lens, context lens
    pytest.param([2048], [0], id="first-chunk-2048"),
    pytest.param([512], [3001], id="chunk-512-after-3001-midblock"),
    pytest.param([1, 37, 256, 1, 16, 100, 1, 64], [700, 0, 1024, 33, 16, 5, 2047, 300], id="8-mixed"),
    pytest.param([1], [4095], id="decode-b1-4k"),
    pytest.param([1] * 16, [2047] * 16, id="decode-b16-2k"),
    pytest.param([1] * 64, [200 + 15 * i for i in range(64)], id="decode-b64-200..1145"),
]


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("query_lens,context_lens", REALISTIC)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_backend_matches_sdpa_at_model_shapes(model, query_lens, context_lens, dtype) -> None:
    heads, kv_heads, head_dim = SHAPES[model]
    q, k, v, kv_cache, meta = paged_batch(query_lens, context_lens, heads, kv_heads, head_dim, dtype,
                                          seed=len(query_lens))
    scale = head_dim**-0.5
    reference = get_backend("sdpa").forward(q.float(), k.float(), v.float(), kv_cache.float(), meta, scale)
    out = TritonBackend().forward(q, k, v, kv_cache, meta, scale)
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.shape == q.shape
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    err = (out.float() - reference).abs().max().item()
    assert err < tol, f"max abs error {err:.3g} >= {tol}"
