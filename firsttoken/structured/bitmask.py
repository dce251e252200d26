"""Token bitmasks and the one place they meet the logits.

A bitmask is a NumPy int32 array [rows, ceil(vocab / 32)]: bit ``t % 32`` of word ``t // 32`` of a
row set means token t may come next in that row (the layout llguidance and xgrammar share).
``apply_bitmask`` is the only code of this package that touches tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """[num_rows, ceil(vocab_size / 32)] int32, every token allowed."""
    return np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: Sequence[int]) -> None:
    """Sets to -inf, in place, each listed row's logits that its bitmask row forbids (bitmask row i
    is logits row i); rows not listed are neither read nor written, and with no rows listed nothing
    is done at all.

    logits: [num_rows, vocab] float32 on the CPU, vocab <= 32 * bitmask words. Branch-free: each
    mask byte looks up its 8 additive biases (0 allowed, -inf forbidden) and the row adds them, so
    the cost does not depend on the pattern (a masked_fill over a scattered mask mispredicts: ~10 ms
    for 16 rows of 151,657 tokens, against ~1.6 ms this way, one thread). A forbidden logit of +inf
    would become NaN; model logits are finite."""
    if not rows:
        return
    vocab = logits.shape[1]
    index = np.asarray(rows, dtype=np.intp)
    mask_bytes = np.ascontiguousarray(bitmask[index]).view(np.uint8)  # [len(rows), 4 * words]
    # [len(rows), 32 * words]
    bias = torch.from_numpy(_BYTE_BIAS.take(mask_bytes, axis=0).reshape(len(index), -1))
    for j, row in enumerate(rows):
        logits[row].add_(bias[j, :vocab])


# [256, 8] float32: entry [b, k] is 0 where bit k of byte b is set (allowed), else -inf
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(0.0),
    np.float32(-np.inf),
).astype(np.float32)
