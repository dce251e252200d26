"""A video's vision work as the engine does it, one temporal grid at a time, against transformers' vision tower run
once over the whole video, for every family that serves video (this module's ``family``; conftest.py's ``model_dir``).

The engine serves a video as a sequence of vision items, one per temporal grid: grid k of a (T, h, w) video is the
item (1, h, w) whose pixels are the processor's ``pixel_values_videos`` rows [k*h*w, (k+1)*h*w). That is exact
only if every family's tower attends within one temporal grid and computes its position inputs per (h, w):
transformers' cu_seqlens repeat per t, Qwen2.5-VL's windows are per frame, Qwen3-VL's position table is resampled
per (h, w) and repeated per t. These tests hold our tower, fed grid by grid (whole, and unit by unit as the engine
runs it), to transformers' ``get_video_features`` over whole videos: main rows and every DeepStack feature.

Pixels are random floats shaped like the processor's output ([T*h*w, C * temporal_patch_size * P * P]): the
tower never sees frames, only patch rows, so this is the input the video processor would hand it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from firsttoken.loading.loader import load_model
from firsttoken.models.family import ModelFamily
from firsttoken.models.interfaces import ImageEmbeddings
from firsttoken.models.registry import family_named, load_model_config
from tests.oracle.parity import VIDEO_FAMILIES, tower_outputs


@pytest.fixture(scope="module", params=VIDEO_FAMILIES)
def family(request: pytest.FixtureRequest) -> ModelFamily:
    """The families that serve video."""
    return family_named(request.param)


VISION_TOL = 1e-5  # max |Δ| of the tower's outputs, fp32, as test_family_parity.py's
Grid = tuple[int, int, int]
VIDEOS = {  # (T, h, w) in patches; h and w multiples of the 2 x 2 merge
    "one_video": [(3, 12, 16)],  # Qwen2.5-VL: 6 x 8 merged tokens per frame, windows of 4 x 4 with a short row
    "two_videos": [(2, 8, 8), (4, 6, 10)],  # exactly one window per frame; then a frame smaller than one window
}

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def ref(family: ModelFamily, model_dir: Path):
    model_class = family.checkpoint.hf_model_class()
    return model_class.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours(model_dir: Path):
    return load_model(model_dir, torch.float32)


def video_pixels(model_dir: Path, grids: list[Grid], seed: int = 0) -> torch.Tensor:
    """[sum of T*h*w, C * temporal_patch_size * P * P]: random rows shaped like pixel_values_videos."""
    vision = load_model_config(model_dir).vision
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    num_rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(num_rows, patch_dim, generator=torch.Generator().manual_seed(seed))


def frame_grids(grids: list[Grid]) -> list[tuple[int, int, Grid]]:
    """(first row, last row, (1, h, w)) of every temporal grid of the videos, in order: the engine's items."""
    out, start = [], 0
    for t, h, w in grids:
        for _ in range(t):
            out.append((start, start + h * w, (1, h, w)))
            start += h * w
    return out


def outputs(out: ImageEmbeddings) -> list[torch.Tensor]:
    return [out.main, *out.deepstack]


def reference(ref, pixel_values: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
    """transformers' tower over the whole videos: [merged tokens of every video back to back, hidden] per tensor."""
    return tower_outputs(ref.model.get_video_features(pixel_values, torch.tensor(grids)))


def cat(parts: list[ImageEmbeddings]) -> list[torch.Tensor]:
    return [torch.cat(ts) for ts in zip(*(outputs(p) for p in parts))]


def check_close(got: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(expected)
    assert all(g.shape == e.shape for g, e in zip(got, expected)), what
    diffs = [(g - e).abs().max().item() for g, e in zip(got, expected)]
    print(f"{what}: max|Δ| {', '.join(f'{d:.2e}' for d in diffs)} (main, then DeepStack)")
    assert max(diffs) <= VISION_TOL, what


@pytest.mark.parametrize("name", list(VIDEOS))
def test_grid_by_grid_matches_the_reference_over_the_whole_video(family, model_dir, ref, ours, name) -> None:
    grids = VIDEOS[name]
    pixel_values = video_pixels(model_dir, grids)
    vision = load_model_config(model_dir).vision
    with torch.no_grad():
        expected = reference(ref, pixel_values, grids)
        whole, by_units = [], []
        for k, (lo, hi, grid) in enumerate(frame_grids(grids)):
            rows = pixel_values[lo:hi]
            whole.append(ours.visual(rows, [grid]))
            state = ours.visual.start_encode(rows, grid)  # the engine's path: the family's units, a few per call
            assert state.units == family.encoder_units(vision, grid)
            while not state.done:
                ours.visual.run_units(state, 1 + k % 3)
            by_units.append(ours.visual.finish_encode(state))
    check_close(cat(whole), expected, f"{name} grid by grid")
    check_close(cat(by_units), expected, f"{name} grid by grid, unit by unit")


@pytest.mark.parametrize("name", list(VIDEOS))
def test_our_tower_over_the_whole_video_attends_within_each_temporal_grid(model_dir, ref, ours, name) -> None:
    # the engine never hands the tower t > 1, but the tower's contract is transformers': a (T, h, w) grid attends
    # frame by frame, so the whole video in one call gives the reference's rows too
    grids = VIDEOS[name]
    pixel_values = video_pixels(model_dir, grids, seed=1)
    with torch.no_grad():
        check_close(outputs(ours.visual(pixel_values, grids)), reference(ref, pixel_values, grids), f"{name} whole")


def test_a_repeated_grid_encodes_to_the_same_rows(model_dir, ours) -> None:
    # a still video's grids have equal pixels, so equal content hashes: the encoder cache may hand one grid's
    # embeddings to another only if the tower's output depends on nothing but the grid's own pixels and shape
    grids = [(2, 8, 12)]
    rows = video_pixels(model_dir, [(1, 8, 12)], seed=2)
    with torch.no_grad():
        whole = outputs(ours.visual(torch.cat([rows, rows]), grids))
        one = outputs(ours.visual(rows, [(1, 8, 12)]))
    half = one[0].shape[0]
    for w, o in zip(whole, one):
        assert (w[:half] - o).abs().max().item() <= VISION_TOL
        assert (w[half:] - o).abs().max().item() <= VISION_TOL
