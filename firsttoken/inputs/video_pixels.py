"""Video frames to the vision tower's pixel values, bit-identical to transformers' video processors.

Contract: given the same decoded full-size RGB uint8 frames (already sampled:
``do_sample_frames=False``) and the size settings below, ``resize_frame`` on each frame then
``video_pixel_values`` return exactly (``torch.equal``) the ``pixel_values_videos`` and
``video_grid_thw`` of transformers 5.24's ``Qwen2VLVideoProcessor`` (Qwen2-VL and Qwen2.5-VL) and
``Qwen3VLVideoProcessor`` (torchvision 0.28 transforms). Checked against recorded outputs in
tests/fixtures/video_oracle/. The reference pipeline, per video:

    [n, 3, H, W] uint8 -> torchvision resize: BICUBIC, antialias, on the uint8 tensor (torch's native uint8
    kernel on the CPU: no float round trip, no clamp or round in torchvision) -> float32
    -> (x - mean * 255) / (std * 255) in float32 (rescale fused into normalize; mean * 255 and std * 255 are
    float32 products) -> last frame repeated up to a multiple of temporal_patch_size -> patchify

Size settings that make each processor choose a ``video.VideoPlan``'s ``resized_size``, always with
``cap_pixels_per_frame=False`` (leaving it unset warns, and its cap is not the plan's qwen-vl-utils
rule: Qwen2-VL's takes 90% of ``max_video_tokens`` and a floor division by the frame count,
Qwen3-VL's ``longest_edge // frames``, where qwen-vl-utils divides in floats; so the plan's
per-frame result is passed in with the cap off):

- Qwen2/2.5-VL: ``size = {"shortest_edge": plan.min_pixels, "longest_edge": M}`` per frame (its
  smart_resize is the image one, ours), where M is ``plan.max_pixels`` or, where the plan's cap was
  fractional (qwen-vl-utils' budget share ``total_pixels / frames * 2``, which ``plan.max_pixels``
  truncates) and truncating flips a side down one cell, ``plan.max_pixels + 1``.
  ``qwen2_processor_size``.
- Qwen3-VL: its smart_resize sizes the whole clip: it compares ``t_bar * h_bar * w_bar`` (``t_bar``
  = frames rounded to a multiple of temporal_patch_size) with the settings and scales by
  ``sqrt(frames * h * w / max)``. For an even frame count (every plan's) the per-clip settings
  ``frames * plan.min_pixels`` and ``frames * M`` give the per-frame rule's size exactly (the same
  rational numbers, and Python's int / int rounds them once). ``qwen3_processor_size``. One
  difference the settings cannot remove: a frame with a side under patch * merge (32 px) is first
  scaled up by Qwen3-VL's smart_resize so that side is 32 (``int()`` truncating the other), then
  rounded; the per-frame rule rounds the original sides. Such frames get a different size there than
  our plan's.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from firsttoken.inputs.image import smart_resize
from firsttoken.models.model_config import ImageProcessorConfig

CHANNELS = 3


class PlanSize(Protocol):
    """What the size mapping reads of ``video.VideoPlan`` (video.py imports this module: its
    decoders resize with ``resize_frame``)."""

    @property
    def original_size(self) -> tuple[int, int]: ...  # (width, height)

    @property
    def resized_size(self) -> tuple[int, int]: ...  # (width, height)

    @property
    def min_pixels(self) -> int: ...

    @property
    def max_pixels(self) -> int: ...

    @property
    def num_frames(self) -> int: ...


class VideoPixels(NamedTuple):
    pixel_values: torch.Tensor  # [grids * h * w, channels * temporal_patch * patch * patch] float32
    grid_thw: tuple[int, int, int]  # (temporal grids, height, width) in patches


def resize_frame(rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """[H, W, 3] uint8 -> [height, width, 3] uint8 for ``size`` = (height, width): what
    torchvision's ``resize(BICUBIC, antialias=True)`` gives inside the processors, i.e. torch's
    native uint8 antialiased bicubic on a contiguous [1, 3, H, W] tensor (the processors' layout;
    frames of a batch are independent). Same size: the frame itself, as torchvision returns it
    untouched. The uint8 kernel's result may depend on the CPU's instruction set (AVX2 vs generic);
    it equals the processor's on the machine it runs on."""
    height, width = size
    if rgb.shape[:2] == (height, width):
        return rgb
    # [1, 3, H, W], a copy
    chw = torch.from_numpy(np.array(rgb.transpose(2, 0, 1), order="C")).unsqueeze(0)
    out = F.interpolate(
        chw, size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )
    return out[0].permute(1, 2, 0).contiguous().numpy()


def _normalize_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """[3, 256] float32: each byte value's normalized value per channel, with the processors' fused
    arithmetic: float32(x) - float32(mean) * 255, then / (float32(std) * 255), every step rounded to
    float32."""
    values = np.arange(256, dtype=np.float32)[None, :]
    scaled_mean = np.asarray(mean, dtype=np.float32)[:, None] * np.float32(255)
    scaled_std = np.asarray(std, dtype=np.float32)[:, None] * np.float32(255)
    return (values - scaled_mean) / scaled_std


def video_pixel_values(frames: np.ndarray, proc: ImageProcessorConfig) -> VideoPixels:
    """[n, H, W, 3] uint8 frames, already at the resized size (multiples of patch * merge), to the
    vision tower's input, in the processors' order: temporal grids, then merge windows row-major,
    then the merge x merge patches inside a window; each row is (channel, frame in the grid, patch
    row, patch column). A count that is not a multiple of temporal_patch_size is padded by repeating
    the last frame. NumPy only, single-threaded (see image.py's ``_normalize``): normalizing is a
    per-channel table lookup on the uint8 patches."""
    n, height, width, c = frames.shape
    p, m, t = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    if n == 0 or c != CHANNELS or frames.dtype != np.uint8:
        raise ValueError(
            f"frames must be [n >= 1, H, W, 3] uint8; got {list(frames.shape)} {frames.dtype}"
        )
    if height % (p * m) or width % (p * m):
        raise ValueError(
            f"frames of {width}x{height} are not multiples of {p * m} px (patch * merge)"
        )
    grids, grid_h, grid_w = -(-n // t), height // p, width // p
    if n % t:
        frames = frames[list(range(n)) + [n - 1] * (grids * t - n)]
    blocks = frames.reshape(grids, t, grid_h // m, m, p, grid_w // m, m, p, c)
    # -> (grid, window row, window col, row in window, col in window, channel, frame, patch row,
    # patch col)
    patches = np.ascontiguousarray(blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7))
    rows = grids * grid_h * grid_w
    patches = patches.reshape(rows, c, t * p * p)  # uint8
    table = _normalize_table(proc.image_mean, proc.image_std)
    out = np.empty((rows, c, t * p * p), dtype=np.float32)
    for ch in range(c):
        np.take(table[ch], patches[:, ch], out=out[:, ch])
    return VideoPixels(torch.from_numpy(out.reshape(rows, c * t * p * p)), (grids, grid_h, grid_w))


def grid_rows(pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> list[torch.Tensor]:
    """A video's pixel values split per temporal grid: ``t`` views of [h * w, ...], each one vision
    item of grid (1, h, w). Exact because every family's vision tower attends only within one
    temporal grid."""
    t, h, w = grid_thw
    if pixel_values.shape[0] != t * h * w:
        raise ValueError(
            f"pixel values have {pixel_values.shape[0]} rows; grid {grid_thw} needs {t * h * w}"
        )
    return list(pixel_values.split(h * w))


def _per_frame_max_pixels(plan: PlanSize, proc: ImageProcessorConfig) -> int:
    """An integer max_pixels under which smart_resize gives ``plan.resized_size``.
    ``plan.max_pixels`` is the plan's cap truncated to an int; where the plan used a fractional cap
    (qwen-vl-utils' budget / frames share), the truncation can flip a side down one cell, and the
    next integer holds the size instead."""
    width, height = plan.original_size
    rw, rh = plan.resized_size
    for max_pixels in (plan.max_pixels, plan.max_pixels + 1):
        if smart_resize(height, width, proc.pixels_per_token, plan.min_pixels, max_pixels) == (
            rh,
            rw,
        ):
            return max_pixels
    raise ValueError(
        f"no integer max_pixels near {plan.max_pixels} resizes {width}x{height} to {rw}x{rh}"
    )


def qwen2_processor_size(plan: PlanSize, proc: ImageProcessorConfig) -> dict[str, int]:
    """``Qwen2VLVideoProcessor``'s ``size`` (with ``cap_pixels_per_frame=False``) under which it
    resizes this plan's frames to ``plan.resized_size``."""
    return {"shortest_edge": plan.min_pixels, "longest_edge": _per_frame_max_pixels(plan, proc)}


def qwen3_processor_size(plan: PlanSize, proc: ImageProcessorConfig) -> dict[str, int]:
    """``Qwen3VLVideoProcessor``'s ``size`` (with ``cap_pixels_per_frame=False``) under which it
    resizes this plan's frames to ``plan.resized_size``: the per-frame settings times the frame
    count. ValueError for frames with a side under patch * merge, whose size no such settings
    reproduce (module docstring)."""
    n, factor = plan.num_frames, proc.pixels_per_token
    if min(plan.original_size) < factor:
        raise ValueError(
            f"Qwen3-VL's processor sizes frames with a side under {factor} px differently from the "
            f"plan's per-frame rule; {plan.original_size[0]}x{plan.original_size[1]} has one"
        )
    if n % proc.temporal_patch_size:
        raise ValueError(f"a plan of {n} frames is not a multiple of {proc.temporal_patch_size}")
    return {
        "shortest_edge": plan.min_pixels * n,
        "longest_edge": _per_frame_max_pixels(plan, proc) * n,
    }
