"""InternVL's tiles against transformers' two image backends, recorded where torchvision loads
(tests/fixtures/tile_oracle/record.py): for 31 sizes and budgets (square grids that tie on aspect ratio and split by
area, 2:1 ties, 1:12 and 12:1 strips, a 10x10 image, photos, phone screenshots), firsttoken cuts as many tiles as
both backends and its pixels are the PIL backend's bit for bit. The torchvision backend (what a deployment with
torchvision installed runs) cuts the same tiles with pixels up to a few uint8 levels away (docs/inputs.md states
the figures); the recorded differences are checked to be what the docs say."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from firsttoken.models.internvl_tiles import IMAGENET_MEAN, IMAGENET_STD, plan_tiles, preprocess_tiles
from tests.fixtures.tile_oracle.images import photo

RECORD = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "tile_oracle" / "cases.json").read_text())
CASES = RECORD["cases"]


def test_the_record_is_the_one_the_docs_describe() -> None:
    assert len(CASES) == 31 and RECORD["meta"]["torchvision"].startswith("0.28.0")
    assert all(c["num_tiles"] == c["num_tiles_pil"] for c in CASES)  # the two backends always cut alike
    # torchvision's pixels differ: float rounding of the normalization on half the values or more, and its resize
    # by at most 2 uint8 levels on 26 of the 31, 4-6 on phone screenshots, 12-15 on strips upscaled 4-12x
    assert all(0.5 < c["share_differing"] < 0.65 for c in CASES)
    levels = sorted(c["max_diff_uint8_levels"] for c in CASES)
    assert levels[-6] <= 2.0 and levels[-5:-2] == pytest.approx([3.91, 4.89, 5.97], abs=0.01) and levels[-1] < 15


@pytest.mark.parametrize("case", CASES, ids=[f"{c['width']}x{c['height']}-m{c['max_patches']}" for c in CASES])
def test_our_tiles_are_both_backends_count_and_the_pil_backend_s_pixels(case: dict) -> None:
    width, height, max_patches = case["width"], case["height"], case["max_patches"]
    assert plan_tiles(height, width, max_patches).num_tiles == case["num_tiles"]
    ours = preprocess_tiles(photo(width, height, seed=width * 7 + height), max_patches, mean=IMAGENET_MEAN,
                            std=IMAGENET_STD)
    assert hashlib.sha256(ours.to(torch.float32).contiguous().numpy().tobytes()).hexdigest() == case["sha256_pil"]
