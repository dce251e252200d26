"""Triton attention backend ("triton"): the contract of ``attention/base.py`` over issue 39's
kernels.

A forward writes the new keys/values into their slots (``write_kv``: one ``index_copy_``, any
device), then
- a pure-decode batch (every ``query_len == 1``) runs the split-K decode kernel and its reduce
  (``decode_num_splits`` picks the splits from the longest context unless the backend was given a
  fixed count);
- any other batch (prefill chunks, with or without a cached prefix, decode tokens among them as
  chunks of 1) runs the paged prefill kernel once over all sequences (varlen through
  ``query_start_loc``).

The kernels are compiled for CUDA tensors; on CPU tensors they only run under Triton's interpreter,
so set ``TRITON_INTERPRET=1`` before this backend's first forward (triton reads it when the kernels
module is imported, which happens lazily on first use). The engine's CPU runner does not pick this
backend (``--attention-backend`` offers ``sdpa`` only until the CUDA runner lands); it is usable
standalone through ``registry.get_backend``. The vision towers' block-diagonal attention is
``varlen_attention`` (``vision_attention`` below for their layout); the towers still call SDPA.
"""

from __future__ import annotations

import torch

from firsttoken.attention.base import AttentionMetadata
from firsttoken.attention.sdpa import write_kv


def _kernels():
    from firsttoken.attention import triton_kernels

    return triton_kernels


class TritonBackend:
    """Paged causal attention through our Triton kernels (CUDA; CPU only under
    ``TRITON_INTERPRET=1``)."""

    name = "triton"

    def __init__(self, num_splits: int | None = None, block_m: int = 64, block_n: int = 64) -> None:
        # decode splits per sequence; None: decode_num_splits' heuristic
        self.num_splits = num_splits
        self.block_m = block_m
        self.block_n = block_n
        self._num_sms: int | None = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        kernels = _kernels()
        write_kv(k, v, kv_cache, meta.slot_mapping)
        seq_lens = meta.seq_lens_tensor
        if meta.is_pure_decode:
            splits = self.num_splits or kernels.decode_num_splits(
                max(meta.seq_lens), meta.num_seqs, kv_cache.shape[3], self._sms(q.device))
            return kernels.paged_decode(q, kv_cache, meta.block_tables, seq_lens, scale, splits,
                                        block_n=self.block_n)
        return kernels.paged_prefill(
            q,
            kv_cache,
            meta.block_tables,
            meta.query_start_loc,
            seq_lens,
            max(meta.query_lens),
            scale,
            block_m=self.block_m,
            block_n=self.block_n,
        )

    def _sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                             if device.type == "cuda" else 1)
        return self._num_sms


def vision_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[int]
) -> torch.Tensor:
    """The vision towers' ``VisionAttention.attend`` layout: q, k, v [1, num_heads, num_patches,
    head_dim], each segment (an image, or a Qwen2.5-VL window) attending over itself, scale
    1/sqrt(head_dim). Returns the same layout. Query rows must be all the rows (the towers'
    row-sliced units still take SDPA)."""
    kernels = _kernels()
    lengths = torch.tensor([0, *segments], dtype=torch.int32)
    cu_seqlens = lengths.cumsum(0, dtype=torch.int32).to(q.device)
    # [num_patches, num_heads, head_dim], strided views
    q3, k3, v3 = (t[0].transpose(0, 1) for t in (q, k, v))
    out = kernels.varlen_attention(q3, k3, v3, cu_seqlens, max(segments))
    return out.transpose(0, 1).unsqueeze(0)
