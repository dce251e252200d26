"""Image content identity, and the fast path that skips decoding an image seen before.

Identity: an image's ``content_hash`` is blake2b over the pixel values the vision tower will see
(after resizing and normalisation) and its patch grid, so two different pictures never share a hash
while the same pixels sent as PNG or as a re-encoded data URL may. KV blocks and encoder outputs are
keyed by it.

Fast path: a follow-up turn re-sends the same bytes. ``ProcessedImageCache`` maps a hash of the raw
bytes plus the settings that shape the tokens (min/max pixels) to the finished ``ProcessedImage``,
bounded in bytes (LRU), so a repeated image is neither decoded nor resized again. Thread-safe:
preprocessing runs in a thread pool.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from firsttoken.inputs.image import ProcessedImage


def pixel_content_hash(image: ProcessedImage) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(image.grid_thw)).encode())
    h.update(image.pixel_values.contiguous().numpy().tobytes())
    return h.hexdigest()


def grid_content_hashes(grids: Sequence[torch.Tensor], grid_hw: tuple[int, int]) -> tuple[str, ...]:
    """A video's identity per temporal grid (``grids``: each grid's h*w patch rows,
    video_pixels.grid_rows): the hash ``pixel_content_hash`` gives the one-grid item the engine
    encodes (grid (1, h, w)), so a grid and an image of the same pixels share encoder output."""
    out = []
    for rows in grids:
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr((1, *grid_hw)).encode())
        digest.update(rows.contiguous().numpy().tobytes())
        out.append(digest.hexdigest())
    return tuple(out)


def raw_bytes_key(data: bytes, pixel_key: str) -> str:
    """The processed-image cache's key: the bytes and what their pixels depend on beside them
    (``ImagePlan.pixel_key``)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{pixel_key}:".encode())
    h.update(data)
    return h.hexdigest()


class ProcessedImageCache:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, ProcessedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def get_or_build(self, key: str, build: Callable[[], ProcessedImage]) -> ProcessedImage:
        """The cached image for key, or build() it (outside the lock) and keep it if it fits."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
                return hit
            self.num_misses += 1
        image = build()
        size = _size_bytes(image)
        if size > self.capacity_bytes:
            return image
        with self._lock:
            if key not in self._entries:
                self._entries[key] = image
                self._bytes += size
                while self._bytes > self.capacity_bytes:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= _size_bytes(old)
        return image


def video_bytes_key(
    sources: Sequence[bytes], frame_indices: Sequence[int], resized_size: tuple[int, int]
) -> str:
    """A video's raw bytes (the container, or each frame of a frame list) and the plan's sampled
    frames and size: what decides its pixel values."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"video:{tuple(frame_indices)}:{tuple(resized_size)}:{len(sources)}:".encode())
    for data in sources:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _size_bytes(image: ProcessedImage) -> int:
    return image.pixel_values.numel() * image.pixel_values.element_size()
