"""Video pixel values vs transformers 5.24's Qwen2-VL and Qwen3-VL video processors, recorded in
tests/fixtures/video_oracle/ (torchvision cannot be imported here; its README says how they were made)."""

from __future__ import annotations

import ast
import itertools
import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from firsttoken.config import VideoConfig
from firsttoken.inputs.image import smart_resize
from firsttoken.inputs.video import VideoPlan, load_video, plan_video
from firsttoken.inputs.video_pixels import (
    grid_rows,
    qwen2_processor_size,
    qwen3_processor_size,
    resize_frame,
    video_pixel_values,
)
from firsttoken.inputs.video_synth import make_clip
from firsttoken.models.model_config import ImageProcessorConfig

ORACLE = Path(__file__).resolve().parents[1] / "fixtures" / "video_oracle"
CASES = sorted(p.stem for p in ORACLE.glob("*.npz"))
PROC2 = ImageProcessorConfig()  # Qwen2/2.5-VL: 14 px patches, CLIP mean/std
PROC3 = ImageProcessorConfig(patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)  # Qwen3-VL
SMALL = VideoConfig(video_min_frame_tokens=4, video_max_frame_tokens=24, video_max_tokens=64)

# Fixture cases whose size settings are a firsttoken plan's: (proc, limits, source frames, fps, width, height).
PLAN_CASES = {
    "q2_plan_90x160": (PROC2, SMALL, 4, 2.0, 160, 90),
    "q2_plan_77x101": (PROC2, SMALL, 6, 2.0, 101, 77),
    "q3_plan_80x120": (PROC3, VideoConfig(video_min_frame_tokens=4, video_max_frame_tokens=24, video_max_tokens=20),
                       6, 2.0, 120, 80),
}


def load_case(name: str) -> dict[str, Any]:
    z = np.load(ORACLE / f"{name}.npz")
    meta = json.loads(str(z["meta"]))
    values, codes = z["values"], z["codes"]
    per_channel = codes.shape[1] // values.shape[0]
    expected = np.empty(codes.shape, dtype=np.float32)
    for c in range(values.shape[0]):
        cols = slice(c * per_channel, (c + 1) * per_channel)
        expected[:, cols] = values[c][codes[:, cols]]
    proc = ImageProcessorConfig(
        patch_size=meta["patch_size"], merge_size=meta["merge_size"], temporal_patch_size=meta["temporal_patch_size"],
        image_mean=tuple(meta["image_mean"]), image_std=tuple(meta["image_std"]),
    )
    return {"meta": meta, "proc": proc, "frames": z["frames"], "grid": tuple(int(v) for v in z["grid_thw"]),
            "expected": torch.from_numpy(expected)}


def pixels(frames: np.ndarray, size: tuple[int, int], proc: ImageProcessorConfig):
    return video_pixel_values(np.stack([resize_frame(f, size) for f in frames]), proc)


def test_the_fixtures_exist_and_are_small() -> None:
    assert len(CASES) >= 10
    assert sum((ORACLE / f"{c}.npz").stat().st_size for c in CASES) < 2 * 2**20


@pytest.mark.parametrize("name", CASES)
def test_pixel_values_equal_the_processors_bit_for_bit(name: str) -> None:
    case = load_case(name)
    height, width = case["meta"]["resized_hw"]
    out = pixels(case["frames"], (height, width), case["proc"])
    assert out.grid_thw == case["grid"]
    assert out.pixel_values.dtype == torch.float32
    assert torch.equal(out.pixel_values, case["expected"])


def test_the_fixtures_cover_what_makes_pixels_differ() -> None:
    cases = [load_case(c) for c in CASES]
    source_hw = [c["frames"].shape[1:3] for c in cases]
    resized_hw = [tuple(c["meta"]["resized_hw"]) for c in cases]
    assert any(r[0] * r[1] > s[0] * s[1] for r, s in zip(resized_hw, source_hw))  # enlarged
    assert any(r[0] * r[1] < s[0] * s[1] for r, s in zip(resized_hw, source_hw))  # shrunk
    assert any(r == s for r, s in zip(resized_hw, source_hw))  # not resized: every byte value normalised
    assert any(c["frames"].shape[0] % c["meta"]["temporal_patch_size"] for c in cases)  # temporal padding
    assert {c["meta"]["family"] for c in cases} == {"qwen2", "qwen3"}
    assert {c["meta"]["family"] for c in cases if c["meta"]["default_size"]} == {"qwen2", "qwen3"}


@pytest.mark.parametrize("name", sorted(PLAN_CASES))
def test_a_plans_size_is_what_the_processor_chose_under_the_mapped_settings(name: str) -> None:
    proc, limits, n, fps, width, height = PLAN_CASES[name]
    plan = plan_video(n, fps, width, height, limits, proc)
    meta = load_case(name)["meta"]
    to_size = qwen3_processor_size if meta["family"] == "qwen3" else qwen2_processor_size
    assert to_size(plan, proc) == meta["size"]
    assert plan.num_frames == n  # the fixture holds every sampled frame
    assert list(plan.resized_size[::-1]) == meta["resized_hw"]
    assert plan.grid_thw == load_case(name)["grid"]


# transformers' own sizing functions, compiled from the installed processor sources (their modules import
# torchvision, which this environment cannot): the rule each processor's resize applies with cap_pixels_per_frame
# off.
def _transformers_smart_resize(module: str) -> Callable[..., tuple[int, int]]:
    import importlib.util

    spec = importlib.util.find_spec(f"transformers.models.{module}")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
    ns: dict[str, Any] = {"math": math}
    exec(compile(ast.Module(body=fn, type_ignores=[]), spec.origin, "exec"), ns)  # noqa: S102
    return ns["smart_resize"]


def _plans(proc: ImageProcessorConfig) -> list[VideoPlan]:
    plans = []
    sizes = [(64, 48), (101, 77), (320, 240), (640, 360), (1280, 720), (1920, 1080), (720, 1280), (999, 333),
             (2048, 97), (3840, 2160), (500, 499)]
    for (w, h), (n, fps), budget in itertools.product(sizes, [(8, 4.0), (30, 30.0), (301, 25.0), (1800, 30.0),
                                                             (97, 5.0)], [128, 300, 1000, 4096, 16384]):
        limits = VideoConfig(video_max_tokens=budget, video_min_frame_tokens=min(128, budget))
        plans.append(plan_video(n, fps, w, h, limits, proc))
        plans.append(plan_video(n, fps, w, h, SMALL, proc))
    return plans


def test_qwen2_processors_sizing_reproduces_every_plan() -> None:
    resize = _transformers_smart_resize("qwen2_vl.video_processing_qwen2_vl")
    for plan in _plans(PROC2):
        w, h = plan.original_size
        size = qwen2_processor_size(plan, PROC2)
        got = resize(h, w, factor=28, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        assert got == plan.resized_size[::-1], plan


def test_qwen3_processors_sizing_reproduces_every_plan_with_frame_sides_of_32_px_or_more() -> None:
    resize = _transformers_smart_resize("qwen3_vl.video_processing_qwen3_vl")
    for plan in _plans(PROC3):
        w, h = plan.original_size
        size = qwen3_processor_size(plan, PROC3)
        got = resize(plan.num_frames, h, w, temporal_factor=2, factor=32, min_pixels=size["shortest_edge"],
                     max_pixels=size["longest_edge"])
        assert got == plan.resized_size[::-1], plan


def test_qwen3_sizes_a_frame_side_under_32_px_differently_from_the_per_frame_rule() -> None:
    case = load_case("q3_small_side")
    n, height, width, _ = case["frames"].shape
    size = case["meta"]["size"]
    # Qwen3-VL first scales 20x300 up to 32x480 (the short side to 32 px), then rounds; the per-frame rule rounds
    # 20 -> 32 and 300 -> 288.
    assert case["meta"]["resized_hw"] == [32, 480]
    per_frame = smart_resize(height, width, 32, size["shortest_edge"] // n, size["longest_edge"] // n)
    assert per_frame == (32, 288)


def test_an_odd_frame_count_repeats_the_last_frame() -> None:
    frames = np.random.default_rng(0).integers(0, 256, size=(3, 56, 84, 3), dtype=np.uint8)
    padded = np.concatenate([frames, frames[-1:]])
    odd, even = video_pixel_values(frames, PROC2), video_pixel_values(padded, PROC2)
    assert odd.grid_thw == even.grid_thw == (2, 4, 6)
    assert torch.equal(odd.pixel_values, even.pixel_values)


def test_each_temporal_grid_is_the_pixels_of_its_own_frames() -> None:
    frames = np.random.default_rng(1).integers(0, 256, size=(6, 64, 96, 3), dtype=np.uint8)
    out = video_pixel_values(frames, PROC3)
    rows = grid_rows(out.pixel_values, out.grid_thw)
    assert len(rows) == 3 and all(r.shape == (4 * 6, 3 * 2 * 16 * 16) for r in rows)
    for k, r in enumerate(rows):
        alone = video_pixel_values(frames[2 * k:2 * k + 2], PROC3)
        assert alone.grid_thw == (1, 4, 6) and torch.equal(r, alone.pixel_values)
    with pytest.raises(ValueError, match="rows"):
        grid_rows(out.pixel_values, (2, 4, 6))


def test_frames_not_at_a_patch_multiple_are_refused() -> None:
    with pytest.raises(ValueError, match="multiples of 28"):
        video_pixel_values(np.zeros((2, 50, 56, 3), dtype=np.uint8), PROC2)


def test_decoded_videos_resize_like_the_processor_given_the_full_size_frames() -> None:
    clip = make_clip(2.0, 96, 64, fps=6)
    limits = VideoConfig(video_min_frame_tokens=4, video_max_frame_tokens=8, video_max_tokens=64)
    resized = load_video(clip, limits, PROC2)
    full = load_video(clip, limits, PROC2, resize=False)
    rw, rh = resized.plan.resized_size
    assert (rh, rw) != full.video.frames.shape[1:3]
    assert np.array_equal(resized.video.frames, np.stack([resize_frame(f, (rh, rw)) for f in full.video.frames]))


def test_qwen3_settings_are_refused_for_a_plan_whose_frames_have_a_side_under_32_px() -> None:
    plan = plan_video(8, 2.0, 300, 20, SMALL, PROC3)
    assert qwen2_processor_size(plan_video(8, 2.0, 300, 20, SMALL, PROC2), PROC2)["shortest_edge"] == 3136
    with pytest.raises(ValueError, match="under 32 px"):
        qwen3_processor_size(plan, PROC3)


def test_a_frame_list_resizes_like_the_processor_given_the_full_size_frames() -> None:
    import io

    from PIL import Image

    from firsttoken.inputs.video import decode_frame_list, plan_frame_list

    rng = np.random.default_rng(2)
    images = [rng.integers(0, 256, size=(45, 70, 3), dtype=np.uint8) for _ in range(3)]
    data = []
    for im in images:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="PNG")
        data.append(buf.getvalue())
    plan = plan_frame_list(data, SMALL, PROC2)
    rw, rh = plan.resized_size
    video = decode_frame_list(data, plan, SMALL)
    want = np.stack([resize_frame(images[i], (rh, rw)) for i in plan.frame_indices])
    assert (rh, rw) != (45, 70) and np.array_equal(video.frames, want)
