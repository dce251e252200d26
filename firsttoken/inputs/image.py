"""Image decode, resize and patchify for Qwen2-VL, on the time-to-first-token path.

Contract: ``preprocess_image`` returns exactly what transformers' ``Qwen2VLImageProcessorPil``
returns for the same PIL image and min/max pixels (same resized size, same grid, bit-identical
float32 ``pixel_values``), several times faster. The reference pipeline is:

    convert_to_rgb (alpha composited onto white) -> PIL BICUBIC resize to smart_resize(h, w)
    -> float64 * (1/255) -> float32 -> (x - CLIP mean) / CLIP std in float32 -> patchify (frame duplicated)

We keep PIL's resize (C code, identical pixels), patchify on uint8 (a quarter of the bytes),
normalise once per frame and broadcast it into the temporal slots; ``_normalize`` is checked against
the reference arithmetic for all 256 byte values per channel in tests/unit/test_image.py.

Untrusted bytes go through ``probe_image`` (header only) before any pixel is decoded; every failure
becomes an ``ImageInputError`` whose message is safe to show a client.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from firsttoken.models.model_config import ImageProcessorConfig
from firsttoken.models.pixels import normalize_bytes

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# Formats we let PIL open. Anything else (EPS runs Ghostscript, etc.) is refused before parsing.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


class ImageInputError(ValueError):
    """A client's image was refused. ``str(err)`` is safe to return to the client: it never contains
    payload bytes, file paths outside what the client sent, or internal details. ``code`` is a
    stable label for metrics and the API error body; ``param`` the image's request field once the
    input processor knows which image it was (``messages[0].content[1].image_url``)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


# -------------------------------------------------------------------------------------------- sizes


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """(height, width) both multiples of ``factor``, area in [min_pixels, max_pixels] where the
    aspect ratio allows, aspect ratio kept as closely as possible. Same arithmetic as transformers'
    Qwen2-VL ``smart_resize`` (including scaling images smaller than one cell *up* to
    min_pixels)."""
    if height <= 0 or width <= 0:
        raise ImageInputError("invalid_image", f"image has an empty size ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageInputError(
            "image_aspect_ratio",
            f"image aspect ratio {ratio:.1f} exceeds the limit of {MAX_ASPECT_RATIO}",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def num_visual_tokens(resized_h: int, resized_w: int, patch: int = 14, merge: int = 2) -> int:
    """LM tokens for one image of the resized size: (h/patch) x (w/patch) patches, merge x merge per
    token."""
    return (resized_h // patch) * (resized_w // patch) // (merge * merge)


def pixels_for_tokens(num_tokens: int, pixels_per_token: int = 28) -> int:
    """The max_pixels that allows ``num_tokens`` visual tokens for an image that smart_resize scales
    down normally. Not a guarantee for every image: smart_resize clamps each side to at least one
    cell and scales tiny images *up* to min_pixels, so extreme strips can exceed it; use
    ``max_pixels_within_tokens`` for a per-image guarantee."""
    if num_tokens < 1:
        raise ValueError("num_tokens must be >= 1")
    return num_tokens * pixels_per_token * pixels_per_token


def max_pixels_within_tokens(
    height: int,
    width: int,
    max_tokens: int,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    patch: int = 14,
    merge: int = 2,
) -> int:
    """The largest max_pixels <= pixels_for_tokens(max_tokens) for which smart_resize(height, width,
    ...) gives at most ``max_tokens`` tokens. Passing it to ``preprocess_image`` keeps the
    reference's exact output for that max_pixels while guaranteeing the budget. Raises
    ImageInputError("image_too_large") when no max_pixels can (min_pixels forces more tokens on this
    image than the budget)."""
    factor = patch * merge

    def tokens(max_pixels: int) -> int:
        return num_visual_tokens(
            *smart_resize(height, width, factor, min_pixels, max_pixels), patch, merge
        )

    hi = pixels_for_tokens(max_tokens, factor)
    if tokens(hi) <= max_tokens:
        return hi
    if tokens(1) > max_tokens:
        raise ImageInputError(
            "image_too_large",
            f"this image needs at least {tokens(1)} visual tokens (at min_pixels={min_pixels}); "
            f"the limit is {max_tokens}",
        )
    # invariant: tokens(lo) <= max_tokens < tokens(hi); tokens() is non-decreasing in max_pixels
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens(mid) <= max_tokens:
            lo = mid
        else:
            hi = mid
    return lo


# ------------------------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class ImageHeader:
    width: int
    height: int
    format: str  # PIL format name, e.g. "PNG"


def _open(data: bytes, max_image_pixels: int) -> Image.Image:
    """PIL's lazy open: parses the header only. Size is checked here, before any pixel is
    decoded."""
    if not data:
        raise ImageInputError("invalid_image", "image data is empty")
    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError:
        # PIL's own guard (Image.MAX_IMAGE_PIXELS, process-wide; we leave it as is) fired before
        # ours could.
        raise ImageInputError(
            "image_too_large", f"image declares more pixels than the limit of {max_image_pixels}"
        ) from None
    # PIL plugins raise many types (OSError, SyntaxError, struct.error, ...) on bad input
    except Exception:
        raise ImageInputError(
            "invalid_image", f"data is not a supported image ({', '.join(ALLOWED_FORMATS)})"
        ) from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageInputError("invalid_image", "image declares an empty size")
    if width * height > max_image_pixels:
        raise ImageInputError(
            "image_too_large",
            f"image declares {width}x{height} = {width * height} pixels; the limit is {max_image_pixels}",
        )
    return image


def probe_image(data: bytes, max_image_pixels: int) -> ImageHeader:
    """Read only the header: format and declared size, refusing non-images and oversized
    declarations."""
    image = _open(data, max_image_pixels)
    return ImageHeader(width=image.size[0], height=image.size[1], format=str(image.format))


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' ``convert_to_rgb``: anything with alpha (an "A" band or a transparency key) is
    composited onto opaque white; everything else is PIL's plain ``convert("RGB")``."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode == "RGB":
        return image  # convert("RGB") would only copy
    return image.convert("RGB")


def decode_image(data: bytes, max_image_pixels: int) -> Image.Image:
    """Probe, then decode fully into an RGB image; truncated or corrupt data raises
    ImageInputError."""
    image = _open(data, max_image_pixels)
    try:
        image.load()
        return to_rgb(image)
    except Image.DecompressionBombError:
        raise ImageInputError(
            "image_too_large", f"image declares more pixels than the limit of {max_image_pixels}"
        ) from None
    except Exception:  # truncated streams raise OSError; corrupt ones anything from the plugin
        raise ImageInputError("invalid_image", "image data is truncated or corrupt") from None


# ------------------------------------------------------------------------------------------- pixels


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the vision tower. ``content_hash`` is filled by the inputs layer
    (mm_hash) with ``dataclasses.replace`` once computed; preprocessing leaves it None."""

    # [num_patches, in_channels * temporal_patch * patch * patch] float32
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]  # (temporal, height, width) in patches
    num_tokens: int  # LM placeholder tokens = t * h * w // merge**2
    original_size: tuple[int, int]  # (width, height) as decoded
    resized_size: tuple[int, int]  # (width, height) after smart_resize
    content_hash: str | None = None


def _normalize(patches: np.ndarray, mean: tuple[float, ...] = OPENAI_CLIP_MEAN,
               std: tuple[float, ...] = OPENAI_CLIP_STD) -> np.ndarray:
    """[n, 3, k] uint8 -> [n, 3, k] float32, as the reference rescales and normalizes
    (models/pixels.py)."""
    return normalize_bytes(patches, mean, std)


def preprocess_image(
    image: Image.Image, proc: ImageProcessorConfig, min_pixels: int, max_pixels: int
) -> ProcessedImage:
    """Resize and patchify one image exactly like Qwen2VLImageProcessorPil(min_pixels, max_pixels)
    configured as ``proc`` (patch size, merge size, mean and std: 14 px and CLIP's for Qwen2/2.5-VL,
    16 px and 0.5 for Qwen3-VL)."""
    p, m, t, c = proc.patch_size, proc.merge_size, proc.temporal_patch_size, 3
    rgb = to_rgb(image)
    width, height = rgb.size
    resized_h, resized_w = smart_resize(
        height, width, proc.pixels_per_token, min_pixels, max_pixels
    )
    resized = rgb.resize((resized_w, resized_h), Image.Resampling.BICUBIC)
    pixels = np.asarray(resized)  # [resized_h, resized_w, 3] uint8
    grid_h, grid_w = resized_h // p, resized_w // p
    num_patches = grid_h * grid_w
    # Patch order: merge windows row-major, then the m x m patches inside a window, then (channel,
    # row, col).
    windows = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5)
    patches = np.ascontiguousarray(windows).reshape(num_patches, c, p * p)  # uint8
    frame = _normalize(patches, proc.image_mean, proc.image_std)  # [num_patches, c, p*p] float32
    out = np.empty((num_patches, c, t, p * p), dtype=np.float32)
    # a still image is the same frame repeated temporal_patch_size times
    out[...] = frame[:, :, None, :]
    return ProcessedImage(
        pixel_values=torch.from_numpy(out.reshape(num_patches, c * t * p * p)),
        grid_thw=(1, grid_h, grid_w),
        num_tokens=num_patches // (m * m),
        original_size=(width, height),
        resized_size=(resized_w, resized_h),
    )
