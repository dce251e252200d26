"""CPU reference attention backend: paged KV cache +
``torch.nn.functional.scaled_dot_product_attention``.

Three paths, chosen per forward from the metadata alone:
- a sequence with ``context_len == 0`` (first prefill chunk) attends over its fresh k/v with
  ``is_causal=True``, so it never reads the cache back;
- a pure-decode batch (every ``query_len == 1``, batch 1 included) gathers all sequences'
  keys/values through the block table, padded to the longest sequence, and runs one batched SDPA
  with a key-padding mask (one call, never slower than a loop over the sequences; why:
  docs/runs/notes/2026-12-03-code-comment-figures.md); the gather copies whole blocks with
  ``index_select``, and a single sequence on consecutive blocks is read in place;
- any other sequence (a later prefill chunk) gathers its own keys/values; new token ``j`` sees
  cached/new tokens ``0 .. context_len + j``. SDPA's causal flash kernel only aligns its mask
  top-left (query ``j`` sees key ``j``), so a shifted mask would take the masked path, which scores
  every query-key pair (slower than the split below:
  docs/scheduling.md#time-bounded-work-conserving-steps); instead the chunk attends its context
  without a mask (each KV head's query heads folded into its query rows) and itself with the causal
  kernel, and the two are merged by their log-sum-exp (CPU tensors in float32 or bfloat16: the flash
  kernel's own op returns it; elsewhere, or without that op, the masked path).
GQA goes through SDPA's ``enable_gqa`` for prefill; batched decode folds each KV head's query heads
into its query rows instead (faster than ``enable_gqa`` on CPU). No repeated K/V is materialized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from firsttoken.attention.base import AttentionMetadata


class SdpaBackend:
    """Paged causal attention on any device SDPA runs on; the correctness reference for other
    backends."""

    name = "sdpa"

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        if meta.is_pure_decode:
            return _decode_batched(q, kv_cache, meta, scale)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens, meta.context_lens)):
            end = start + q_len
            if ctx_len == 0:
                out[start:end] = _attend(
                    q[start:end], k[start:end], v[start:end], None, scale, causal=True
                )
            else:
                seq_len = ctx_len + q_len
                keys, values = gather_kv(kv_cache, meta.block_tables[i], seq_len)
                if q_len > 1 and _can_split(q):
                    out[start:end] = _attend_split(q[start:end], keys, values, ctx_len, scale)
                    start = end
                    continue
                mask = None
                if q_len > 1:
                    key_pos = torch.arange(seq_len, device=q.device)
                    query_pos = torch.arange(ctx_len, seq_len, device=q.device)
                    mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
                out[start:end] = _attend(q[start:end], keys, values, mask, scale, causal=False)
            start = end
        return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values at their flat slots (block * block_size + offset): one copy for K and
    V."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv = torch.stack((k, v)).to(kv_cache.dtype)  # [2, num_tokens, num_kv_heads, head_dim]
    kv_cache.view(2, -1, num_kv_heads, head_dim).index_copy_(1, slot_mapping, kv)


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first ``seq_len`` keys and values, each [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    kv = gather_blocks(kv_cache, block_table[:num_blocks].long())[:, :seq_len]
    return kv[0], kv[1]


def gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[2, len(blocks) * block_size, num_kv_heads, head_dim]: K and V of ``blocks`` (int64 [n]) back
    to back. ``index_select`` copies whole blocks, faster than advanced indexing
    (``kv_cache[:, blocks]``; why: docs/runs/notes/decode-kernels.md#decode-per-step-issue-17)."""
    two, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(two, num_cache_blocks, block_size * num_kv_heads * head_dim)
    return flat.index_select(1, blocks).view(two, -1, num_kv_heads, head_dim)


def _attend(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [kv_len, num_kv_heads, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [q_len, kv_len] bool, True = attend
    scale: float,
    causal: bool,
) -> torch.Tensor:
    # 4-D [1, heads, len, head_dim]: CPU SDPA only takes its flash kernel for 4-D inputs without a
    # mask
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)  # [q_len, num_heads, head_dim]


# (out, logsumexp)
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _can_split(q: torch.Tensor) -> bool:
    return (
        _FLASH_LSE is not None
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
    )


def _attend_split(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    # [context_len + q_len, num_kv_heads, head_dim]: the context's keys, then the chunk's own
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk over its context and itself, as two unmasked flash calls merged
    by log-sum-exp: softmax over both key sets = each part's output weighted by exp(its lse - the
    max lse), renormalized."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    q4 = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
    # [1, kv_heads, seq_len, head_dim]
    k4, v4 = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    # the context: no mask, so a KV head's query heads can be its query rows (GQA without repeating
    # K/V)
    folded = q4.reshape(1, num_kv_heads, group * q_len, head_dim)
    ctx_out, ctx_lse = _FLASH_LSE(
        folded, k4[:, :, :context_len], v4[:, :, :context_len], 0.0, False, scale=scale
    )
    ctx_out = ctx_out.reshape(1, num_heads, q_len, head_dim)
    ctx_lse = ctx_lse.reshape(1, num_heads, q_len, 1)
    # the chunk itself: causal, top-left aligned (query j sees the chunk's keys 0..j)
    own_k = k4[:, :, context_len:].repeat_interleave(group, dim=1)
    own_v = v4[:, :, context_len:].repeat_interleave(group, dim=1)
    own_out, own_lse = _FLASH_LSE(q4, own_k, own_v, 0.0, True, scale=scale)
    own_lse = own_lse.reshape(1, num_heads, q_len, 1)
    top = torch.maximum(ctx_lse, own_lse)
    w_ctx, w_own = torch.exp(ctx_lse - top), torch.exp(own_lse - top)  # float32
    out = (ctx_out.float() * w_ctx + own_out.float() * w_own) / (w_ctx + w_own)
    return out.to(q.dtype)[0].transpose(0, 1)  # [q_len, num_heads, head_dim]


def _decode_batched(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """One query per sequence; keys padded to the longest sequence and masked by length (no mask
    when none is padded, e.g. batch 1). The block ids and the mask come from the metadata, made once
    per forward."""
    num_kv_heads, head_dim = kv_cache.shape[3:]
    max_len = max(meta.seq_lens)
    num_seqs, num_heads = q.shape[:2]
    run = meta.single_run_start
    if run is not None:  # one sequence on consecutive blocks: its tokens are a view of the cache
        start = run * meta.block_size
        kv = kv_cache.view(2, 1, -1, num_kv_heads, head_dim)[:, :, start : start + max_len]
    else:  # K and V in one gather
        kv = gather_blocks(kv_cache, meta.padded_kv_blocks.reshape(-1)).view(
            2, num_seqs, -1, num_kv_heads, head_dim
        )
        kv = kv[:, :, :max_len]
    kv = kv.transpose(2, 3)  # [2, num_seqs, num_kv_heads, max_len, head_dim]
    # GQA without repeating K/V: the query heads sharing a KV head become that head's query rows.
    out = F.scaled_dot_product_attention(
        q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim),
        kv[0],
        kv[1],
        attn_mask=meta.padded_key_mask,
        scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim)
