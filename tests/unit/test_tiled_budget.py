"""A tiling processor's images planned from their headers and cut from their pixels
(inputs/budget.py over models/internvl_tiles.py): the budget buys tiles, the plan's tokens and grid
are what the pixels give, and each budget reproduces its own pixels."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from firsttoken.inputs.budget import image_pixels, plan_image
from firsttoken.inputs.image import ImageInputError, decode_image
from firsttoken.models.internvl_tiles import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    preprocess_tiles,
)
from firsttoken.models.internvl_vision import tiles_to_patch_rows
from firsttoken.models.model_config import ImageProcessorConfig, TileSpec

TILED = ImageProcessorConfig(
    patch_size=14, merge_size=2, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD,
    tiles=TileSpec(448, 1, 12),
)


def _png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize(
    ("size", "budget", "tiles", "grid"),
    [
        ((1024, 1024), 3328, 10, (3, 3)),  # the family's default: 3x3 + thumbnail
        ((1024, 1024), 1280, 5, (2, 2)),  # max_patches 4
        ((1024, 1024), 1279, 1, (1, 1)),  # max_patches 3 cannot make 2x2: a square takes 1x1
        ((1024, 1024), 767, 1, (1, 1)),  # under three tiles' worth: one tile
        ((2048, 1536), 3328, 13, (3, 4)),  # (rows, cols)
        ((1170, 2532), 3328, 9, (4, 2)),  # a phone screenshot
        ((448, 448), 3328, 1, (1, 1)),
    ],
)
def test_a_budget_buys_tiles_and_the_plan_is_what_the_pixels_give(size, budget, tiles, grid):
    width, height = size
    plan = plan_image(width, height, budget, 4, TILED)
    assert plan.tile_grid == grid
    assert plan.grid_thw == (tiles, 32, 32)
    assert plan.num_tokens == 256 * tiles <= max(budget, 256)
    processed = image_pixels(decode_image(_png(width, height), 1 << 26), plan, TILED)
    assert processed.num_tokens == plan.num_tokens
    assert processed.grid_thw == plan.grid_thw
    assert processed.resized_size == plan.resized_size
    reference = preprocess_tiles(decode_image(_png(width, height), 1 << 26), plan.max_patches)
    # the tower's patch rows of the same tiles
    assert torch.equal(processed.pixel_values, tiles_to_patch_rows(reference, 14))


def test_a_budget_under_one_tile_is_refused_naming_the_least():
    with pytest.raises(ImageInputError, match="256") as err:
        plan_image(1024, 1024, 255, 4, TILED)
    assert err.value.code == "image_too_large"


def test_each_grid_has_its_own_pixels_key_and_native_plans_keep_theirs():
    plans = [plan_image(1024, 768, b, 4, TILED) for b in (256, 1280, 3328)]
    assert len({p.tile_grid for p in plans}) == len({p.pixel_key for p in plans}) == 3
    native = plan_image(1024, 768, 1024, 4, ImageProcessorConfig())
    assert native.tile_grid is None
    assert native.grid_thw == (1, native.resized_size[1] // 14, native.resized_size[0] // 14)
    assert native.pixel_key == f"{native.min_pixels}:{native.max_pixels}"


def test_firsttoken_tokens_reports_the_tile_grid_and_a_grid_keys_the_pixels(tmp_path) -> None:
    """What an operator reads before serving: the cut beside the tokens (the seed's ~1,200-token budget lands on
    one tile for a square photo; with no budget it is 3x3 tiles and a thumbnail), and a budget that lands on the
    same grid keeps the same processed pixels (the cache key is the grid, not the budget)."""
    from firsttoken.cli.tokens import count_images, format_table
    from firsttoken.config import ImageConfig

    photo = tmp_path / "photo.png"
    Image.new("RGB", (1024, 1024)).save(photo)
    rows = {
        cap: count_images([photo], ImageConfig(image_max_tokens=cap), "auto", TILED, ImageConfig().max_image_pixels)[0]
        for cap in (1200, 2560, 16384)
    }
    assert [(r.tiles, r.num_tokens) for r in rows.values()] == [
        ("1x1", 256), ("3x3 + thumbnail", 2560), ("3x3 + thumbnail", 2560)]
    table = format_table(list(rows.values())).splitlines()
    assert table[0].split() == ["image", "original", "resized", "tiles", "tokens", "budget"]
    assert "3x3 + thumbnail" in table[2]
    wide, no_budget = (plan_image(1024, 1024, cap, 4, TILED) for cap in (2560, 16384))
    assert (wide.tile_grid, wide.max_patches) == ((3, 3), 9) and no_budget.max_patches == 12
    assert wide.pixel_key == no_budget.pixel_key
