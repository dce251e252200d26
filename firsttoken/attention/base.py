"""The attention backend contract: one forward over a packed batch of sequences and a paged KV
cache.

A forward step carries ``num_seqs`` sequences. Sequence ``i`` brings ``query_lens[i]`` new tokens (a
prefill chunk of any length, or a single decode token) on top of ``context_lens[i]`` tokens whose
keys/values are already in the cache. New tokens of all sequences are packed back to back: sequence
``i`` owns rows ``query_start_loc[i] : query_start_loc[i + 1]`` of every ``[num_tokens, ...]``
tensor.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index
0 = K, 1 = V). A sequence's logical token ``j`` lives in physical block
``block_tables[i][j // block_size]`` at offset ``j % block_size``;
``slot_mapping[t] = block * block_size + offset`` is where new token ``t`` is written.

A backend (1) writes the new keys/values into their slots and (2) computes causal attention for each
new token over all of its sequence's tokens up to and including itself
(``context_lens[i] + position in chunk``), reading past keys/values through the block table. Model
code passes this metadata explicitly; nothing lives in module globals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
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

    # Derived values below are computed once per forward (the first layer asks), not once per layer.
    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @cached_property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @cached_property
    def seq_lens(self) -> tuple[int, ...]:
        """Tokens per sequence in the cache after this forward."""
        return tuple(c + q for c, q in zip(self.context_lens, self.query_lens))

    @cached_property
    def seq_lens_tensor(self) -> torch.Tensor:
        """[num_seqs] int32 ``seq_lens`` on the block tables' device (for kernels that read it per
        sequence)."""
        return torch.tensor(self.seq_lens, dtype=torch.int32, device=self.block_tables.device)

    @cached_property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @cached_property
    def padded_kv_blocks(self) -> torch.Tensor:
        """[num_seqs, blocks covering the longest sequence] int64 block ids, for a gather padded to
        the longest sequence (a shorter sequence's padding reads block 0: mask it with
        ``padded_key_mask``)."""
        num_blocks = -(-max(self.seq_lens, default=0) // self.block_size)
        return self.block_tables[:, :num_blocks].long()

    @cached_property
    def single_run_start(self) -> int | None:
        """For one sequence whose blocks (those ``padded_kv_blocks`` holds) are consecutive ids b, b
        + 1, ...: b, so its keys and values are a view of the cache, not a gather. None
        otherwise."""
        blocks = self.padded_kv_blocks
        if blocks.shape[0] != 1 or blocks.shape[1] == 0:
            return None
        first = int(blocks[0, 0])
        consecutive = torch.equal(
            blocks[0], torch.arange(first, first + blocks.shape[1], device=blocks.device)
        )
        return first if consecutive else None

    @cached_property
    def padded_key_mask(self) -> torch.Tensor | None:
        """[num_seqs, 1, 1, longest seq_len] bool, True where key j < seq_lens[i]; None when no
        sequence is padded."""
        if len(set(self.seq_lens)) <= 1:
            return None
        seq_lens = torch.tensor(self.seq_lens, device=self.block_tables.device)
        keys = torch.arange(max(self.seq_lens), device=self.block_tables.device)
        return (keys[None, :] < seq_lens[:, None])[:, None, None, :]

    @staticmethod
    def build(
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata from plain per-sequence lists (block_tables[i] covers at least seq_len tokens).
        A handful of tensor ops per step whatever the batch: no per-token Python."""
        num_seqs = len(query_lens)
        max_blocks = max(1, max((len(t) for t in block_tables), default=0))
        padded: list[list[int]] = []
        starts = [0]
        for i, (q, c, blocks) in enumerate(zip(query_lens, context_lens, block_tables)):
            if (c + q + block_size - 1) // block_size > len(blocks):
                raise ValueError(f"sequence {i}: block table too short for {c + q} tokens")
            padded.append([*blocks, *([0] * (max_blocks - len(blocks)))])
            starts.append(starts[-1] + q)
        table = torch.tensor(padded, dtype=torch.int32).reshape(num_seqs, max_blocks)
        if all(q == 1 for q in query_lens):  # decode: one slot per sequence
            slot_list = [blocks[c // block_size] * block_size + c % block_size
                         for c, blocks in zip(context_lens, block_tables)]
            slots = torch.tensor(slot_list, dtype=torch.int64)
        else:  # token t of sequence i sits at logical index context_lens[i] + (t - starts[i])
            lens = torch.tensor(query_lens, dtype=torch.int64)
            seq = torch.repeat_interleave(torch.arange(num_seqs), lens)  # [num_tokens]
            shift = torch.tensor(context_lens, dtype=torch.int64) - torch.tensor(
                starts[:-1], dtype=torch.int64
            )
            # [num_tokens] logical token index
            index = torch.arange(starts[-1], dtype=torch.int64) + shift[seq]
            slots = table[seq, index // block_size].long() * block_size + index % block_size
        return AttentionMetadata(
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            block_tables=table.to(device),
            slot_mapping=slots.to(device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            block_size=block_size,
        )


class AttentionBackend(Protocol):
    """Computes paged causal attention for one layer.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (rotary already
    applied). kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], written in place at
    meta.slot_mapping. Returns [num_tokens, num_heads, head_dim].
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
