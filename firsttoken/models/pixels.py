"""Pixel arithmetic the families' reference image processors share.

``normalize_bytes``: transformers' ``rescale`` then ``normalize`` on uint8 pixels, bit-identical. The
reference computes float32(float64(x) * (1/255)) then a float32 subtract and divide; for bytes
float32(x) / 255 rounds to the same float32 (all 256 values checked in tests/unit/test_image.py), so
no float64 round trip is needed. NumPy on purpose: single-threaded, so it does not stall when the
model's torch threads hold the cores (torch's OpenMP ops stall badly under such contention).
"""

from __future__ import annotations

import numpy as np


def normalize_bytes(pixels: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]
                    ) -> np.ndarray:
    """(pixels / 255 - mean) / std in float32, channel on axis 1: [n, C, ...] uint8 -> float32."""
    shape = (1, -1) + (1,) * (pixels.ndim - 2)
    out = pixels.astype(np.float32)
    out /= np.float32(255)
    out -= np.array(mean, dtype=np.float32).reshape(shape)
    out /= np.array(std, dtype=np.float32).reshape(shape)
    return out
