"""Video input (firsttoken/inputs/video.py): Qwen's sampling under the server's budget, the header and packet checks
that refuse a bad video before any frame is decoded, a decode that reads only the sampled frames, and nothing left
open. Clips are made here (tiny, synthetic); counts come from the PyAVBackend passed in, never from timings."""

from __future__ import annotations

import gc
import itertools
import json
import subprocess
import sys
import time

import av
import numpy as np
import pytest
import torch

from firsttoken.config import VideoConfig
from firsttoken.inputs.budget import BudgetError
from firsttoken.inputs.image import ImageInputError
from firsttoken.inputs.video import (
    PyAVBackend,
    VideoAsk,
    VideoInputError,
    decode_frame_list,
    decode_video,
    load_video,
    plan_frame_list,
    plan_video,
    plan_video_bytes,
    probe_video,
    read_video,
)
from firsttoken.inputs.video_synth import make_clip, trim_clip
from firsttoken.models.model_config import ImageProcessorConfig
from tests.video_fakes import (
    TickingClock,
    many_streams,
    open_fds,
    patch_mkv_duration,
    qwen_plan,
    qwen_vl_utils_oracle,
    remux,
    threads_alive,
    unstate_mkv_rate,
)

PROC = ImageProcessorConfig()  # Qwen2/2.5-VL: 14 px patches, 2x2 merge, 2 frames per temporal patch
PROC3 = ImageProcessorConfig(patch_size=16)  # Qwen3-VL's 16 px patches
QWEN_TOTAL_TOKENS = 115200  # qwen-vl-utils' default total_pixels: MODEL_SEQ_LEN 128000 * 0.9 cells


@pytest.fixture(scope="module")
def clip() -> bytes:
    """3 s, 30 fps, 90 frames of 64x48 h264 in MP4, a key frame every 10 frames."""
    return make_clip(3, 64, 48, fps=30, gop=10)


def reference_frames(data: bytes) -> list[np.ndarray]:
    """Every frame, decoded front to back by PyAV itself (the test's reference, not the code under test)."""
    with av.open(__import__("io").BytesIO(data)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


# ---------------------------------------------------------------------------------------------- sampling


SAMPLING_ROWS = [  # (frames in the container, its fps, width, height)
    (300, 30, 640, 360), (1800, 30, 1920, 1080), (1440, 24, 1280, 720), (30, 30, 640, 360), (3, 30, 640, 360),
    (2, 30, 640, 360), (18000, 30, 640, 360), (1798, 30000 / 1001, 1920, 1080), (300, 30, 360, 640),
    (300, 30, 64, 48), (300, 30, 3840, 2160), (45, 15, 320, 240),
]
ASKS = [(None, None), (1.0, None), (0.5, None), (None, 16), (None, 15), (2.0, 100)]  # (fps, max_frames)
BUDGETS = [QWEN_TOTAL_TOKENS, 16384, 4096, 1024]


def test_sampling_equals_qwen_vl_utils_wherever_its_result_keeps_the_budget() -> None:
    """Frame count, frame indices and frame size equal qwen-vl-utils' (smart_nframes, torch.linspace, its
    max_pixels rule with total_pixels = the budget) on a table of lengths, rates, sizes, asks and budgets; where
    Qwen's own result would exceed the budget, ours stays within it instead (the next test)."""
    q = qwen_vl_utils_oracle()
    if q is None:
        pytest.skip("qwen-vl-utils is not installed (the test extra); test_sampling_table_transcribed still runs")
    equal = over_budget = 0
    for (total, fps, w, h), (ask_fps, ask_frames), budget in itertools.product(SAMPLING_ROWS, ASKS, BUDGETS):
        nframes, idx, size = qwen_plan(q, total, fps, w, h, budget, ask_fps, ask_frames)
        plan = plan_video(total, fps, w, h, VideoConfig(video_max_tokens=budget), PROC,
                          VideoAsk(fps=ask_fps, max_frames=ask_frames))
        qwen_tokens = nframes // 2 * (size[0] // 28) * (size[1] // 28)
        if qwen_tokens > budget:
            over_budget += 1
            assert plan.num_tokens <= budget
            continue
        assert (plan.num_frames, list(plan.frame_indices), plan.resized_size) == (nframes, idx, size), (
            total, fps, w, h, ask_fps, ask_frames, budget)
        assert plan.num_tokens == qwen_tokens
        equal += 1
    assert (equal, over_budget) == (250, 38)  # the table's shape: most rows compare, some exercise the cap


# Transcribed from qwen-vl-utils 0.0.14 (the oracle above printed them), so the rules stay checked without it.
TRANSCRIBED = [
    # (total, fps, w, h, budget, ask fps, ask max_frames) -> (nframes, first indices, last index, (w, h))
    ((300, 30, 640, 360, QWEN_TOTAL_TOKENS, None, None), (20, [0, 16, 31, 47], 299, (644, 364))),
    ((1800, 30, 1920, 1080, QWEN_TOTAL_TOKENS, None, None), (120, [0, 15, 30], 1799, (1008, 560))),
    ((30, 30, 640, 360, QWEN_TOTAL_TOKENS, None, None), (4, [0, 10, 19, 29], 29, (644, 364))),
    ((3, 30, 640, 360, QWEN_TOTAL_TOKENS, None, None), (2, [0, 2], 2, (644, 364))),
    ((18000, 30, 640, 360, QWEN_TOTAL_TOKENS, None, None), (768, [0, 23, 47], 17999, (644, 364))),
    ((1798, 30000 / 1001, 1920, 1080, 16384, None, None), (118, [0, 15, 31], 1797, (616, 336))),
    ((300, 30, 64, 48, 4096, None, None), (20, [0, 16, 31, 47], 299, (392, 280))),
    ((1800, 30, 1280, 720, 16384, 1.0, 16), (16, [0, 120, 240, 360], 1799, (1008, 560))),
    ((45, 15, 320, 240, 4096, None, 15), (6, [0, 9, 18, 26], 44, (392, 280))),
]


@pytest.mark.parametrize(("row", "want"), TRANSCRIBED)
def test_sampling_table_transcribed(row: tuple, want: tuple) -> None:
    total, fps, w, h, budget, ask_fps, ask_frames = row
    plan = plan_video(total, fps, w, h, VideoConfig(video_max_tokens=budget), PROC,
                      VideoAsk(fps=ask_fps, max_frames=ask_frames))
    nframes, first, last, size = want
    assert plan.num_frames == nframes
    assert list(plan.frame_indices[: len(first)]) == first and plan.frame_indices[-1] == last
    assert plan.resized_size == size


def test_the_token_cap_holds_for_every_length_size_and_family() -> None:
    """tokens = grids x cells per grid <= the budget, always; frames shrink toward the per-frame minimum first and
    only then drop (an even count, never below 2)."""
    for total, (w, h), budget, proc in itertools.product(
        (2, 7, 60, 301, 1800, 18000), ((640, 360), (1920, 1080), (28, 5000), (4000, 30), (100, 100)),
        (128, 1000, 4096, 20000), (PROC, PROC3),
    ):
        plan = plan_video(total, 30, w, h, VideoConfig(video_max_tokens=budget), proc)
        factor = proc.pixels_per_token
        rw, rh = plan.resized_size
        assert rw % factor == 0 and rh % factor == 0
        per_grid = (rw // factor) * (rh // factor)
        assert plan.num_tokens == plan.grid_thw[0] * per_grid <= budget
        assert per_grid <= VideoConfig().video_max_frame_tokens
        assert plan.num_frames % 2 == 0 and plan.num_frames >= 2
        assert plan.grid_thw == (plan.num_frames // 2, rh // proc.patch_size, rw // proc.patch_size)


def test_a_long_video_under_a_small_budget_gets_fewer_frames_at_the_per_frame_minimum() -> None:
    # 60 s at 2 fps is 120 frames = 60 grids; 4096 tokens / 128 per grid allows 32 grids = 64 frames.
    plan = plan_video(1800, 30, 1920, 1080, VideoConfig(video_max_tokens=4096), PROC)
    assert plan.num_frames == 64
    assert list(plan.frame_indices) == torch.linspace(0, 1799, 64).round().long().tolist()  # spread over all 60 s
    # The largest 16:9 size within 4096 / 32 = 128 cells per grid: 15 x 8 = 120 cells (smart_resize floors).
    assert plan.resized_size == (420, 224) and plan.num_tokens == 32 * 120


def test_a_request_may_ask_for_less_never_more() -> None:
    limits = VideoConfig(video_max_tokens=4096, video_max_frames=64, video_fps=2.0)
    full = plan_video(300, 30, 640, 360, limits, PROC)
    assert full.num_frames == 20
    assert plan_video(300, 30, 640, 360, limits, PROC, VideoAsk(fps=1.0)).num_frames == 10
    assert plan_video(300, 30, 640, 360, limits, PROC, VideoAsk(max_frames=8)).num_frames == 8
    fewer = plan_video(300, 30, 640, 360, limits, PROC, VideoAsk(max_visual_tokens=512))
    assert fewer.num_tokens <= 512 < full.num_tokens
    for ask, field in ((VideoAsk(fps=4.0), "fps"), (VideoAsk(max_frames=65), "max_frames"),
                       (VideoAsk(max_visual_tokens=4097), "max_visual_tokens"),
                       (VideoAsk(max_visual_tokens=127), "max_visual_tokens"), (VideoAsk(fps=0), "fps")):
        with pytest.raises(BudgetError) as err:
            plan_video(300, 30, 640, 360, limits, PROC, ask, param="messages[0].content[1].video_url")
        assert err.value.param == f"messages[0].content[1].video_url.{field}"


def test_timestamps_for_qwen2_5_and_qwen3() -> None:
    plan = plan_video(300, 30, 640, 360, VideoConfig(), PROC)  # 20 frames of 300 at 30 fps
    assert plan.sample_fps == pytest.approx(2.0)
    assert plan.seconds_per_grid == pytest.approx(1.0)  # Qwen2.5-VL: temporal_patch_size / sample_fps
    assert plan.timestamps_s[:3] == (0.0, 16 / 30, 31 / 30)
    grid = plan.grid_timestamps()  # Qwen3-VL: the mean of each grid's two frame times
    assert len(grid) == 10 and grid[0] == pytest.approx((0 + 16 / 30) / 2) and grid[-1] == pytest.approx(
        (283 / 30 + 299 / 30) / 2)


def test_a_video_too_short_to_sample_is_refused_naming_its_frames() -> None:
    with pytest.raises(VideoInputError, match="video holds 1 frame; at least 2 are needed"):
        plan_video(1, 30, 64, 48, VideoConfig(), PROC)


# ---------------------------------------------------------------------------------------------- decode


def test_decode_returns_exactly_the_planned_frames_reading_only_what_it_must(clip: bytes) -> None:
    be = PyAVBackend()
    loaded = load_video(clip, VideoConfig(), PROC, backend=be, resize=False)
    h, idx = loaded.header, loaded.index
    assert (h.container, h.codec, h.width, h.height, h.fps, h.num_frames) == ("mov", "h264", 64, 48, 30.0, 90)
    assert idx.num_frames == 90 and len(idx.key_pts) == 9
    assert loaded.plan.frame_indices == (0, 18, 36, 53, 71, 89)
    ref = reference_frames(clip)
    for k, i in enumerate(loaded.plan.frame_indices):
        assert np.array_equal(loaded.video.frames[k], ref[i])
    assert loaded.video.pts_s == pytest.approx([i / 30 for i in loaded.plan.frame_indices])
    # Counts: one container for the header and the packets, one to decode; every packet demuxed once; decoding
    # starts at the key frame before each sampled frame (0, 10, 30, 50, 70, 80), so it stops well short of all 90.
    assert be.opened == 2 and be.packets_demuxed == 90
    assert be.frames_converted == 6
    assert be.frames_decoded == 1 + 9 + 7 + 4 + 2 + 10 == 33
    assert be.max_held == 1 and be.held == 0  # one full-size RGB frame alive at a time


def test_resized_frames_have_the_plans_size_and_the_decoder_holds_one_full_frame(clip: bytes) -> None:
    be = PyAVBackend()
    loaded = load_video(clip, VideoConfig(video_max_tokens=512), PROC, backend=be)
    rw, rh = loaded.plan.resized_size
    assert loaded.video.frames.shape == (6, rh, rw, 3) and loaded.video.frames.dtype == np.uint8
    assert be.max_held == 1


# (container, codec, bframes, variant): with B-frames (for VP9, hidden alt-ref frames) frames are stored out of
# display order. Variants: "no rate", a Matroska file without DefaultDuration; "no rate or duration", nor Duration;
# "in matroska", the AVI clip's packets copied into Matroska with their decode-order stamps (as in VfW mode)
PRESENTATION_CASES = [
    ("avi", "libx264", 0, ""), ("avi", "libx264", 3, ""), ("avi", "mpeg4", 3, ""),
    ("mp4", "libx264", 0, ""), ("mp4", "libx264", 3, ""),
    ("matroska", "libx264", 0, ""), ("matroska", "libx264", 3, ""),
    ("webm", "libvpx-vp9", 0, ""), ("webm", "libvpx-vp9", 3, ""),
    ("matroska", "libx264", 0, "no rate"), ("matroska", "libx264", 3, "no rate"),
    ("webm", "libvpx-vp9", 0, "no rate"), ("webm", "libvpx-vp9", 3, "no rate"),
    ("matroska", "libx264", 3, "no rate or duration"), ("webm", "libvpx-vp9", 3, "no rate or duration"),
    ("avi", "libx264", 3, "in matroska"),
]


def assert_frames_shown_at_their_times(data: bytes, limits: VideoConfig, num_sampled: int) -> None:
    """Each sampled frame is the frame a front-to-back decode of the same file shows at the sampled place, and its
    time is the one the plan gives the model (place over the clip's frame rate); the plan counts the frames that
    decode shows and samples ``num_sampled`` of them."""
    ref = reference_frames(data)
    loaded = load_video(data, limits, PROC, resize=False)
    assert loaded.index.num_frames == len(ref)
    assert loaded.plan.num_frames == num_sampled
    wrong = [i for k, i in enumerate(loaded.plan.frame_indices) if not np.array_equal(loaded.video.frames[k], ref[i])]
    assert wrong == [], f"{len(wrong)} of {loaded.plan.num_frames} sampled frames are not the frame shown there"
    assert loaded.video.pts_s == pytest.approx(loaded.plan.timestamps_s, abs=1e-3)  # (Matroska stamps in ms)


@pytest.mark.parametrize(("container", "codec", "bframes", "variant"), PRESENTATION_CASES,
                         ids=[f"{c}-{k}-b{b}{'-' + v.replace(' ', '-') if v else ''}"
                              for c, k, b, v in PRESENTATION_CASES])
def test_each_sampled_frame_is_the_one_shown_at_its_time(container: str, codec: str, bframes: int,
                                                          variant: str) -> None:
    data = make_clip(3, 64, 48, fps=30, gop=12, container=container, codec=codec, bframes=bframes)
    if variant == "in matroska":
        data = remux(data, "matroska")
    elif variant:
        data = unstate_mkv_rate(data, duration_too=variant == "no rate or duration")
    for fps, num_sampled in ((2.0, 6), (10.0, 30)):  # of the 90 frames, 3 s at 30 fps
        assert_frames_shown_at_their_times(data, VideoConfig(video_fps=fps), num_sampled)


def test_a_matroska_file_stating_no_frame_rate_is_measured_from_its_packets() -> None:
    """Without DefaultDuration the one-packet probe reads no rate (FFmpeg's guess from one packet would be 60 fps
    for this 30 fps H.264 clip, 1000 for VP9); the packets' stamps give it, and the header's estimates are not
    checked as if the container declared them: only its stated duration is, and the packets' count."""
    for codec in ("libx264", "libvpx-vp9"):
        data = unstate_mkv_rate(make_clip(3, 64, 48, fps=30, container="matroska", codec=codec))
        header = probe_video(data, VideoConfig())
        assert (header.fps, header.num_frames, header.frames_declared, header.duration_s) == (None, None, False, 3.0)
        loaded = load_video(data, VideoConfig(max_video_source_frames=90), PROC)
        assert loaded.index.fps == pytest.approx(30, rel=1e-3)  # 89 intervals over 2.967 s (stamps in ms)
        assert loaded.plan.frame_indices == (0, 18, 36, 53, 71, 89)
        err, be = _refused(data, VideoConfig(max_video_source_frames=89))
        assert str(err) == "video holds more than 89 frames (its header declares no frame count); the limit is 89"
        assert be.frames_decoded == 0
        err, be = _refused(data, VideoConfig(video_max_seconds=2.5))
        assert str(err) == "video declares 3.0 s; the limit is 2.5 s" and be.packets_demuxed == 0


def test_an_avi_without_b_frames_is_decoded_by_seeking_to_the_key_frames() -> None:
    """AVI stamps packets in file order, which is also the shown order where the decoder reorders nothing: the
    decode seeks to the key frame before each sampled frame, as for the MP4 clip (33 of 90 frames decoded)."""
    data = make_clip(3, 64, 48, fps=30, gop=10, container="avi", codec="libx264", bframes=0)
    be = PyAVBackend()
    loaded = load_video(data, VideoConfig(), PROC, backend=be, resize=False)
    ref = reference_frames(data)
    assert loaded.plan.frame_indices == (0, 18, 36, 53, 71, 89)
    assert all(np.array_equal(loaded.video.frames[k], ref[i]) for k, i in enumerate(loaded.plan.frame_indices))
    assert be.frames_decoded == 1 + 9 + 7 + 4 + 2 + 10 == 33
    assert be.seeks == 6


def test_frames_placed_by_count_must_number_the_packets() -> None:
    """An AVI with B-frames is decoded front to back and its frames placed by their count (its stamps are decode
    order). Cut one packet after a key frame, its first GOP cannot be decoded: the decoder gives 78 frames for 89
    packets, so the count cannot place them, and the video is refused saying so."""
    data = remux(make_clip(3, 64, 48, fps=30, gop=12, container="avi", codec="libx264", bframes=3), "avi",
                 skip_packets=1)
    err, be = _refused(data)
    assert (err.code, str(err)) == (
        "invalid_video", "video's decoder gave 78 frames for its 89 packets; its frames carry no presentation times "
        "to place them by")


@pytest.mark.parametrize("bframes", [0, 3])
def test_an_mp4_cut_without_reencoding_is_planned_over_the_frames_it_shows(bframes: int) -> None:
    """Cut at 4.9 s the usual way (ffmpeg -ss 4.9 -c copy: trim_clip), a 7 s clip whose only key frame is at 0 s
    keeps 49 frames of pre-roll that its edit list hides: the clip is the 21 frames from 4.9 s, 2.0 s of video."""
    data = trim_clip(make_clip(7, 64, 48, fps=10, bframes=bframes), 4.9)
    be = PyAVBackend()
    loaded = load_video(data, VideoConfig(), PROC, backend=be, resize=False)
    assert (loaded.header.num_frames, loaded.index.num_frames) == (70, 21)  # the header counts the hidden frames
    assert loaded.plan.frame_indices == (0, 7, 13, 20) and loaded.plan.timestamps_s[-1] == pytest.approx(2.0)
    assert be.frames_converted == 4
    for fps, num_sampled in ((2.0, 4), (10.0, 20)):  # 21 frames, 2.0 s
        assert_frames_shown_at_their_times(data, VideoConfig(video_fps=fps), num_sampled)


@pytest.mark.parametrize(("container", "codec", "name"), [
    ("matroska", "libvpx-vp9", "vp9"), ("matroska", "libvpx", "vp8"), ("avi", "mpeg4", "mpeg4"),
    ("mp4", "libx264", "h264"), ("mp4", "libx265", "hevc"),  # x265 puts B-frames in: decode order != display order
    ("mp4", "libsvtav1", "av1"), ("matroska", "mpeg2video", "mpeg2video"),
])
def test_other_containers_and_codecs(container: str, codec: str, name: str) -> None:
    data = make_clip(2, 64, 64, fps=10, gop=5, codec=codec, container=container)
    be = PyAVBackend()
    loaded = load_video(data, VideoConfig(), PROC, backend=be, resize=False)
    assert loaded.header.codec == name
    ref = reference_frames(data)
    assert loaded.index.num_frames == len(ref) == 20
    for k, i in enumerate(loaded.plan.frame_indices):
        assert np.array_equal(loaded.video.frames[k], ref[i])


def test_plan_from_bytes_decodes_nothing(clip: bytes) -> None:
    be = PyAVBackend()
    _, index, plan = plan_video_bytes(clip, VideoConfig(), PROC, backend=be)
    assert (index.num_frames, plan.num_frames, be.frames_decoded) == (90, 6, 0)
    # A request asking for more than the server grants is refused before the container is even opened.
    be = PyAVBackend()
    with pytest.raises(BudgetError, match="video_url.max_frames=1000 must be from 2 to this server's cap of 768"):
        load_video(clip, VideoConfig(), PROC, VideoAsk(max_frames=1000), backend=be)
    assert be.opened == 0


def test_a_passed_deadline_is_a_timeout_not_a_decode(clip: bytes) -> None:
    be = PyAVBackend()
    limits = VideoConfig()
    with pytest.raises(VideoInputError, match="longer than 30 s") as err:
        read_video(clip, limits, be, deadline=time.monotonic() - 1)
    assert err.value.code == "video_timeout"
    header, index = read_video(clip, limits, be)
    plan = plan_video(index.num_frames, index.fps, header.width, header.height, limits, PROC)
    with pytest.raises(VideoInputError, match="longer than") as err:
        decode_video(clip, header, index, plan, limits, be, deadline=time.monotonic() - 1)
    assert be.frames_decoded == 1 and be.frames_converted == 0


def test_one_deadline_covers_reading_and_decoding_a_video(clip: bytes) -> None:
    """As the server runs a video (plan before admission, decode after), the packet pass and the decode share one
    --video-decode-timeout. The clock ticks a second per read: the 90 packets use 90+ of 100 seconds, and decoding
    the 6 sampled frames needs 33 frames through the decoder, so the decode runs out after the few seconds left."""
    be = PyAVBackend(clock=TickingClock())
    limits = VideoConfig(video_decode_timeout_s=100)
    header, index, plan = plan_video_bytes(clip, limits, PROC, backend=be)
    assert be.packets_demuxed == 90
    with pytest.raises(VideoInputError, match="longer than 100 s") as err:
        decode_video(clip, header, index, plan, limits, be)
    assert err.value.code == "video_timeout"
    assert be.clock.now < 110  # about 100 reads in all (a few more start and end the two stages), not 2 x 100
    assert 0 < be.frames_decoded < 33 and be.frames_converted < 6
    be = PyAVBackend(clock=TickingClock())  # with room for both, the same video decodes
    limits = VideoConfig(video_decode_timeout_s=150)
    header, index, plan = plan_video_bytes(clip, limits, PROC, backend=be)
    assert decode_video(clip, header, index, plan, limits, be).frames.shape[0] == 6


# ---------------------------------------------------------------------------------------------- bad videos


def _refused(data: bytes, limits: VideoConfig = VideoConfig()) -> tuple[VideoInputError, PyAVBackend]:
    be = PyAVBackend()
    with pytest.raises(VideoInputError) as err:
        load_video(data, limits, PROC, backend=be)
    return err.value, be


def test_over_a_header_limit_nothing_is_demuxed_or_decoded(clip: bytes) -> None:
    cases = [
        (VideoConfig(max_video_pixels=64 * 48 - 1), "video_too_large",
         "video declares 64x48 = 3072 pixels per frame; the limit is 3071"),
        (VideoConfig(video_max_seconds=2.5), "video_too_long", "video declares 3.0 s; the limit is 2.5 s"),
        (VideoConfig(max_video_source_frames=89), "video_too_long", "video declares 90 frames; the limit is 89"),
        (VideoConfig(max_video_bytes=len(clip) - 1), "video_too_large",
         f"video is {len(clip)} bytes; the limit is {len(clip) - 1} bytes"),
    ]
    for limits, code, message in cases:
        err, be = _refused(clip, limits)
        assert (err.code, str(err)) == (code, message)
        assert (be.packets_demuxed, be.frames_decoded) == (0, 0)


@pytest.mark.parametrize(("container", "name"), [("mp4", "MP4/MOV"), ("matroska", "WebM/Matroska"), ("avi", "AVI")])
def test_a_container_of_more_streams_than_the_limit_is_refused_before_ffmpeg_opens_it(container: str, name: str) -> None:
    one = make_clip(0.2, 32, 32, fps=10, container=container)
    err, be = _refused(many_streams(one, 17, container))
    assert (err.code, str(err)) == ("unsupported_video", f"video container ({name}) holds 17 streams; the limit is 16")
    assert be.opened == 0
    loaded = load_video(many_streams(one, 16, container), VideoConfig(), PROC)  # at the limit: served
    assert (loaded.header.num_streams, loaded.plan.num_frames) == (16, 2)


# The child reads each file, loads it once and prints what it cost: its peak RSS over the RSS it had just before
# (everything imported, one small clip already decoded; Linux's peak is reset through /proc/self/clear_refs), CPU
# seconds, the backend's counts and the refusal.
_COST_CHILD = """
import json, sys, time
from firsttoken.config import VideoConfig
from firsttoken.inputs.video import PyAVBackend, VideoInputError, load_video
from firsttoken.inputs.video_synth import make_clip
from firsttoken.models.model_config import ImageProcessorConfig
load_video(make_clip(1, 64, 48, fps=10), VideoConfig(), ImageProcessorConfig())
def status_kib(field):
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(field + ":")))
out = []
for path in sys.argv[1:]:
    data = open(path, "rb").read()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the RSS now
    rss = status_kib("VmRSS")
    cpu, be, refusal = time.process_time(), PyAVBackend(), None
    try:
        load_video(data, VideoConfig(), ImageProcessorConfig(), backend=be)
    except VideoInputError as err:
        refusal = str(err)
    out.append({"rise_bytes": (status_kib("VmHWM") - rss) * 1024,
                "cpu_s": time.process_time() - cpu, "opened": be.opened, "decoded": be.frames_decoded,
                "refusal": refusal})
print(json.dumps(out))
"""


def _peak_rss_resettable() -> bool:
    """Whether this process may write /proc/self/clear_refs (as the child below does; a sandbox may refuse it).
    Writing "5" resets only this process's peak RSS, which no test reads in-process."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def test_many_large_one_frame_streams_cost_no_decoding_before_their_400(tmp_path) -> None:
    """64 streams of one 4096x2160 frame each in a ~2.6 MB Matroska file: FFmpeg's probe, unbounded, decodes a frame
    of every stream when the container is opened, before any check of ours (the cost it had:
    docs/runs/notes/2026-12-07-video-streams.md). It is refused from its structure before FFmpeg opens it; and at
    the default limit of 16 streams, the one open reads one packet and decodes none: the 400 names the one frame.
    Bounds, generous: RSS rises under 200 MB, under 2 CPU seconds each (measured in a fresh process)."""
    if not _peak_rss_resettable():
        pytest.skip("/proc/self/clear_refs is not writable here (a sandbox): the child cannot reset its peak RSS")
    frame = make_clip(0.1, 4096, 2160, fps=10, container="matroska")  # one frame
    paths = []
    for n in (16, 64):  # the one FFmpeg opens first: the allocator may keep what it frees for the next
        paths.append(tmp_path / f"streams{n}.mkv")
        paths[-1].write_bytes(many_streams(frame, n, "matroska"))
    run = subprocess.run([sys.executable, "-c", _COST_CHILD, *map(str, paths)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    at_limit, over = json.loads(run.stdout)
    assert over["refusal"] == "video container (WebM/Matroska) holds 64 streams; the limit is 16"
    assert at_limit["refusal"] == "video holds 1 frame; at least 2 are needed"
    assert (over["opened"], at_limit["opened"], at_limit["decoded"]) == (0, 1, 0)
    for cost in (over, at_limit):
        assert cost["rise_bytes"] < 200 * 2**20 and cost["cpu_s"] < 2.0, cost


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    data = make_clip(0.2, 4096, 2304, fps=10, flat=True)  # two flat 9.4-megapixel frames in ~30 KiB
    assert 2 * 4096 * 2304 * 3 / len(data) > 1000  # decoded RGB over encoded bytes
    err, be = _refused(data, VideoConfig(max_video_pixels=8_000_000))
    assert err.code == "video_too_large" and "4096x2304 = 9437184 pixels per frame; the limit is 8000000" in str(err)
    assert (be.packets_demuxed, be.frames_decoded) == (0, 0)


def test_an_absurd_duration_in_the_header_is_refused_before_any_packet() -> None:
    data = patch_mkv_duration(make_clip(1, 32, 32, fps=10, container="matroska"), 10**7)
    err, be = _refused(data)
    assert err.code == "video_too_long" and str(err) == "video declares 10000000.0 s; the limit is 600 s"
    assert be.packets_demuxed == 0


def test_a_header_that_understates_its_length_cannot_make_the_server_decode_past_the_plan() -> None:
    """The header says 2 s; the file holds 10 s. The packets are the count the plan uses (so 20 frames at 2 fps, as
    for an honest 10 s clip), and only the planned frames are decoded."""
    honest = make_clip(10, 32, 32, fps=30, container="matroska", gop=30)
    lying = patch_mkv_duration(honest, 2.0)
    be = PyAVBackend()
    header = probe_video(lying, VideoConfig(), be)
    assert (header.duration_s, header.num_frames, header.frames_declared) == (2.0, 60, False)
    loaded = load_video(lying, VideoConfig(), PROC, backend=be)
    assert loaded.index.num_frames == 300 and loaded.plan.num_frames == 20
    assert be.frames_converted == 20 and be.frames_decoded < 300
    # Over the limit, the packet pass stops at the limit and refuses: still no frame decoded.
    err, be = _refused(lying, VideoConfig(video_max_seconds=5))
    assert err.code == "video_too_long"
    assert str(err) == "video runs past 5 s (its header declares 2.0 s); the limit is 5 s"
    assert be.frames_decoded == 0 and be.packets_demuxed <= 5 * 30 + 2
    err, be = _refused(lying, VideoConfig(max_video_source_frames=100))
    assert str(err) == "video holds more than 100 frames (its header declares 60); the limit is 100"
    assert be.frames_decoded == 0 and be.packets_demuxed == 101


@pytest.mark.parametrize("faststart", [False, True])
def test_a_truncated_file_is_refused(clip: bytes, faststart: bool) -> None:
    data = make_clip(3, 64, 48, fps=30, gop=10, options={"movflags": "faststart"}) if faststart else clip
    err, be = _refused(data[: len(data) // 2])
    assert err.code == "invalid_video"
    if faststart:  # the index is intact, the frames are not: counted from the packets
        assert str(err).startswith("video is truncated: its header declares 90 frames, ")
    else:  # the index (moov) was at the end
        assert str(err) == "video container (MP4/MOV) is truncated or corrupt: its header cannot be read"
    assert be.frames_decoded == 0


def test_zero_frames_audio_only_garbage_and_unknown_codecs() -> None:
    zero = make_clip(1, 32, 32, container="matroska", audio=True, num_frames=0)
    err, be = _refused(zero)
    assert (err.code, str(err)) == ("invalid_video", "video holds 0 frames (its header declares 32)")
    assert be.frames_decoded == 0
    for container in ("mp4", "matroska"):
        audio_only = make_clip(1, 32, 32, container=container, audio=True, video=False)
        err, be = _refused(audio_only)
        assert (err.code, str(err)) == ("invalid_video", "the container holds no video stream (1 audio stream)")
    err, _ = _refused(b"this is not a video at all, just some text" * 10)
    assert (err.code, str(err)) == (
        "invalid_video", "data is not a supported video container (MP4/MOV, WebM/Matroska, AVI)")
    err, _ = _refused(b"\x1a\x45\xdf\xa3" + bytes(range(256)) * 4)  # Matroska's magic, garbage after it
    assert err.code == "invalid_video" and "truncated or corrupt" in str(err)
    ffv1 = make_clip(1, 32, 32, fps=10, codec="ffv1", container="matroska")
    err, be = _refused(ffv1)
    assert err.code == "unsupported_video" and str(err).startswith("video codec 'ffv1' is not supported; supported:")
    assert be.packets_demuxed == 0
    err, _ = _refused(b"")
    assert str(err) == "video data is empty"


def test_video_errors_are_image_input_errors_for_the_input_layer() -> None:
    assert issubclass(VideoInputError, ImageInputError)


def test_nothing_is_left_open_after_good_and_bad_videos(clip: bytes) -> None:
    """File descriptors and OS threads (FFmpeg's decoder threads are not Python threads) before and after."""
    bad = [clip[: len(clip) // 2], b"garbage" * 100, make_clip(1, 32, 32, container="mp4", audio=True, video=False),
           patch_mkv_duration(make_clip(1, 32, 32, fps=10, container="matroska"), 10**7)]
    load_video(clip, VideoConfig(), PROC, backend=PyAVBackend(threads=2))  # warm: lazily loaded libraries
    gc.collect()
    fds, threads = open_fds(), threads_alive()
    for _ in range(3):
        load_video(clip, VideoConfig(), PROC, backend=PyAVBackend(threads=2))
        for data in bad:
            with pytest.raises(VideoInputError):
                load_video(data, VideoConfig(), PROC, backend=PyAVBackend(threads=2))
    gc.collect()
    assert open_fds() == fds
    # <=: a thread another test left behind may end meanwhile; a decoder thread left running would add to the count
    assert threads_alive() <= threads


# ---------------------------------------------------------------------------------------------- frame lists


def _png(w: int, h: int, shade: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (shade, 255 - shade, 7)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_video_as_a_list_of_frames() -> None:
    frames = [_png(64, 48, 10 * i) for i in range(5)]
    plan = plan_frame_list(frames, VideoConfig(), PROC)
    assert plan.frame_indices == (0, 1, 2, 3, 4, 4)  # an odd count is padded with the last frame, as Qwen does
    assert plan.sample_fps == 2.0 and plan.seconds_per_grid == 1.0 and plan.grid_thw[0] == 3
    video = decode_frame_list(frames, plan, VideoConfig())
    rw, rh = plan.resized_size
    assert video.frames.shape == (6, rh, rw, 3)
    assert np.array_equal(video.frames[4], video.frames[5])
    assert video.frames[1, 0, 0].tolist() == [10, 245, 7]


def test_a_frame_list_over_the_caps_is_sampled_and_a_mismatched_one_refused() -> None:
    frames = [_png(32, 32, i) for i in range(40)]
    plan = plan_frame_list(frames, VideoConfig(video_max_frames=16), PROC)
    assert plan.num_frames == 16 and plan.frame_indices[0] == 0 and plan.frame_indices[-1] == 39
    plan = plan_frame_list(frames, VideoConfig(video_max_tokens=128 * 5), PROC)  # 5 grids at the minimum
    assert plan.num_frames == 10 and plan.num_tokens <= 640
    with pytest.raises(VideoInputError, match="frame 3 of 3 is 16x16, frame 1 is 32x32"):
        plan_frame_list([_png(32, 32, 0), _png(32, 32, 1), _png(16, 16, 2)], VideoConfig(), PROC)
    with pytest.raises(VideoInputError, match="frame 2 of 2: ") as err:
        plan_frame_list([_png(32, 32, 0), b"not an image"], VideoConfig(), PROC)
    assert err.value.code == "invalid_image"
    with pytest.raises(VideoInputError, match="video is 5 frames; the limit is 4"):
        plan_frame_list(frames[:5], VideoConfig(max_video_source_frames=4), PROC)


# ---------------------------------------------------------------------------------------------- loading


def test_videos_load_from_data_urls_the_media_dir_and_allowed_hosts_with_the_image_checks(
    clip: bytes, tmp_path
) -> None:
    import base64

    from firsttoken.inputs.media import MediaNetwork, load_image_bytes, load_video_bytes, remote_media
    from tests.media_fakes import FakeFetcher, FakeResolver, ok

    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    assert load_video_bytes(url, None, len(clip)) == clip
    with pytest.raises(VideoInputError, match=f"video is {len(clip)} bytes; the limit is 100 bytes") as err:
        load_video_bytes(url, None, 100)  # counted from the base64 length, before decoding it
    assert err.value.code == "video_too_large"
    with pytest.raises(VideoInputError, match="data URL must have a video/\\* media type"):
        load_video_bytes("data:image/png;base64,AAAA", None, 1000)
    with pytest.raises(ImageInputError, match="data URL must have an image/\\* media type"):
        load_image_bytes(url, None, len(clip))  # an image part cannot carry a video

    media = tmp_path / "media"
    media.mkdir()
    (media / "clip.mp4").write_bytes(clip)
    fds = open_fds()
    assert load_video_bytes("clip.mp4", media, len(clip)) == clip
    assert load_video_bytes(f"file://{media}/clip.mp4", media, len(clip)) == clip
    with pytest.raises(VideoInputError, match="local video paths are only allowed inside the server's media"):
        load_video_bytes("../outside.mp4", media, len(clip))
    with pytest.raises(VideoInputError, match="local video paths are disabled on this server"):
        load_video_bytes("clip.mp4", None, len(clip))
    with pytest.raises(VideoInputError, match=f"video is {len(clip)} bytes; the limit is 10 bytes"):
        load_video_bytes("clip.mp4", media, 10)
    assert open_fds() == fds

    fetcher = FakeFetcher({("videos.test", "/c.mp4"): ok(clip)})
    network = MediaNetwork(FakeResolver({"videos.test": ["93.184.216.34"], "inside.test": ["10.0.0.8"]}), fetcher)
    remote = remote_media("videos.test,inside.test", 5.0, network)
    assert load_video_bytes("https://videos.test/c.mp4", None, len(clip), remote) == clip
    assert fetcher.sent[-1].accept == "video/*" and fetcher.sent[-1].max_bytes == len(clip)
    with pytest.raises(VideoInputError, match=f"remote video exceeds the limit of {len(clip) - 1} bytes"):
        load_video_bytes("https://videos.test/c.mp4", None, len(clip) - 1, remote)
    with pytest.raises(VideoInputError, match="the video URL's host resolves to a private or reserved address"):
        load_video_bytes("https://inside.test/c.mp4", None, len(clip), remote)
    with pytest.raises(VideoInputError, match="remote video URLs are disabled on this server"):
        load_video_bytes("https://videos.test/c.mp4", None, len(clip))


def test_corrupted_bytes_are_a_video_error_or_a_video_never_anything_else() -> None:
    """200 seeded mutants (bytes overwritten, files cut) of four small clips in three containers: each loads or is
    refused with a VideoInputError; no other exception escapes (it would be a 500) and no descriptor stays open."""
    import random

    clips = [make_clip(2, 64, 48, fps=15, gop=5), make_clip(2, 64, 48, fps=15, gop=5, options={"movflags": "faststart"}),
             make_clip(2, 64, 48, fps=15, gop=5, container="matroska", codec="libvpx-vp9"),
             make_clip(2, 64, 48, fps=15, gop=5, container="avi", codec="mpeg4")]
    rng = random.Random(40)
    outcomes: dict[str, int] = {}
    fds = open_fds()
    for _ in range(200):
        data = bytearray(rng.choice(clips))
        for _ in range(rng.choice((1, 4, 16, 64))):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        try:
            load_video(bytes(data), VideoConfig(), PROC)
            outcome = "loaded"
        except VideoInputError as err:
            outcome = err.code
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    gc.collect()
    assert open_fds() == fds
    assert set(outcomes) <= {"loaded", "invalid_video", "unsupported_video", "video_too_large", "video_too_long",
                             "video_aspect_ratio"}
    assert outcomes.get("loaded", 0) > 0 and outcomes.get("invalid_video", 0) > 0  # both paths were exercised
