"""The visual-token budget: how many LM tokens one image may cost, decided from its header alone.

Policy (server side, config.ImageConfig): every image gets at most ``image_max_tokens`` visual
tokens (the server's cap) and at least ``image_min_tokens`` (tiny images are scaled *up*, as the
reference processor does). A request may ask for less, never more: ``image_url.detail = "low"``
means ``image_low_detail_tokens``, ``"high"``/``"auto"``/absent mean the cap, and the extension
``image_url.max_visual_tokens = N`` asks for at most N (N above the cap is refused, not clamped, so
a client never believes it got a resolution it did not get).

Plan (per image, ``plan_image``): the resized size comes from ``smart_resize`` on the *declared*
width and height, with the largest ``max_pixels`` that keeps the image within its budget
(``max_pixels_within_tokens``). Nothing is decoded, so the prompt's exact token count is known after
reading headers and tokenizing the text; decoding and ``preprocess_image`` with the plan's
``(min_pixels, max_pixels)`` then produce exactly ``plan.num_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.config import ImageConfig
from firsttoken.inputs.image import (
    MAX_ASPECT_RATIO,
    ImageInputError,
    max_pixels_within_tokens,
    num_visual_tokens,
    smart_resize,
)
from firsttoken.models.model_config import ImageProcessorConfig

# Qwen2-VL's own processor defaults (preprocessor_config.json): min_pixels 56*56, max_pixels
# 12845056.
REFERENCE_MIN_TOKENS = 4
REFERENCE_MAX_TOKENS = 16384


def image_budget(
    images: ImageConfig, detail: str | None, max_visual_tokens: int | None, param: str,
    default: int | None = None,
) -> int:
    """The budget of one image part under the server's policy: ``default`` (the family's default
    rung under the cap; None: the cap) unless the request asks for less. Raises BudgetError when the
    request asks for more than the cap."""
    if max_visual_tokens is not None and max_visual_tokens > images.image_max_tokens:
        raise BudgetError(
            f"{param}.max_visual_tokens={max_visual_tokens} is above this server's cap of {images.image_max_tokens} "
            f"visual tokens per image; send at most {images.image_max_tokens} or leave it out",
            f"{param}.max_visual_tokens",
        )
    budget = images.image_max_tokens if default is None else min(default, images.image_max_tokens)
    if detail == "low":
        budget = min(budget, images.image_low_detail_tokens)
    if max_visual_tokens is not None:
        budget = min(budget, max_visual_tokens)
    return budget


class BudgetError(ValueError):
    """A request asked for a budget the server does not grant. ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ImagePlan:
    """What one image will cost, known before decoding. ``min_pixels``/``max_pixels`` reproduce
    it."""

    original_size: tuple[int, int]  # (width, height) as declared by the header
    resized_size: tuple[int, int]  # (width, height) after smart_resize, multiples of 28
    num_tokens: int  # visual tokens after the 2x2 merge; <= budget_tokens
    budget_tokens: int  # the budget this image was planned under
    min_pixels: int
    max_pixels: int


def plan_image(
    width: int, height: int, budget_tokens: int, min_tokens: int, proc: ImageProcessorConfig
) -> ImagePlan:
    """Resize plan for a ``width`` x ``height`` image within ``budget_tokens``, aspect ratio kept on
    the grid."""
    if width <= 0 or height <= 0:
        raise ImageInputError("invalid_image", f"image has an empty size ({width}x{height})")
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageInputError(
            "image_aspect_ratio",
            f"image is {width}x{height}, aspect ratio {ratio:.1f}:1; this model accepts at most "
            f"{MAX_ASPECT_RATIO}:1. Crop or pad it.",
        )
    patch, merge, factor = (
        proc.patch_size,
        proc.merge_size,
        proc.pixels_per_token,
    )
    min_pixels = min(min_tokens, budget_tokens) * factor * factor
    try:
        max_pixels = max_pixels_within_tokens(
            height, width, budget_tokens, min_pixels, patch, merge
        )
    except ImageInputError:  # a thin strip: smart_resize scales its short side up to one cell first
        need = num_visual_tokens(
            *smart_resize(height, width, factor, min_pixels, min_pixels), patch, merge
        )
        raise ImageInputError(
            "image_too_large",
            f"image is {width}x{height}: at this model's smallest size it needs {need} visual tokens, over its "
            f"budget of {budget_tokens}; ask for max_visual_tokens >= {need} or pad the image",
        ) from None
    resized_h, resized_w = smart_resize(height, width, factor, min_pixels, max_pixels)
    num_tokens = num_visual_tokens(resized_h, resized_w, patch, merge)
    if num_tokens > budget_tokens:  # max_pixels_within_tokens guarantees this; a bug if it fires
        raise RuntimeError(f"planned {num_tokens} tokens for a {budget_tokens}-token budget")
    return ImagePlan(
        (width, height),
        (resized_w, resized_h),
        num_tokens,
        budget_tokens,
        min_pixels,
        max_pixels,
    )
