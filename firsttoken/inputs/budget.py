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

A tiling processor (``ImageProcessorConfig.tiles``: InternVL's 448x448 tiles plus a thumbnail) plans
in tiles instead: a budget of B tokens allows the largest ``max_patches`` whose worst case (that
many tiles and the thumbnail) fits B, and the grid is the reference's pick for the aspect ratio
(models/internvl_tiles.py); ``image_pixels`` cuts the decoded image the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from firsttoken.config import ImageConfig
from firsttoken.inputs.image import (
    MAX_ASPECT_RATIO,
    ImageInputError,
    ProcessedImage,
    max_pixels_within_tokens,
    num_visual_tokens,
    preprocess_image,
    smart_resize,
    to_rgb,
)
from firsttoken.models.internvl_tiles import (
    cut_tiles,
    max_patches_for_budget,
    plan_tiles,
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
    """What one image will cost, known before decoding, and what reproduces its pixels:
    ``min_pixels``/``max_pixels`` (native resolution) or ``tile_grid`` (a tiling processor)."""

    original_size: tuple[int, int]  # (width, height) as declared by the header
    # (width, height) the pixels are resized to: smart_resize's (multiples of 28), or the tile grid's
    resized_size: tuple[int, int]
    num_tokens: int  # visual tokens after the merge; <= budget_tokens
    budget_tokens: int  # the budget this image was planned under
    grid_thw: tuple[int, int, int]  # the vision tower's grid, in patches: (1, h, w) or (tiles, s, s)
    min_pixels: int = 0
    max_pixels: int = 0
    # (rows, cols) of the crops, the thumbnail after them when more than one; None: native
    tile_grid: tuple[int, int] | None = None
    max_patches: int = 0  # the tiling's max_patches under this budget

    @property
    def tiles(self) -> str | None:
        """How a tiling family cuts it, for people: "3x3 + thumbnail", "1x1"; None: native."""
        if self.tile_grid is None:
            return None
        rows, cols = self.tile_grid
        return f"{rows}x{cols}" + (" + thumbnail" if rows * cols > 1 else "")

    @property
    def pixel_key(self) -> str:
        """What the pixels depend on beside the bytes (the processed-image cache's key)."""
        if self.tile_grid is not None:  # the cut depends on the grid only, not on the budget
            return f"tiles:{self.tile_grid[0]}x{self.tile_grid[1]}"
        return f"{self.min_pixels}:{self.max_pixels}"


def plan_image(
    width: int, height: int, budget_tokens: int, min_tokens: int, proc: ImageProcessorConfig
) -> ImagePlan:
    """The plan for a ``width`` x ``height`` image within ``budget_tokens``: resized on the patch
    grid with its aspect ratio kept (native resolution), or cut into tiles (``proc.tiles``)."""
    if width <= 0 or height <= 0:
        raise ImageInputError("invalid_image", f"image has an empty size ({width}x{height})")
    if proc.tiles is not None:
        return _plan_tiled(width, height, budget_tokens, proc)
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
        (1, resized_h // patch, resized_w // patch),
        min_pixels,
        max_pixels,
    )


def image_tokens_at_most(budget_tokens: int, proc: ImageProcessorConfig) -> int | None:
    """The most visual tokens one image can take under ``budget_tokens`` (plan and doctor size for
    it): the budget itself at native resolution; for a tiling processor, the worst case of the
    max_patches the budget buys (max_patches crops and the thumbnail, or one tile), within the
    checkpoint's own max_patches. None: a budget under one tile, which serve refuses."""
    if proc.tiles is None:
        return budget_tokens
    if budget_tokens < proc.tokens_per_tile:
        return None
    m = _max_patches(budget_tokens, proc)
    return proc.tokens_per_tile * (m + 1 if m > 1 else 1)


def _max_patches(budget_tokens: int, proc: ImageProcessorConfig) -> int:
    """The max_patches a budget of at least one tile buys, within the checkpoint's own bounds."""
    spec = proc.tiles
    assert spec is not None
    return max(max_patches_for_budget(budget_tokens, proc.tokens_per_tile, spec.max_patches),
               spec.min_patches)


def _plan_tiled(width: int, height: int, budget_tokens: int, proc: ImageProcessorConfig
                ) -> ImagePlan:
    """Tiles: the largest max_patches whose worst case fits the budget (one tile under three
    tiles' worth), then the grid exactly as the reference processor picks it."""
    spec, per_tile = proc.tiles, proc.tokens_per_tile
    assert spec is not None
    if budget_tokens < per_tile:
        raise ImageInputError(
            "image_too_large",
            f"image is {width}x{height}: at this model's smallest size (one tile) it needs {per_tile} "
            f"visual tokens, over its budget of {budget_tokens}; ask for max_visual_tokens >= {per_tile}",
        )
    max_patches = _max_patches(budget_tokens, proc)
    tiles = plan_tiles(height, width, max_patches, spec.min_patches, spec.size, per_tile)
    side = spec.size // proc.patch_size
    return ImagePlan(
        (width, height),
        (tiles.cols * spec.size, tiles.rows * spec.size),
        tiles.tokens,
        budget_tokens,
        (tiles.num_tiles, side, side),
        tile_grid=tiles.grid,
        max_patches=max_patches,
    )


def image_pixels(image: Image.Image, plan: ImagePlan, proc: ImageProcessorConfig
                 ) -> ProcessedImage:
    """The decoded ``image`` preprocessed as ``plan`` says, exactly as the family's reference
    processor does (its own size decides the cut: a header that lied shows in ``num_tokens``)."""
    if plan.tile_grid is None:
        return preprocess_image(image, proc, plan.min_pixels, plan.max_pixels)
    spec = proc.tiles
    assert spec is not None
    rgb = to_rgb(image)
    width, height = rgb.size
    tiles = plan_tiles(height, width, plan.max_patches, spec.min_patches, spec.size,
                       proc.tokens_per_tile)
    side = spec.size // proc.patch_size
    return ProcessedImage(
        # the tower's patch rows, cut here in the preprocessing pool (not on the engine thread)
        pixel_values=cut_tiles(rgb, tiles, spec.size, proc.image_mean, proc.image_std,
                               proc.patch_size),
        grid_thw=(tiles.num_tiles, side, side),
        num_tokens=tiles.tokens,
        original_size=rgb.size,
        resized_size=(tiles.cols * spec.size, tiles.rows * spec.size),
    )
