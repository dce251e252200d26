"""InternVL3.5's image tiling: a grid of 448x448 tiles plus a global thumbnail, 256 LM tokens each.

Contract: ``plan_tiles`` gives the grid and tile count of transformers' ``GotOcr2ImageProcessorPil``
(the image processor of InternVLProcessor, which forces ``crop_to_patches=True``), and
``preprocess_tiles`` its ``pixel_values``, bit-identical, for the published InternVL3.5 -HF
preprocessor settings: 448x448 tiles, min_patches 1, max_patches 12, BICUBIC, rescale 1/255,
ImageNet mean and std. The reference pipeline is:

    grid = closest aspect ratio among (cols, rows) with min <= cols * rows <= max
    -> PIL BICUBIC resize of the whole image to (cols * 448, rows * 448) -> crops in row-major order
    -> when cols * rows > 1, the whole image BICUBIC-resized to 448x448 appended last (thumbnail)
    -> float64 * (1/255) -> float32 -> (x - mean) / std in float32 (models/pixels.py)

With max_patches <= 1 transformers skips the grid: one plain 448x448 resize, the same pixels as a
1x1 grid. Each tile costs 256 LM tokens (448 / 14 = 32 patches a side, pixel shuffle 0.5 -> 16x16);
the prompt wraps an image's tokens in <img> ... </img>, two more tokens not counted here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from firsttoken.models.pixels import normalize_bytes

TILE_SIZE = 448  # pixels, a tile's side
TOKENS_PER_TILE = 256  # LM tokens per tile: (448 / 14 * 0.5) ** 2
MIN_PATCHES = 1
MAX_PATCHES = 12  # tiles in the grid, the thumbnail not counted
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class TilePlan:
    rows: int
    cols: int
    num_tiles: int  # the rows * cols crops plus the thumbnail (present when rows * cols > 1)
    tokens: int  # LM placeholder tokens: tokens_per_tile * num_tiles (<img>, </img> not counted)

    @property
    def grid(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def thumbnail(self) -> bool:
        return self.rows * self.cols > 1


@lru_cache(maxsize=64)
def candidate_grids(min_patches: int, max_patches: int) -> tuple[tuple[int, int], ...]:
    """Every (cols, rows) with min_patches <= cols * rows <= max_patches, by area; within an area in
    enumeration order (cols, then rows, ascending: the sort is stable). The order decides ties."""
    grids = [
        (cols, rows)
        for cols in range(1, max_patches + 1)
        for rows in range(1, max_patches + 1)
        if min_patches <= cols * rows <= max_patches
    ]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def best_grid(height: int, width: int, min_patches: int, max_patches: int,
              tile_size: int = TILE_SIZE) -> tuple[int, int]:
    """(rows, cols): the candidate whose cols / rows is closest to width / height. On an exact tie
    (same float difference) a later candidate (as many or more tiles) wins only while the image's
    area exceeds half the area the candidate's tiles cover. Same float arithmetic as transformers'
    ``get_optimal_tiled_canvas``, so ties fall the same way."""
    aspect = width / height
    area = width * height
    best_diff = math.inf
    best = (1, 1)  # (cols, rows); also the answer when there is no candidate
    for cols, rows in candidate_grids(min_patches, max_patches):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * tile_size * tile_size * cols * rows:
            best = (cols, rows)
    return best[1], best[0]


def plan_tiles(height: int, width: int, max_patches: int = MAX_PATCHES,
               min_patches: int = MIN_PATCHES, tile_size: int = TILE_SIZE,
               tokens_per_tile: int = TOKENS_PER_TILE) -> TilePlan:
    """The tiles of one image of ``height`` x ``width`` pixels: the grid, the tile count with the
    thumbnail, and the LM tokens they cost."""
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if not 1 <= min_patches <= max_patches:
        raise ValueError(f"need 1 <= min_patches <= max_patches, got {min_patches}, {max_patches}")
    rows, cols = (1, 1)
    if max_patches > 1:
        rows, cols = best_grid(height, width, min_patches, max_patches, tile_size)
    crops = rows * cols
    num_tiles = crops + 1 if crops > 1 else 1
    return TilePlan(rows=rows, cols=cols, num_tiles=num_tiles, tokens=num_tiles * tokens_per_tile)


def max_patches_for_budget(budget_tokens: int, tokens_per_tile: int = TOKENS_PER_TILE,
                           max_patches: int = MAX_PATCHES) -> int:
    """The largest max_patches whose worst case fits ``budget_tokens``: m >= 2 tiles cost up to
    tokens_per_tile * (m + 1) with the thumbnail; 1 (one tile, no thumbnail) below 3 tiles' worth,
    which is also what a budget under one tile gets (an image never costs less). At most
    ``max_patches``, the family's own."""
    m = min(budget_tokens // tokens_per_tile - 1, max_patches)
    return m if m >= 2 else 1


@dataclass(frozen=True)
class TileLadder:
    """InternVL's budget ladder (models/ladder.py): the rungs are the budgets with distinct
    max_patches, tokens_per_tile for one tile, then tokens_per_tile * (m + 1) for m = 2 ..
    max_patches (256, 768, 1024, ..., 3328 for InternVL3.5).

    A rung is an upper bound, not a price: the grid chosen for an image's aspect ratio under
    max_patches may use fewer tiles (at 3328 tokens a large square photo gets 3x3 + 1 = 2560
    tokens, a 448x448 one 1 tile), and a budget between rungs buys the rung under it."""

    unit: str = "tiles"
    tokens_per_tile: int = TOKENS_PER_TILE
    max_patches: int = MAX_PATCHES

    @property
    def rungs(self) -> tuple[int, ...]:
        tiled = (self.tokens_per_tile * (m + 1) for m in range(2, self.max_patches + 1))
        return (self.tokens_per_tile, *tiled)

    def rung_at_or_below(self, budget: int) -> int | None:
        under = [r for r in self.rungs if r <= budget]
        return under[-1] if under else None

    def default(self, cap: int) -> int:
        """The family's default (max_patches tiles plus the thumbnail) bounded by ``cap``: the
        largest rung at or under it; one tile when the cap is under one tile (an image's least)."""
        rung = self.rung_at_or_below(cap)
        return self.rungs[0] if rung is None else rung

    def below(self, budget: int, floor: int) -> int | None:
        """The rung under the one ``budget`` buys, if at or over ``floor`` (so each step buys
        fewer tiles at most); None when there is none."""
        current = self.rung_at_or_below(budget)
        if current is None:
            return None
        lower = [r for r in self.rungs if floor <= r < current]
        return lower[-1] if lower else None


TILE_LADDER = TileLadder()


def preprocess_tiles(image: Image.Image, max_patches: int = MAX_PATCHES,
                     min_patches: int = MIN_PATCHES, tile_size: int = TILE_SIZE,
                     mean: tuple[float, ...] = IMAGENET_MEAN,
                     std: tuple[float, ...] = IMAGENET_STD) -> torch.Tensor:
    """[num_tiles, 3, tile_size, tile_size] float32: the crops in row-major order, then the
    thumbnail, as ``GotOcr2ImageProcessorPil(crop_to_patches=True)`` gives them. ``image`` must be
    RGB already (inputs/image.py's ``to_rgb`` is transformers' conversion, alpha onto white)."""
    width, height = image.size
    plan = plan_tiles(height, width, max_patches, min_patches, tile_size)
    return cut_tiles(image, plan, tile_size, mean, std)


def cut_tiles(image: Image.Image, plan: TilePlan, tile_size: int = TILE_SIZE,
              mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
              patch_size: int | None = None) -> torch.Tensor:
    """``preprocess_tiles`` for the RGB ``image``'s own ``plan`` (``plan_tiles`` of its size). With
    ``patch_size``: as the tower's patch rows [N * S * S, C * P * P] (tile-major, patches row-major,
    each (c, y, x): internvl_vision.tiles_to_patch_rows), cut on the bytes before normalizing."""
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode}")
    rows, cols, t = plan.rows, plan.cols, tile_size
    resized = np.asarray(image.resize((cols * t, rows * t), Image.Resampling.BICUBIC))
    # [rows * t, cols * t, 3] -> [rows * cols, 3, t, t], tile index = row * cols + col
    tiles = resized.reshape(rows, t, cols, t, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, t, t)
    if plan.thumbnail:
        thumb = np.asarray(image.resize((t, t), Image.Resampling.BICUBIC)).transpose(2, 0, 1)
        tiles = np.concatenate([tiles, thumb[None]])
    if patch_size is None:
        return torch.from_numpy(normalize_bytes(tiles, mean, std))
    n, p, s = tiles.shape[0], patch_size, t // patch_size
    patches = tiles.reshape(n, 3, s, p, s, p).transpose(0, 2, 4, 1, 3, 5).reshape(n * s * s, 3, p * p)
    return torch.from_numpy(normalize_bytes(patches, mean, std).reshape(n * s * s, 3 * p * p))
