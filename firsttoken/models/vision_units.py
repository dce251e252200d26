"""Encoder units finer than a block: a full-attention vision block over a large image split by query
rows, so that no unit of an image's vision work scores more than ``MAX_UNIT_PAIRS`` query-key pairs
and the scheduler's time bound holds under any image (a step never has to run a whole block: for a
1024² image in Qwen2-VL-2B's tower, one block is ~260 GFLOP, seconds on a CPU).

A pre-norm block is row-separable once its input ``x`` is complete:

    h[r]   = x[r] + proj(attention(q[r], K, V))       q, K, V projected from norm1(x) (all rows for K and V)
    out[r] = h[r] + mlp(norm2(h[r]))

The first slice of a block projects q, k and v for every row (``PartialBlock``, kept in the encode
state between steps, as the hidden states are); each slice attends its rows' queries to every key
and runs the rest of the block on its rows into ``PartialBlock.out``; the last slice's output is the
block's. Softmax is per query row, so the rows are the whole block's (to float rounding of the
matmuls over fewer rows).

Only blocks whose attention spans one segment are split (an image: t = 1); windowed blocks
(Qwen2.5-VL) are small already. Units stay a pure function of the config and the patch grid (the
scheduler and the input processor compute them without the model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from firsttoken.models.model_config import VisionConfig
from firsttoken.types import EncoderUnit

# query-key pairs one unit may score: a full-attention block over a 2896-patch image
MAX_UNIT_PAIRS = 8 * 2**20
# never slice finer than this many query rows: each slice streams every key and value of its block
# again, and thinner slices cost time, slices this thick none (why:
# docs/scheduling.md#time-bounded-work-conserving-steps). A huge image's units may then score more
# than MAX_UNIT_PAIRS pairs (2048x1536: 16 Mi).
MIN_UNIT_ROWS = 1024


def qkv_share(vision: VisionConfig, mlp_matrices: int) -> float:
    """The q/k/v projection's share of a block's per-patch linear FLOPs (qkv 3E², proj E², MLP
    ``mlp_matrices`` x E x I): what a block's first slice does for every row."""
    e, i = vision.embed_dim, vision.intermediate_size
    return 3 * e * e / (4 * e * e + mlp_matrices * e * i)


def split_block(unit: EncoderUnit, block: int, segment_rows: Sequence[int], share: float,
                max_pairs: int = MAX_UNIT_PAIRS) -> tuple[EncoderUnit, ...]:
    """Block ``block``'s work (``unit``, a whole block) as one unit, or as equal query-row slices
    when its attention spans one segment of more than ``max_pairs`` pairs. A slice's ``num_patches``
    counts the rows whose linear work it does (the first one's q/k/v projection covers every row) so
    the cost model prices it like a block's share; ``cost_tokens`` are the block's in proportion to
    its rows."""
    n = unit.num_patches
    if len(segment_rows) != 1 or unit.attention_pairs <= max_pairs:
        return (replace(unit, block=block),)
    num_slices = math.ceil(n / max(MIN_UNIT_ROWS, max_pairs // n))
    rows = math.ceil(n / num_slices)
    out = []
    for lo in range(0, n, rows):
        hi = min(lo + rows, n)
        patches = (hi - lo) * (1 - share) + (n * share if lo == 0 else 0)
        out.append(EncoderUnit(max(1, round(patches)), (hi - lo) * n,
                               max(1, round(unit.cost_tokens * (hi - lo) / n)), block, (lo, hi)))
    return tuple(out)


def whole_blocks(depth: int) -> tuple[EncoderUnit, ...]:
    """One unit per block, no costs: the units of a tower run over several images at once
    (``forward``)."""
    return tuple(EncoderUnit(0, 0, 0, b) for b in range(depth))


@dataclass
class PartialBlock:
    """A block part-way through its query-row slices."""

    q: torch.Tensor  # [1, heads, n, head_dim], rotary applied
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor  # [n, embed_dim]: the block's output, rows of the slices run so far


def run_block_rows(
    block,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: tuple[int, int],
    partial: PartialBlock | None,
) -> PartialBlock:
    """Rows [lo, hi) of ``block``'s output over input ``x`` (one attention segment). ``block`` has
    the pre-norm block's parts: ``norm1``, ``attn`` (qwen2_vl_vision.VisionAttention), ``norm2``,
    ``mlp``."""
    if partial is None:
        q, k, v = block.attn.project(block.norm1(x), cos, sin)
        partial = PartialBlock(q, k, v, torch.empty_like(x))
    lo, hi = rows
    h = x[lo:hi] + block.attn.attend(partial.q[:, :, lo:hi], partial.k, partial.v, [x.shape[0]])
    partial.out[lo:hi] = h + block.mlp(block.norm2(h))
    return partial


def run_units(state, num_units: int, blocks: Sequence[torch.nn.Module],
              whole_block: Callable[[int, torch.Tensor], torch.Tensor],
              after_block: Callable[[int, torch.Tensor], None] | None = None) -> None:
    """Run ``state``'s next ``num_units`` units (a family's encode state: ``hidden``, ``cos``,
    ``sin``, ``units``, ``units_done``, ``partial``). ``whole_block(b, hidden)`` runs block b over
    every row; ``after_block(b, hidden)`` sees each block's finished output (Qwen3-VL's DeepStack
    features)."""
    stop = min(state.units_done + num_units, len(state.units))
    for unit in state.units[state.units_done : stop]:
        if unit.rows is None:
            state.hidden = whole_block(unit.block, state.hidden)
        else:
            state.partial = run_block_rows(
                blocks[unit.block], state.hidden, state.cos, state.sin, unit.rows, state.partial
            )
            if unit.rows[1] < state.hidden.shape[0]:
                continue  # the block's other rows come in the next units
            state.hidden, state.partial = state.partial.out, None
        if after_block is not None:
            after_block(unit.block, state.hidden)
    state.units_done = stop
