"""Triton attention kernels over the paged KV cache (issue 39): prefill chunks, split-K decode,
vision varlen.

Importing this module imports triton and defines the kernels with ``@triton.jit``; triton decides at
that moment whether a kernel runs compiled (CUDA) or through its NumPy interpreter
(``TRITON_INTERPRET=1``, CPU tensors). So set ``TRITON_INTERPRET`` before the first import of this
module; the backend (``triton_backend.py``) imports it lazily, and the package imports without
triton installed.

Layouts (those of ``attention/base.py``):
- q, and the output: ``[num_tokens, num_heads, head_dim]``; new tokens of all sequences back to
  back, sequence ``i`` owning rows ``cu_seqlens_q[i] : cu_seqlens_q[i + 1]``;
- the cache of one layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; logical key ``j``
  of sequence ``i`` sits in block ``block_tables[i, j // block_size]`` at offset ``j % block_size``;
- GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

One online-softmax loop serves all three kernels. A program owns one KV head and a tile of query
*rows*, where a row is (query token, query head of that KV head's group): the group's heads are
folded into the rows (group padded to a power of two, the padding rows masked), so each key/value
tile is loaded once per group, as vLLM's unified attention does. Scores are kept in base 2
(``scale * log2(e)`` folded into the scale, ``exp2``); the log-sum-exps the decode partials hand to
the reduce are base 2 too. head_dim is padded to a power of two and masked (80 -> 128). fp32 inputs
take ``tl.dot`` in IEEE precision (no TF32), so fp32 results are comparable to the SDPA reference;
bf16/fp16 inputs take the tensor-core dot with fp32 accumulation.

Only long-standing Triton language features are used (the GPU machine has Triton 3.6): masked
``tl.load``/``tl.store``, ``tl.dot(..., input_precision=)``, ``tl.exp2``/``tl.log2``,
``tl.maximum``/``tl.max``/ ``tl.sum``, ``tl.where``, ``tl.cdiv``, ``tl.program_id``, ``tl.arange``,
``tl.constexpr``; every kernel compiles for sm_90 under Triton 3.6.0 and 3.9.0 (``triton_aot.py``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Whether triton was first imported under TRITON_INTERPRET=1: its own language helpers (tl.zeros,
# ...) are then interpreted too. Setting the variable after triton's import makes our kernels
# interpreted but not those helpers, which then fail inside a kernel, hence this check rather than
# reading the environment.
INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, k, v, valid, scale_log2, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr
):
    """One online-softmax step: q [M, D], k [D, N] (transposed), v [N, D], valid [M, N]. UPCAST (the
    interpreter with 16-bit inputs, whose tl.dot multiplies bf16 bit patterns as integers in Triton
    3.9): the 16-bit operands go to fp32 first, the same products a tensor-core dot accumulates in
    fp32."""
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no valid key so far: no NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)  # a 16-bit V takes 16-bit probabilities (flash attention's rounding)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _key_offsets(n, n_ok, seq, kv_head, k_start, block_tables, stride_bt, stride_kb, stride_ks,
                 stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE: tl.constexpr,
                 PAGED: tl.constexpr):
    """Element offsets of keys ``n`` (the sequence's logical positions) of ``kv_head`` in K and
    V: through the block table (paged), or from the sequence's first key ``k_start``."""
    if PAGED:
        blk = tl.load(block_tables + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(
            tl.int64
        )
        slot = n % BLOCK_SIZE
        k_off = blk * stride_kb + slot * stride_ks + kv_head * stride_kh
        v_off = blk * stride_vb + slot * stride_vs + kv_head * stride_vh
    else:
        key = (k_start + n).to(tl.int64)
        k_off = key * stride_kb + kv_head * stride_kh
        v_off = key * stride_vb + kv_head * stride_vh
    return k_off, v_off


@triton.jit
def _varlen_attention_kernel(
    Q, K, V, O,
    cu_seqlens_q,  # [num_seqs + 1] int32
    cu_seqlens_k,  # [num_seqs + 1] int32: keys of contiguous K/V (PAGED False)
    # [num_seqs] int32: keys per sequence (context + chunk) in the paged cache (PAGED True)
    seq_lens,
    block_tables,  # [num_seqs, max_blocks] int32 (PAGED True)
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    # paged: block, slot in block, head; contiguous: token, (unused), head
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    num_q_per_kv,
    BLOCK_SIZE: tl.constexpr,  # cache block (page) size
    BLOCK_Q: tl.constexpr,  # query tokens per program
    GROUP: tl.constexpr,  # num_q_per_kv padded to a power of two
    BLOCK_N: tl.constexpr,  # keys per tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        if PAGED:
            k_start = 0
            kv_len = tl.load(seq_lens + seq)
        else:
            k_start = tl.load(cu_seqlens_k + seq)
            kv_len = tl.load(cu_seqlens_k + seq + 1) - k_start
        context_len = kv_len - q_len  # causal: chunk token t is logical position context_len + t

        rows = tl.arange(0, BLOCK_Q * GROUP)
        tok = q_block * BLOCK_Q + rows // GROUP
        in_group = rows % GROUP
        head = kv_head * num_q_per_kv + in_group
        row_ok = (tok < q_len) & (in_group < num_q_per_kv)
        d = tl.arange(0, HEAD_DIM_P2)
        d_ok = d < HEAD_DIM
        q_rows = (q_start + tok).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_Q * GROUP], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP, HEAD_DIM_P2], tl.float32)
        if CAUSAL:  # keys past this tile's last query position are never read
            last_tok = tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
            kv_end = tl.minimum(kv_len, context_len + last_tok + 1)
        else:
            kv_end = kv_len
        for start in range(0, kv_end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < kv_end
            k_off, v_off = _key_offsets(
                n, n_ok, seq, kv_head, k_start, block_tables, stride_bt, stride_kb, stride_ks,
                stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, PAGED,
            )
            k = tl.load(
                K + k_off[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0
            )
            v = tl.load(
                V + v_off[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0
            )
            valid = n_ok[None, :]
            if CAUSAL:
                valid = valid & (n[None, :] <= (context_len + tok)[:, None])
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k, v, valid, scale_log2, DOT_PRECISION, UPCAST
            )

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_partial_kernel(
    Q, K, V, MidO, MidLse,
    seq_lens,  # [num_seqs] int32: keys per sequence, the new token's included
    block_tables,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    num_q_per_kv, num_heads, num_splits,
    BLOCK_SIZE: tl.constexpr,
    # rows per program: num_q_per_kv padded to a power of two, at least 16 (tl.dot)
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Split ``split`` of one sequence's keys for one KV head's query heads: the normalized partial
    output and its base-2 log-sum-exp (-inf for an empty split), at MidO[seq, head, split],
    MidLse[seq, head, split]."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(seq_lens + seq)
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N  # whole tiles per split
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kv_len)

    rows = tl.arange(0, GROUP)
    head = kv_head * num_q_per_kv + rows
    row_ok = rows < num_q_per_kv
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM_P2], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        blk = tl.load(block_tables + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(
            tl.int64
        )
        slot = n % BLOCK_SIZE
        k = tl.load(
            K + (blk * stride_kb + slot * stride_ks + kv_head * stride_kh)[None, :] + d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            V + (blk * stride_vb + slot * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k, v, n_ok[None, :], scale_log2, DOT_PRECISION, UPCAST
        )

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    mid = (seq * num_heads + head).to(tl.int64) * num_splits + split  # [GROUP]
    tl.store(MidO + mid[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(MidLse + mid, lse, mask=row_ok)


@triton.jit
def _decode_reduce_kernel(
    MidO, MidLse, O,
    stride_ot, stride_oh,
    num_heads, num_splits,
    SPLITS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    """Merge one (sequence, head)'s split partials: weights 2^(lse - max lse), renormalized."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < num_splits
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    base = (seq * num_heads + head).to(tl.int64) * num_splits
    lse = tl.load(MidLse + base + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)  # split 0 is never empty: finite
    w = tl.exp2(lse - top)
    parts = tl.load(
        MidO + (base + s)[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        O + seq.to(tl.int64) * stride_ot + head * stride_oh + d,
        out.to(O.dtype.element_ty),
        mask=d_ok,
    )


# ------------------------------------------------------------------------------------ host wrappers


def _dot_args(dtype: torch.dtype) -> dict[str, object]:
    """fp32: IEEE dots (no TF32), so fp32 results are comparable to the SDPA reference; 16-bit
    operands ignore the precision. UPCAST: 16-bit operands to fp32 before tl.dot, under the
    interpreter only."""
    return {"DOT_PRECISION": "ieee" if dtype == torch.float32 else None,  # None: tl.dot's default
            "UPCAST": INTERPRETED and dtype != torch.float32}


def _group(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    ratio = num_heads // num_kv_heads
    return ratio, triton.next_power_of_2(ratio)


def _check_operands(*tensors: torch.Tensor) -> None:
    if tensors[0].device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"the Triton attention kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton is first "
            f"imported to run on {tensors[0].device.type} tensors"
        )
    for t in tensors:
        if t.dtype != tensors[0].dtype:
            raise ValueError(f"q is {tensors[0].dtype} but another operand is {t.dtype}: the kernels take one dtype")
        if t.stride(-1) != 1:
            raise ValueError("the head dimension must be contiguous (stride 1)")


def _block_q(group: int, block_m: int) -> int:
    """Query tokens per program so that tokens x group rows is ``block_m`` (at least 16 rows:
    tl.dot)."""
    return max(1, max(block_m, 16) // group)


def paged_prefill(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    # [2, num_blocks, block_size, num_kv_heads, head_dim], the chunk's K/V written
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: context + chunk
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Each sequence's chunk of new queries over its cached prefix and itself, causal within the
    chunk (query t of sequence i sees its logical keys 0 .. seq_lens[i] - query_len[i] + t), K/V
    read from the paged cache."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    ratio, group = _group(num_heads, num_kv_heads)
    out = torch.empty_like(q) if out is None else out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _check_operands(q, k_cache, v_cache, out)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_q = _block_q(group, block_m)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _varlen_attention_kernel[grid](
        q, k_cache, v_cache, out,
        cu_seqlens_q, cu_seqlens_q, seq_lens, block_tables,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        ratio,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, GROUP=group, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        PAGED=True, CAUSAL=True, **_dot_args(q.dtype),
    )
    return out


def varlen_attention(
    q: torch.Tensor,  # [total_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [total_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    # [num_segments + 1] int32: segment i = rows cu_seqlens[i] : cu_seqlens[i + 1]
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    causal: bool = False,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Block-diagonal attention: each segment's queries over that segment's keys only (the vision
    towers: one segment an image, or, for Qwen2.5-VL's window blocks, one segment a window).
    Non-causal unless asked."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    ratio, group = _group(num_heads, num_kv_heads)
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    _check_operands(q, k, v, out)
    num_segments = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_segments == 0:
        return out
    block_q = _block_q(group, block_m)
    grid = (num_segments, triton.cdiv(max_seqlen, block_q), num_kv_heads)
    _varlen_attention_kernel[grid](
        q, k, v, out,
        # seq_lens / block_tables unused (PAGED False)
        cu_seqlens, cu_seqlens, cu_seqlens, cu_seqlens,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), 0, k.stride(1),
        v.stride(0), 0, v.stride(1),
        0,
        ratio,
        BLOCK_SIZE=1, BLOCK_Q=block_q, GROUP=group, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        PAGED=False, CAUSAL=causal, **_dot_args(q.dtype),
    )
    return out


def decode_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int, num_sms: int = 132,
                      min_keys_per_split: int = 256, max_splits: int = 32) -> int:
    """Splits per sequence: enough programs to fill the device (about two per SM), never a split
    under ``min_keys_per_split`` keys, at most ``max_splits``."""
    programs = max(1, num_seqs * num_kv_heads)
    want = max(1, math.ceil(2 * num_sms / programs))
    cap = max(1, max_seq_len // min_keys_per_split)
    return max(1, min(want, cap, max_splits))


def paged_decode(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query per sequence
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,  # [num_seqs] int32, the new token included
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """One query per sequence over its whole paged context, each sequence's keys cut in
    ``num_splits`` ranges of whole tiles (split-K: partial outputs + log-sum-exps, fp32), merged by
    a reduce kernel."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    ratio, group = _group(num_heads, num_kv_heads)
    out = torch.empty_like(q) if out is None else out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _check_operands(q, k_cache, v_cache, out)
    if num_seqs == 0:
        return out
    num_splits = max(1, int(num_splits))
    mid_o = torch.empty(
        num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    mid_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    head_dim_p2 = triton.next_power_of_2(head_dim)
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, mid_o, mid_lse, seq_lens, block_tables,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        ratio, num_heads, num_splits,
        BLOCK_SIZE=block_size, GROUP=max(16, group), BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2, **_dot_args(q.dtype),
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
        SPLITS_P2=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2,
    )
    return out
