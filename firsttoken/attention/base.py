"""The attention backend contract: one forward over a packed batch of sequences and a paged KV cache.

A forward step carries ``num_seqs`` sequences. Sequence ``i`` brings ``query_lens[i]`` new tokens (a prefill
chunk of any length, or a single decode token) on top of ``context_lens[i]`` tokens whose keys/values are
already in the cache. New tokens of all sequences are packed back to back: sequence ``i`` owns rows
``query_start_loc[i] : query_start_loc[i + 1]`` of every ``[num_tokens, ...]`` tensor.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K,
1 = V). A sequence's logical token ``j`` lives in physical block ``block_tables[i][j // block_size]`` at offset
``j % block_size``; ``slot_mapping[t] = block * block_size + offset`` is where new token ``t`` is written.

A backend (1) writes the new keys/values into their slots and (2) computes causal attention for each new
token over all of its sequence's tokens up to and including itself (``context_lens[i] + position in chunk``),
reading past keys/values through the block table. Model code passes this metadata explicitly; nothing lives
in module globals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    query_lens: tuple[int, ...]  # new tokens per sequence
    context_lens: tuple[int, ...]  # tokens already cached per sequence, before this forward
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot for each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query_lens
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """Tokens per sequence in the cache after this forward."""
        return tuple(c + q for c, q in zip(self.context_lens, self.query_lens))

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Metadata from plain per-sequence lists (block_tables[i] covers at least seq_len tokens)."""
        max_blocks = max((len(t) for t in block_tables), default=0)
        table = torch.zeros((len(block_tables), max(max_blocks, 1)), dtype=torch.int32)
        slots: list[int] = []
        for i, (q, c, blocks) in enumerate(zip(query_lens, context_lens, block_tables)):
            if (c + q + block_size - 1) // block_size > len(blocks):
                raise ValueError(f"sequence {i}: block table too short for {c + q} tokens")
            if blocks:
                table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            for j in range(c, c + q):
                slots.append(blocks[j // block_size] * block_size + j % block_size)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return AttentionMetadata(
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            block_tables=table.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            block_size=block_size,
        )


class AttentionBackend(Protocol):
    """Computes paged causal attention for one layer.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (rotary already applied).
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], written in place at meta.slot_mapping.
    Returns [num_tokens, num_heads, head_dim].
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
