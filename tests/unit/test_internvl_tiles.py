"""InternVL3.5's tiles against transformers' GotOcr2ImageProcessorPil (the oracle): grids, tile
counts and bit-identical pixels; the budget ladder."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_utils import PILImageResampling
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
    GotOcr2ImageProcessorPil,
    get_optimal_tiled_canvas,
)

from firsttoken.models.internvl_tiles import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TILE_LADDER,
    TileLadder,
    max_patches_for_budget,
    plan_tiles,
    preprocess_tiles,
)
from firsttoken.models.ladder import BudgetLadder

# (height, width, max_patches, min_patches)
CASES = [
    (10, 10, 12, 1),
    (448, 448, 12, 1),
    (1024, 1024, 12, 1),  # 3x3 + thumbnail
    (1536, 2048, 12, 1),  # 4:3 exactly: 4 cols x 3 rows
    (2532, 1170, 12, 1),  # a phone screenshot
    (40, 480, 12, 1),  # 1:12
    (480, 40, 12, 1),  # 12:1
    (10, 1000, 12, 1),  # wider than any grid
    (20, 30, 12, 1),  # tiny, 3:2 exactly: upscaled into 3x2 tiles
    # exact ties: a later (larger) grid wins only while the area is over half its tiles'
    (400, 600, 2, 1),  # 1x1 vs 1x2 tie, taken
    (200, 300, 2, 1),  # the same tie, refused
    (633, 633, 12, 1),  # 2x2 refused: 400689 <= 401408
    (634, 634, 12, 1),  # 2x2 taken: 401956 > 401408
    (950, 950, 12, 1),  # 3x3 refused: 902500 <= 903168
    (951, 951, 12, 1),  # 3x3 taken
    (882, 1024, 12, 1),  # 3x3 refused: the area is exactly 903168 (strictly over, to be taken)
    (1024, 882, 12, 1),
    (720, 900, 9, 1),  # three ties on the way
    (600, 750, 12, 1),
    (1120, 980, 12, 1),
    (40, 50, 12, 1),
    (360, 900, 12, 1),
    (340, 1190, 4, 1),
    (720, 630, 12, 1),
    (520, 780, 4, 1),
    (640, 800, 6, 1),
    # several max_patches for one size
    (768, 1024, 1, 1),
    (768, 1024, 2, 1),
    (768, 1024, 4, 1),
    (768, 1024, 6, 1),
    (768, 1024, 9, 1),
    (300, 1000, 1, 1),
    (300, 1000, 4, 1),
    (300, 1000, 6, 1),
    (300, 1000, 9, 1),
    (800, 800, 4, 1),
    (800, 800, 9, 1),
    # min_patches over 1: no 1x1 grid
    (10, 10, 6, 2),
    (448, 448, 4, 4),
    (333, 777, 12, 3),
    (448, 896, 4, 3),  # a tie exactly at the area bound
    # the candidates' order (by area, not by columns) decides these
    (614, 1228, 4, 3),
    (164, 246, 9, 8),
]


def oracle_processor(max_patches: int = 12, min_patches: int = 1) -> GotOcr2ImageProcessorPil:
    """InternVL3.5-HF's published preprocessor settings (the class defaults are GOT-OCR2's: 384 px,
    CLIP mean and std, no cropping), with InternVLProcessor's crop_to_patches=True."""
    return GotOcr2ImageProcessorPil(
        size={"height": 448, "width": 448},
        crop_to_patches=True,
        min_patches=min_patches,
        max_patches=max_patches,
        resample=PILImageResampling.BICUBIC,
        do_resize=True,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=list(IMAGENET_MEAN),
        image_std=list(IMAGENET_STD),
        do_convert_rgb=True,
    )


@pytest.fixture(scope="module")
def oracle() -> GotOcr2ImageProcessorPil:
    return oracle_processor()


def oracle_grid(height: int, width: int, max_patches: int, min_patches: int) -> tuple[int, int]:
    if max_patches <= 1:
        return 1, 1
    cols, rows = get_optimal_tiled_canvas((height, width), (448, 448), min_patches, max_patches)
    return rows, cols


def random_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# ------------------------------------------------------------------------------------------- grids


@pytest.mark.parametrize("height,width,max_patches,min_patches", CASES)
def test_grid_and_tiles_match_transformers(oracle, height, width, max_patches, min_patches):
    plan = plan_tiles(height, width, max_patches, min_patches)
    kwargs = {"crop_to_patches": True, "max_patches": max_patches, "min_patches": min_patches}
    assert plan.grid == oracle_grid(height, width, max_patches, min_patches)
    assert plan.num_tiles == oracle.get_number_of_image_patches(height, width, kwargs)
    assert plan.tokens == 256 * plan.num_tiles
    assert plan.thumbnail == (plan.num_tiles > 1)


def test_grid_random_sizes_match_transformers(oracle):
    rng = random.Random(1234)
    for i in range(4000):
        height, width = rng.randint(1, 4000), rng.randint(1, 4000)
        max_patches = rng.randint(1, 12)
        min_patches = 1 if i % 2 else rng.randint(1, max_patches)
        kwargs = {"crop_to_patches": True, "max_patches": max_patches, "min_patches": min_patches}
        plan = plan_tiles(height, width, max_patches, min_patches)
        expected = oracle_grid(height, width, max_patches, min_patches)
        assert plan.grid == expected, (height, width, max_patches, min_patches)
        assert plan.num_tiles == oracle.get_number_of_image_patches(height, width, kwargs)


@pytest.mark.parametrize("height,width,max_patches,grid,tiles", [
    (10, 10, 12, (1, 1), 1),
    (448, 448, 12, (1, 1), 1),
    (1024, 1024, 12, (3, 3), 10),
    (1024, 1024, 4, (2, 2), 5),
    (633, 633, 12, (1, 1), 1),
    (634, 634, 12, (2, 2), 5),
    (950, 950, 12, (2, 2), 5),
    (951, 951, 12, (3, 3), 10),
    (882, 1024, 12, (2, 2), 5),
    (400, 600, 2, (1, 2), 3),
    (200, 300, 2, (1, 1), 1),
    (2532, 1170, 12, (4, 2), 9),
    (1536, 2048, 12, (3, 4), 13),
    (40, 480, 12, (1, 12), 13),
    (480, 40, 12, (12, 1), 13),
])
def test_known_grids(height, width, max_patches, grid, tiles):
    plan = plan_tiles(height, width, max_patches)
    assert (plan.grid, plan.num_tiles, plan.tokens) == (grid, tiles, 256 * tiles)


def test_tokens_per_tile_is_a_parameter():
    assert plan_tiles(1024, 1024, tokens_per_tile=64).tokens == 640


@pytest.mark.parametrize("args", [(0, 10), (10, 0), (10, 10, 0), (10, 10, 4, 5), (10, 10, 4, 0)])
def test_plan_refuses_nonsense(args):
    with pytest.raises(ValueError):
        plan_tiles(*args)


# ------------------------------------------------------------------------------------------ pixels


@pytest.mark.parametrize("height,width,max_patches,min_patches", CASES)
def test_pixels_bit_identical_to_transformers(height, width, max_patches, min_patches):
    image = random_image(height, width, seed=height * 7919 + width)
    processor = oracle_processor(max_patches, min_patches)
    expected = processor(images=image, return_tensors="pt")
    ours = preprocess_tiles(image, max_patches, min_patches)
    assert expected["num_patches"].tolist() == [ours.shape[0]]
    assert ours.dtype == expected["pixel_values"].dtype == torch.float32
    num_tiles = plan_tiles(height, width, max_patches, min_patches).num_tiles
    assert ours.shape == (num_tiles, 3, 448, 448)
    assert torch.equal(ours, expected["pixel_values"])


def test_thumbnail_is_last_and_is_the_whole_image():
    image = random_image(600, 900, seed=5)
    tiles = preprocess_tiles(image, 12)
    assert tiles.shape[0] == plan_tiles(600, 900).num_tiles > 1
    assert torch.equal(tiles[-1], preprocess_tiles(image, 1)[0])


def test_every_byte_value_normalizes_like_transformers(oracle):
    values = np.arange(256, dtype=np.uint8)
    pixels = np.broadcast_to(values[None, :, None], (448, 256, 3))
    image = Image.fromarray(np.ascontiguousarray(np.tile(pixels, (1, 2, 1))[:, :448]))
    expected = oracle(images=image, max_patches=1, return_tensors="pt")["pixel_values"]
    assert torch.equal(preprocess_tiles(image, 1), expected)


def test_non_rgb_refused():
    with pytest.raises(ValueError):
        preprocess_tiles(Image.new("RGBA", (20, 20)))


# ------------------------------------------------------------------------------------------ ladder


RUNGS = (256, 768, 1024, 1280, 1536, 1792, 2048, 2304, 2560, 2816, 3072, 3328)


def test_ladder_satisfies_the_protocol():
    ladder: BudgetLadder = TILE_LADDER
    assert ladder.unit == "tiles"
    assert TILE_LADDER.rungs == RUNGS
    assert [max_patches_for_budget(r) for r in RUNGS] == [1, *range(2, 13)]


@pytest.mark.parametrize("cap,expected", [
    (10**6, 3328), (3328, 3328), (3327, 3072), (2560, 2560), (1280, 1280), (1000, 768),
    (768, 768), (767, 256), (256, 256), (100, 256),
])
def test_default_is_the_largest_rung_under_the_cap(cap, expected):
    assert TILE_LADDER.default(cap) == expected


@pytest.mark.parametrize("budget,floor,expected", [
    (3328, 0, 3072), (1024, 0, 768), (768, 0, 256), (256, 0, None), (100, 0, None),
    (2000, 0, 1536),  # 2000 buys 1792 (6 tiles + 1): the step under it is 1536
    (10**6, 0, 3072),
    (1280, 1024, 1024), (1280, 1025, None), (3328, 3328, None),
])
def test_below_steps_one_rung(budget, floor, expected):
    assert TILE_LADDER.below(budget, floor) == expected


def test_walk_down_visits_every_rung():
    budget: int | None = TILE_LADDER.default(10**6)
    seen = []
    while budget is not None:
        seen.append(budget)
        budget = TILE_LADDER.below(budget, 256)
    assert tuple(reversed(seen)) == RUNGS


@pytest.mark.parametrize("budget,expected", [
    (0, 1), (255, 1), (256, 1), (767, 1), (768, 2), (1023, 2), (1024, 3), (3327, 11),
    (3328, 12), (10**9, 12),
])
def test_max_patches_for_budget(budget, expected):
    assert max_patches_for_budget(budget) == expected


def test_a_rung_bounds_the_tokens_of_any_image():
    rng = random.Random(7)
    sizes = [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(300)]
    for rung in RUNGS:
        m = max_patches_for_budget(rung)
        assert max(plan_tiles(h, w, m).tokens for h, w in sizes) <= rung


@pytest.mark.parametrize("budget,tokens,grid", [
    (256, 256, (1, 1)),
    (768, 256, (1, 1)),  # 2 tiles allowed, but a square is closest to 1x1
    (1280, 1280, (2, 2)),
    (2560, 2560, (3, 3)),
    (3328, 2560, (3, 3)),  # the default buys less for a square: 12 tiles is no square grid
])
def test_square_photo_up_the_ladder(budget, tokens, grid):
    plan = plan_tiles(1024, 1024, max_patches_for_budget(budget))
    assert (plan.tokens, plan.grid) == (tokens, grid)


def test_custom_ladder():
    ladder = TileLadder(tokens_per_tile=64, max_patches=4)
    assert ladder.rungs == (64, 192, 256, 320)
    assert ladder.default(300) == 256
    assert ladder.below(320, 64) == 256
