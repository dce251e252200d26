"""Video input: probe a container from its bytes, plan the sampled frames under the server's budget,
then decode only those frames, in bounded memory and time.

Three stages, each reading less than the next would (docs/video.md):

1. Before FFmpeg sees the bytes: their size, the container's kind
   (``video_container.sniff_container``) and how many streams it declares (``count_streams``, from
   its own structure). FFmpeg's probe, which ``av.open`` runs, is bounded (``header_probe``): it
   reads one packet and decodes nothing it may skip.
2. ``read_video``, one open of the container: the header (``probe_video`` alone reads just this):
   codec, frame size, and the frame rate, duration and frame count the container states; every limit
   that can be checked there is (``VideoConfig``: pixels per frame, seconds, frames in the
   container; a video over one is refused naming what was counted); then the video stream's packets,
   demuxed but not decoded: every shown frame's presentation timestamp (not the pre-roll an MP4 edit
   list hides) and which are key frames. This is the frame count the plan uses, and where the
   container states no frame rate, the rate is measured from their stamps (intervals over their
   presentation span); so a header that lies about its length cannot make the server sample (or
   decode) past what the limits allow: the pass stops, refusing, at the first packet over
   ``max_video_source_frames`` or ``video_max_seconds``, and a container holding fewer frames than
   its header declares is refused as truncated.
3. ``plan_video`` then ``decode_video``: Qwen's sampling (qwen-vl-utils 0.0.14 ``smart_nframes`` and
   ``torch.linspace(0, n - 1, k).round()``: 2 fps, an even count, 4 to 768 frames) under a per-video
   token cap (``video_max_tokens``; frames shrink toward the per-frame minimum first, then the count
   drops), and a decode that seeks to the latest key frame before each sampled frame only when that
   skips work, converts only the sampled frames, resizes each to the plan's size as it comes out of
   the decoder (one full-size frame held at a time; ``video_pixels.resize_frame``, bit-identical to
   transformers' video processors), and checks the video's one deadline (from step 2 on) between
   frames. The container is closed on every way out.

A video may also be a list of frames (images, as vLLM accepts): ``plan_frame_list`` /
``decode_frame_list``, under the same caps; every frame is probed (``probe_image``) before any is
decoded.

Every refusal is a ``VideoInputError`` (an ``ImageInputError``, so the input layer's handlers treat
it the same): its message is safe to show a client and names what was counted; ``code`` is a stable
label.

The decoder is PyAV (FFmpeg), chosen by measurement (benchmarks/bench_video_decode.py,
docs/video.md). It sits behind ``PyAVBackend``, whose counters (packets demuxed, frames decoded,
frames converted, full-size frames held at once) are what tests assert the bounds with.
"""

from __future__ import annotations

import bisect
import io
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from firsttoken.config import VideoConfig
from firsttoken.inputs.image import (
    MAX_ASPECT_RATIO,
    ImageInputError,
    decode_image,
    max_pixels_within_tokens,
    num_visual_tokens,
    probe_image,
    smart_resize,
)
from firsttoken.inputs.video_container import CONTAINERS, count_streams, sniff_container
from firsttoken.inputs.video_pixels import resize_frame
from firsttoken.models.model_config import ImageProcessorConfig

if TYPE_CHECKING:  # PyAV is imported where a container is opened
    from av.container import InputContainer
    from av.video.frame import VideoFrame

# qwen-vl-utils 0.0.14 (vision_process.py): the sampling rules this module reproduces.
FRAME_FACTOR = 2  # sampled frames come in pairs (one temporal patch of two frames per grid)
FPS_MIN_FRAMES = 4

# Codecs we decode (FFmpeg codec names). A stream in another codec is refused naming it.
ALLOWED_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg2video", "mjpeg")
MAX_DECLARED_FPS = 1000.0
# Opening a container runs FFmpeg's probe (avformat_find_stream_info): it sets up a decoder for
# every stream and decodes frames until it knows each one's pixel format and, for H.264, how far
# frames are reordered; unbounded, a file of many large one-frame streams costs a decoded frame per
# stream before any check of ours. Bounded here, per open (with the stream count, checked before
# FFmpeg sees the file):
# FFmpeg's minimum: reading the header and packets, the probe reads one packet
HEADER_PROBE_BYTES = 32
DECODE_PROBE_BYTES = 5_000_000  # FFmpeg's default, for the one stream a decode probes
DECODE_PROBE_US = 5_000_000  # ... and its default analysis duration, in microseconds


class VideoInputError(ImageInputError):
    """A client's video was refused; ``str(err)`` is safe to return to the client. Codes:
    ``invalid_video`` (not a video, truncated, corrupt, no video stream, no frames),
    ``unsupported_video`` (container or codec), ``video_too_large`` (bytes, pixels per frame),
    ``video_too_long`` (seconds, frames), ``video_timeout``."""


# ------------------------------------------------------------------------------------------- header


@dataclass(frozen=True)
class VideoHeader:
    """What the container declares, read before any packet."""

    container: str  # FFmpeg demuxer name: "mov", "matroska", "avi"
    codec: str  # FFmpeg codec name, e.g. "h264", "av1" (not the decoder's: libdav1d decodes AV1)
    width: int
    height: int
    # The frame rate the container states (MP4 stts, Matroska DefaultDuration, AVI strh); None where
    # it states none (Matroska may not): the packet index measures it then (VideoIndex.fps).
    fps: float | None
    # the stream's stated duration, else the container's, else frames / fps; None: none
    duration_s: float | None
    # declared by the container, else round(duration_s * fps) where both are stated, else None
    num_frames: int | None
    # True: the container states its frame count (MP4, AVI); only then is it checked
    frames_declared: bool
    num_bytes: int
    stream_index: int  # FFmpeg's index of the video stream read (the container's first)
    num_streams: int  # streams in the container, of every kind


@dataclass(frozen=True)
class VideoIndex:
    """The video stream's packets, demuxed but not decoded: the clip's frames on its presentation
    timeline, in stream time base. Frame ``i`` of the clip (what a plan's ``frame_indices`` count)
    is the frame shown at ``pts[i]``."""

    pts: tuple[int, ...]  # every frame's presentation stamp, ascending
    key_pts: tuple[int, ...]  # the key frames' stamps, ascending: where a decode may start
    time_base: float  # seconds per pts unit
    # the clip's frame rate: the container's stated one, else (frames - 1) over the span of their
    # stamps, in (0, 1000]
    fps: float
    # True where the packets' stamps never decrease in file order. They may then be decode-order
    # stamps (AVI stores no presentation times; nor does Matroska in VfW mode), which differ from
    # the shown order where the decoder reorders frames: decode_video then places frames by their
    # count, not their stamps.
    stamps_in_file_order: bool = False
    # seconds of the video's one deadline (--video-decode-timeout) spent up to the end of the packet
    # pass; a decode started later gets what is left
    deadline_used_s: float = 0.0

    @property
    def num_frames(self) -> int:
        return len(self.pts)

    def seconds(self, i: int) -> float:
        """Frame ``i``'s presentation time from the clip's first frame."""
        return (self.pts[i] - self.pts[0]) * self.time_base


@dataclass(frozen=True)
class FFmpegProbe:
    """What av.open passes FFmpeg: ``options`` for the container and every stream's probe decoder,
    ``stream_options`` by stream index, over ``options``."""

    options: dict[str, str]
    stream_options: tuple[dict[str, str], ...] = ()


def header_probe(limits: VideoConfig) -> FFmpegProbe:
    """For reading the header and packets: the probe reads one packet and decodes nothing it may
    skip (H.264, HEVC, AV1, MPEG-2 and MJPEG decode nothing; MPEG-4 Part 2 and VP9 decoders ignore
    skip_frame and may decode that one packet). No max_pixels here: where a decoder refuses a size
    over it, FFmpeg reports the stream's size as 0x0, and the header check would no longer name the
    size it refuses."""
    return FFmpegProbe(
        {**_probe_bounds(limits), "probesize": str(HEADER_PROBE_BYTES), "skip_frame": "all"}
    )


def decode_probe(limits: VideoConfig, header: VideoHeader) -> FFmpegProbe:
    """For decoding (a header that passed the checks): FFmpeg's usual probe on the video stream
    alone (its first frames tell the decoder how far frames are reordered, which it would otherwise
    learn by dropping frames), no frame over the pixel limit whatever size the bitstream claims; no
    other stream's decoder opens."""
    # no decoder is named "none": avcodec_open2 refuses them all
    closed = {"codec_whitelist": "none"}
    return FFmpegProbe(
        {
            **_probe_bounds(limits),
            "probesize": str(DECODE_PROBE_BYTES),
            "analyzeduration": str(DECODE_PROBE_US),
            "max_pixels": str(limits.max_video_pixels),
        },
        tuple({} if i == header.stream_index else closed for i in range(header.num_streams)),
    )


def _probe_bounds(limits: VideoConfig) -> dict[str, str]:
    # max_streams: FFmpeg's own stream cap, for a structure count_streams could not read
    return {"max_streams": str(limits.max_video_streams), "threads": "1"}


class PyAVBackend:
    """Opens containers from bytes with PyAV; counts what it does (the seam tests use: pass a fresh
    instance and read its counters). One decoder thread by default: the server's preprocessing pool
    is what runs videos in parallel. ``clock``: monotonic seconds, read at every packet and every
    decoded frame against the video's deadline."""

    def __init__(self, threads: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.threads = threads
        self.clock = clock
        self.opened = 0  # containers opened
        self.seeks = 0  # container seeks by a decode
        self.packets_demuxed = 0
        self.frames_decoded = 0  # frames out of the decoder, sampled or not
        self.frames_converted = 0  # frames converted to RGB (the sampled ones)
        self.held = 0  # full-size RGB frames alive now
        self.max_held = 0  # ... at most, over this backend's life

    def open(self, data: bytes, container: str, probe: FFmpegProbe) -> InputContainer:
        import av

        self.opened += 1
        return av.open(io.BytesIO(data), mode="r", format=container, metadata_errors="ignore",
                       options=probe.options, stream_options=list(probe.stream_options))

    def _hold(self, n: int) -> None:
        self.held += n
        self.max_held = max(self.max_held, self.held)


def _backend(backend: PyAVBackend | None) -> PyAVBackend:
    return backend if backend is not None else PyAVBackend()


def _av_errors() -> tuple[type[BaseException], ...]:
    import av

    # FFmpeg's errors (PyAV's FFmpegError subclasses ValueError and OSError), an allocation FFmpeg
    # could not make. Not TypeError/KeyError/...: those would be our bugs, and must not read as "the
    # client's video is corrupt".
    return (av.FFmpegError, ValueError, OSError, EOFError, MemoryError)


def probe_video(
    data: bytes, limits: VideoConfig, backend: PyAVBackend | None = None
) -> VideoHeader:
    """The container's header, checked against ``limits``; no packet is read past FFmpeg's
    one-packet probe, nothing decoded that the probe may skip (``header_probe``)."""
    with _header(data, limits, _backend(backend)) as (_, header):
        return header


def read_video(
    data: bytes,
    limits: VideoConfig,
    backend: PyAVBackend | None = None,
    deadline: float | None = None,
) -> tuple[VideoHeader, VideoIndex]:
    """The header, checked, then the packet index, from one open of the container: nothing decoded.
    The video's deadline starts here unless given."""
    be = _backend(backend)
    deadline = deadline if deadline is not None else be.clock() + limits.video_decode_timeout_s
    with _header(data, limits, be) as (c, header):
        return header, _read_index(c, header, limits, be, deadline)


@contextmanager
def _header(
    data: bytes, limits: VideoConfig, be: PyAVBackend
) -> Iterator[tuple[InputContainer, VideoHeader]]:
    """The open container and its checked header; every check that needs no FFmpeg runs before it
    opens."""
    if not data:
        raise VideoInputError("invalid_video", "video data is empty")
    if len(data) > limits.max_video_bytes:
        raise VideoInputError(
            "video_too_large",
            f"video is {len(data)} bytes; the limit is {limits.max_video_bytes} bytes",
        )
    container = sniff_container(data)
    if container is None:
        raise VideoInputError(
            "invalid_video",
            f"data is not a supported video container ({', '.join(CONTAINERS.values())})",
        )
    num_streams = count_streams(data, container)
    if num_streams is not None and num_streams > limits.max_video_streams:
        raise VideoInputError(
            "unsupported_video",
            f"video container ({CONTAINERS[container]}) holds {num_streams} streams; the limit "
            f"is {limits.max_video_streams}",
        )
    try:
        with be.open(data, container, header_probe(limits)) as c:
            yield c, _read_header(c, container, len(data), limits)
    except VideoInputError:
        raise
    except _av_errors():
        raise VideoInputError(
            "invalid_video",
            f"video container ({CONTAINERS[container]}) is truncated or corrupt: its header cannot "
            "be read",
        ) from None


def _read_header(
    c: InputContainer, container: str, num_bytes: int, limits: VideoConfig
) -> VideoHeader:
    videos = list(c.streams.video)
    if not videos:
        audio = len(c.streams.audio)
        raise VideoInputError(
            "invalid_video",
            f"the container holds no video stream ({audio} audio stream{'s' * (audio != 1)})",
        )
    s = videos[0]
    ctx = s.codec_context
    # The codec's name, not its decoder's (AV1 decodes with libdav1d in the PyPI wheels).
    codec = (
        (getattr(ctx.codec, "canonical_name", None) or ctx.name)
        if ctx is not None and ctx.codec
        else ""
    )
    if codec not in ALLOWED_CODECS:
        raise VideoInputError(
            "unsupported_video", f"video codec {codec or 'unknown'!r} is not supported; supported: "
            f"{', '.join(ALLOWED_CODECS)}"
        )
    width, height = int(s.codec_context.width or 0), int(s.codec_context.height or 0)
    if width <= 0 or height <= 0:
        raise VideoInputError("invalid_video", "video declares no frame size")
    if width * height > limits.max_video_pixels:
        raise VideoInputError(
            "video_too_large",
            f"video declares {width}x{height} = {width * height} pixels per frame; the limit is "
            f"{limits.max_video_pixels}",
        )
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise VideoInputError(
            "video_aspect_ratio", f"video is {width}x{height}, aspect ratio {ratio:.1f}:1; at most "
            f"{MAX_ASPECT_RATIO}:1 is accepted"
        )
    # avg_frame_rate is the demuxer's, set where the container states a rate; the one-packet probe
    # adds no estimate (its r_frame_rate, guessed from one packet, is a codec tick rate or the time
    # base, not the frame rate).
    fps = float(s.average_rate) if s.average_rate else None
    if fps is not None and not 0 < fps <= MAX_DECLARED_FPS:
        raise VideoInputError(
            "invalid_video",
            f"video declares a frame rate of {fps:g} fps; expected (0, {MAX_DECLARED_FPS:g}]",
        )
    duration: float | None = None
    if s.duration is not None and s.time_base is not None and s.duration > 0:
        duration = float(s.duration * s.time_base)
    elif c.duration is not None and c.duration > 0:
        duration = c.duration / 1_000_000  # AV_TIME_BASE
    declared = int(s.frames or 0)
    if declared and fps and duration is None:
        duration = declared / fps
    frames = declared or (round(duration * fps) if fps and duration else None)
    if duration is not None and duration > limits.video_max_seconds:
        raise VideoInputError(
            "video_too_long",
            f"video declares {duration:.1f} s; the limit is {limits.video_max_seconds:g} s",
        )
    if declared > limits.max_video_source_frames:
        raise VideoInputError(
            "video_too_long",
            f"video declares {declared} frames; the limit is {limits.max_video_source_frames}",
        )
    return VideoHeader(
        container,
        codec,
        width,
        height,
        fps,
        duration,
        frames,
        declared > 0,
        num_bytes,
        s.index,
        len(c.streams),
    )


def _stated_frames(header: VideoHeader) -> str:
    """The header's frame count as a refusal naming what the packets hold quotes it."""
    return "no frame count" if header.num_frames is None else str(header.num_frames)


def _stated_seconds(header: VideoHeader) -> str:
    return "no duration" if header.duration_s is None else f"{header.duration_s:.1f} s"


def _read_index(
    c: InputContainer, header: VideoHeader, limits: VideoConfig, be: PyAVBackend, deadline: float,
) -> VideoIndex:
    """Demux the video stream's packets (no decoding) up to the limits: every shown frame's pts and
    the key frames, and the clip's frame rate where the header states none. Frames an MP4 edit list
    hides (the pre-roll before a cut made without re-encoding, which FFmpeg flags discard and its
    decoder drops) are no frames of the clip: they are counted against the limits, never planned."""
    max_frames = limits.max_video_source_frames
    s = c.streams[header.stream_index]
    tb = float(s.time_base)
    max_pts = int(s.start_time or 0) + limits.video_max_seconds / tb
    pts: list[int] = []  # the shown frames'
    # hidden ones included: a decode may have to start before the first shown frame
    keys: list[int] = []
    num_packets = 0
    in_file_order = True  # no stamp so far below the one before it
    try:
        for packet in c.demux(s):
            if packet.size == 0:  # the end-of-stream marker PyAV yields per stream
                continue
            be.packets_demuxed += 1
            num_packets += 1
            p = packet.pts if packet.pts is not None else packet.dts
            if p is None:
                continue
            if not packet.is_discard:
                in_file_order = in_file_order and (not pts or p >= pts[-1])
                pts.append(int(p))
            if packet.is_keyframe:
                keys.append(int(p))
            if num_packets > max_frames:
                raise VideoInputError(
                    "video_too_long",
                    f"video holds more than {max_frames} frames (its header declares "
                    f"{_stated_frames(header)}); the limit is {max_frames}",
                )
            if p > max_pts:
                raise VideoInputError(
                    "video_too_long",
                    f"video runs past {limits.video_max_seconds:g} s (its header declares "
                    f"{_stated_seconds(header)}); the limit is {limits.video_max_seconds:g} s",
                )
            if be.clock() > deadline:
                raise _timeout(limits)
    except VideoInputError:
        raise
    except _av_errors():
        raise VideoInputError(
            "invalid_video", "video data is truncated or corrupt (its packets cannot be read)"
        ) from None
    used_s = limits.video_decode_timeout_s - (deadline - be.clock())
    if not pts:
        raise VideoInputError("invalid_video", f"video holds 0 frames (its header declares "
                                               f"{_stated_frames(header)})")
    # an MP4 declares its hidden frames too
    if header.frames_declared and num_packets < (header.num_frames or 0):
        raise VideoInputError(
            "invalid_video", f"video is truncated: its header declares {header.num_frames} frames, "
            f"{num_packets} are present"
        )
    pts.sort()
    keys.sort()
    # a stream whose first packet is not flagged key: decode from the start
    if not keys or keys[0] > pts[0]:
        keys.insert(0, pts[0])
    fps = header.fps if header.fps is not None else _rate_from_stamps(pts, tb)
    return VideoIndex(tuple(pts), tuple(keys), tb, fps, in_file_order, used_s)


def _rate_from_stamps(pts: list[int], time_base: float) -> float:
    """Frames per second of a clip whose container states no rate: its shown frames' intervals
    (count - 1) over the span from the first stamp to the last (``pts`` ascending)."""
    if len(pts) < FRAME_FACTOR:
        raise VideoInputError(
            "invalid_video", f"video holds {len(pts)} frame; at least {FRAME_FACTOR} are needed"
        )
    span_s = (pts[-1] - pts[0]) * time_base
    if span_s <= 0 or (len(pts) - 1) / span_s > MAX_DECLARED_FPS:
        raise VideoInputError(
            "invalid_video",
            f"video states no frame rate and its {len(pts)} frames span {span_s:g} s; at most "
            f"{MAX_DECLARED_FPS:g} frames per second are accepted",
        )
    return (len(pts) - 1) / span_s


def _timeout(limits: VideoConfig) -> VideoInputError:
    return VideoInputError(
        "video_timeout", f"reading the video took longer than {limits.video_decode_timeout_s:g} s"
    )


# --------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class VideoAsk:
    """What a request's video part may ask for: less than the server's defaults, never more (None:
    the default)."""

    fps: float | None = None
    max_frames: int | None = None
    max_visual_tokens: int | None = None


@dataclass(frozen=True)
class VideoPlan:
    """What one video will cost, known before any frame is decoded; ``decode_video`` produces
    exactly it."""

    source_frames: int  # frames the video holds (its packets; a frame list's length)
    source_fps: float
    frame_indices: tuple[int, ...]  # presentation-order indices of the sampled frames
    original_size: tuple[int, int]  # (width, height)
    resized_size: tuple[int, int]  # (width, height), multiples of patch * merge
    grid_thw: tuple[int, int, int]  # (temporal grids, height, width) in patches
    num_tokens: int  # LM tokens: grids x (h / merge) x (w / merge)
    budget_tokens: int
    min_pixels: int  # per frame: smart_resize with these reproduces resized_size
    max_pixels: int
    sample_fps: float  # Qwen's: num_frames / source_frames * source_fps
    temporal_patch_size: int

    @property
    def num_frames(self) -> int:
        return len(self.frame_indices)

    @property
    def timestamps_s(self) -> tuple[float, ...]:
        """Each sampled frame's time, index / fps, as transformers' Qwen3-VL processor computes
        it."""
        return tuple(i / self.source_fps for i in self.frame_indices)

    @property
    def seconds_per_grid(self) -> float:
        """Qwen2.5-VL's ``second_per_grid_ts``: temporal_patch_size / sample_fps."""
        return self.temporal_patch_size / self.sample_fps

    def grid_timestamps(self) -> list[float]:
        """Qwen3-VL's per-grid times (transformers' ``_calculate_timestamps``): the mean of each
        grid's first and last frame time."""
        ts = list(self.timestamps_s)
        m = self.temporal_patch_size
        if len(ts) % m:
            ts.extend(ts[-1] for _ in range(m - len(ts) % m))
        return [(ts[i] + ts[i + m - 1]) / 2 for i in range(0, len(ts), m)]


def _round_by(x: float, k: int) -> int:
    return round(x / k) * k


def _ceil_by(x: float, k: int) -> int:
    return math.ceil(x / k) * k


def _floor_by(x: float, k: int) -> int:
    return math.floor(x / k) * k


def smart_nframes(total_frames: int, video_fps: float, fps: float, min_frames: int = FPS_MIN_FRAMES,
                  max_frames: int | None = None) -> int:
    """qwen-vl-utils 0.0.14's ``smart_nframes`` for an ``fps`` request: total / video_fps * fps
    frames, clamped to [min_frames, max_frames] and to the frames there are, floored to an even
    count. Raises VideoInputError where Qwen's raises ValueError (fewer than 2 frames)."""
    lo = _ceil_by(min_frames, FRAME_FACTOR)
    hi = _floor_by(max_frames if max_frames is not None else min(768, total_frames), FRAME_FACTOR)
    n = total_frames / video_fps * fps
    n = min(min(max(n, lo), hi), total_frames)
    n = _floor_by(n, FRAME_FACTOR)
    if not FRAME_FACTOR <= n <= total_frames:
        raise VideoInputError(
            "invalid_video",
            f"video holds {total_frames} frame{'s' * (total_frames != 1)}; at least "
            f"{FRAME_FACTOR} are needed",
        )
    return n


def frame_indices(total_frames: int, nframes: int, start: int = 0) -> list[int]:
    """Qwen's ``torch.linspace(start, start + total - 1, nframes).round().long()`` (float32, half to
    even)."""
    return torch.linspace(start, start + total_frames - 1, nframes).round().long().tolist()


def check_ask(limits: VideoConfig, ask: VideoAsk, param: str) -> None:
    """A request may ask for less than the server's defaults, never more: BudgetError naming the
    field otherwise."""
    from firsttoken.inputs.budget import BudgetError

    if ask.fps is not None and not 0 < ask.fps <= limits.video_fps:
        raise BudgetError(f"{param}.fps={ask.fps:g} must be > 0 and at most this server's {limits.video_fps:g} fps",
                          f"{param}.fps")
    if ask.max_frames is not None and not FRAME_FACTOR <= ask.max_frames <= limits.video_max_frames:
        raise BudgetError(
            f"{param}.max_frames={ask.max_frames} must be from {FRAME_FACTOR} to this server's cap "
            f"of {limits.video_max_frames}",
            f"{param}.max_frames",
        )
    if ask.max_visual_tokens is not None and not (
        limits.video_min_frame_tokens <= ask.max_visual_tokens <= limits.video_max_tokens
    ):
        raise BudgetError(
            f"{param}.max_visual_tokens={ask.max_visual_tokens} must be from {limits.video_min_frame_tokens} (one "
            f"two-frame grid at its smallest) to this server's cap of {limits.video_max_tokens} visual tokens per "
            "video",
            f"{param}.max_visual_tokens",
        )


def plan_video(
    num_frames: int,
    fps: float,
    width: int,
    height: int,
    limits: VideoConfig,
    proc: ImageProcessorConfig,
    ask: VideoAsk = VideoAsk(),
    param: str = "video_url",
) -> VideoPlan:
    """The sampled frames and their size for a video of ``num_frames`` frames at ``fps`` (from
    ``read_video``).

    Frames: Qwen's ``smart_nframes`` at the asked (or server's) fps, min 4, max the asked (or
    server's) max_frames. Size: Qwen's fetch_video rule with ``total_pixels`` = the token budget:
    per-frame max_pixels = max(min(max_frame_tokens, budget * 2 / frames) cells, 1.05 x min_pixels),
    smart_resize. Where that would break the budget (the 1.05 floor, or frames that cannot fit at
    the per-frame minimum), frames drop to what fits at the minimum and the size is the largest
    within the per-grid share (``max_pixels_within_tokens``)."""
    check_ask(limits, ask, param)
    budget = limits.video_max_tokens if ask.max_visual_tokens is None else ask.max_visual_tokens
    want_fps = limits.video_fps if ask.fps is None else ask.fps
    max_frames = limits.video_max_frames if ask.max_frames is None else ask.max_frames
    nframes = smart_nframes(num_frames, fps, want_fps, FPS_MIN_FRAMES, min(max_frames, num_frames))
    return _plan(
        num_frames,
        fps,
        width,
        height,
        nframes,
        frame_indices(num_frames, nframes),
        budget,
        limits,
        proc,
    )


def _plan(
    num_frames: int,
    fps: float,
    width: int,
    height: int,
    nframes: int,
    indices: list[int],
    budget: int,
    limits: VideoConfig,
    proc: ImageProcessorConfig,
    fit_by_resampling: bool = True,
    list_fps: float | None = None,
) -> VideoPlan:
    if width <= 0 or height <= 0:
        raise VideoInputError("invalid_video", f"video has an empty frame size ({width}x{height})")
    t, factor = proc.temporal_patch_size, proc.pixels_per_token
    min_tok, max_tok = limits.video_min_frame_tokens, limits.video_max_frame_tokens
    min_pixels = min_tok * factor * factor
    max_grids = budget // min_tok
    if math.ceil(nframes / t) > max_grids:  # not even the per-frame minimum fits: fewer frames
        nframes = max_grids * t
        if fit_by_resampling:
            indices = frame_indices(num_frames, nframes)
        else:
            indices = [indices[i] for i in frame_indices(len(indices), nframes)]
    grids = math.ceil(nframes / t)
    # Qwen's rule first: identical to fetch_video(total_pixels = budget cells) wherever it keeps the
    # budget.
    total_pixels = budget * factor * factor
    max_pixels = max(
        min(max_tok * factor * factor, total_pixels / nframes * FRAME_FACTOR),
        int(min_pixels * 1.05),
    )
    rh, rw = smart_resize(height, width, factor, min_pixels, max_pixels)
    per_grid = num_visual_tokens(rh, rw, proc.patch_size, proc.merge_size)
    if per_grid * grids > budget or per_grid > max_tok:
        share = min(max_tok, budget // grids)
        try:
            max_pixels = max_pixels_within_tokens(
                height, width, share, min_pixels, proc.patch_size, proc.merge_size
            )
        except ImageInputError:
            raise VideoInputError(
                "video_too_large",
                f"video frames of {width}x{height} need more than {share} visual tokens per "
                f"two-frame grid even at their smallest; the budget is {budget} for {grids} grids",
            ) from None
        rh, rw = smart_resize(height, width, factor, min_pixels, max_pixels)
        per_grid = num_visual_tokens(rh, rw, proc.patch_size, proc.merge_size)
    num_tokens = per_grid * grids
    if num_tokens > budget:  # the search above guarantees this; a bug if it fires
        raise RuntimeError(f"planned {num_tokens} video tokens for a {budget}-token budget")
    # Qwen's: the rate the sampled frames stand for; a frame list is its own samples (qwen-vl-utils'
    # sample_fps).
    sample_fps = list_fps if list_fps is not None else nframes / max(num_frames, 1e-6) * fps
    return VideoPlan(
        source_frames=num_frames,
        source_fps=fps,
        frame_indices=tuple(indices),
        original_size=(width, height),
        resized_size=(rw, rh),
        grid_thw=(grids, rh // proc.patch_size, rw // proc.patch_size),
        num_tokens=num_tokens,
        budget_tokens=budget,
        min_pixels=min_pixels,
        max_pixels=int(max_pixels),
        sample_fps=sample_fps,
        temporal_patch_size=t,
    )


# ------------------------------------------------------------------------------------------- decode


@dataclass
class DecodedVideo:
    """The sampled frames, RGB uint8 [num_frames, height, width, 3] at the plan's resized size (or
    as decoded with ``resize=False``), with their presentation times in seconds from the clip's
    first frame."""

    frames: np.ndarray
    plan: VideoPlan
    pts_s: list[float] = field(default_factory=list)


def decode_video(
    data: bytes, header: VideoHeader, index: VideoIndex, plan: VideoPlan, limits: VideoConfig,
    backend: PyAVBackend | None = None, deadline: float | None = None, resize: bool = True,
) -> DecodedVideo:
    """Decode only the plan's frames: for each, the frame shown at its place on the index's
    timeline. Where the stamps give that place, per sampled frame: seek to the latest key frame at
    or before it unless the decoder already stands between that key frame and it, then decode
    forward to it. Where they cannot (stamps in file order, ``VideoIndex.stamps_in_file_order``, on
    a stream the decoder reorders: B-frames in AVI), one forward pass from the first frame, placing
    frames by their count (a seek would lose it), and the count must come out equal to the packets'
    (else the video is refused). Each sampled frame is converted and resized alone: at most one
    full-size RGB frame is alive at a time (``backend.max_held``). The deadline is the video's one:
    what the packet pass left of it, unless given."""
    be = _backend(backend)
    if deadline is None:
        deadline = be.clock() + limits.video_decode_timeout_s - index.deadline_used_s
    rw, rh = plan.resized_size
    shape = (rh, rw) if resize else (header.height, header.width)
    out = np.empty((plan.num_frames, *shape, 3), dtype=np.uint8)
    pts_s: list[float] = []
    try:
        with be.open(data, header.container, decode_probe(limits, header)) as c:
            s = c.streams[header.stream_index]
            if be.threads > 1:
                s.thread_type = "AUTO"
            s.codec_context.thread_count = be.threads
            s.codec_context.options = {
                **s.codec_context.options,
                "max_pixels": str(limits.max_video_pixels),
            }
            # the decode probe has run the decoder on the first frames: it knows whether it reorders
            # them
            by_count = index.stamps_in_file_order and bool(s.codec_context.has_b_frames)
            # timeline place of the frame the decoder last gave (-1: none since the decode
            # (re)started)
            pos = -1
            frames: Iterator[tuple[int, VideoFrame]] = iter(())
            for k, i in enumerate(plan.frame_indices):
                # the same frame again (a padded plan): copy it
                if k and i == plan.frame_indices[k - 1]:
                    out[k] = out[k - 1]
                    pts_s.append(pts_s[-1])
                    continue
                if by_count:
                    if k == 0:
                        frames = _shown(c.decode(s), index, header, limits, be, deadline, by_count)
                else:
                    target = index.pts[i]
                    key = index.key_pts[max(0, bisect.bisect_right(index.key_pts, target) - 1)]
                    # seeking skips work (or the decoder is past it)
                    if pos < 0 or not key <= index.pts[pos] < target:
                        c.seek(key, stream=s, backward=True, any_frame=False)
                        be.seeks += 1
                        frames = _shown(c.decode(s), index, header, limits, be, deadline, by_count)
                        pos = -1
                for pos, frame in frames:
                    if pos >= i:
                        out[k] = _convert(be, frame, shape, resize)
                        pts_s.append(index.seconds(pos))
                        break
                else:
                    if by_count:
                        raise _miscounted(pos + 1, index)
                    raise VideoInputError(
                        "invalid_video",
                        f"video is truncated or corrupt: frame {i} of {plan.source_frames} cannot "
                        "be decoded",
                    )
            # every frame placed by its count: the decoder must give one per packet, no more
            if by_count:
                num_decoded = pos + 1 + sum(1 for _ in frames)
                if num_decoded != index.num_frames:
                    raise _miscounted(num_decoded, index)
    except VideoInputError:
        raise
    except _av_errors():
        raise VideoInputError(
            "invalid_video", "video data is truncated or corrupt (a frame cannot be decoded)"
        ) from None
    return DecodedVideo(out, plan, pts_s)


def _miscounted(num_decoded: int, index: VideoIndex) -> VideoInputError:
    return VideoInputError(
        "invalid_video",
        f"video's decoder gave {num_decoded} frames for its {index.num_frames} packets; its frames "
        "carry no presentation times to place them by",
    )


def _shown(
    decoded: Iterator[VideoFrame],
    index: VideoIndex,
    header: VideoHeader,
    limits: VideoConfig,
    be: PyAVBackend,
    deadline: float,
    by_count: bool,
) -> Iterator[tuple[int, VideoFrame]]:
    """The decoder's frames (which it gives in presentation order) with their place on the index's
    timeline: by stamp, or ``by_count`` from the first frame. Checks the deadline and the frame size
    at every frame decoded."""
    count = 0
    for frame in decoded:
        be.frames_decoded += 1
        if be.clock() > deadline:
            raise _timeout(limits)
        if frame.width != header.width or frame.height != header.height:
            raise VideoInputError(
                "invalid_video", f"a frame decoded at {frame.width}x{frame.height}, not the "
                f"{header.width}x{header.height} the header declares"
            )
        if by_count:
            count += 1
            yield count - 1, frame
        # (before it: hidden by an edit list)
        elif frame.pts is not None and frame.pts >= index.pts[0]:
            yield bisect.bisect_left(index.pts, int(frame.pts)), frame


def _convert(be: PyAVBackend, frame, shape: tuple[int, int], resize: bool) -> np.ndarray:
    """One decoded frame to RGB uint8 at ``shape`` (h, w), resized as transformers' video processors
    do (``resize_frame``: torchvision's antialiased bicubic on uint8)."""
    rgb = frame.to_ndarray(format="rgb24")
    be.frames_converted += 1
    be._hold(1)
    try:
        if not resize or rgb.shape[:2] == shape:
            return rgb
        return resize_frame(rgb, shape)
    finally:
        del rgb
        be._hold(-1)


@dataclass(frozen=True)
class LoadedVideo:
    header: VideoHeader
    index: VideoIndex
    plan: VideoPlan
    video: DecodedVideo


def plan_video_bytes(
    data: bytes, limits: VideoConfig, proc: ImageProcessorConfig, ask: VideoAsk = VideoAsk(),
    backend: PyAVBackend | None = None, param: str = "video_url", deadline: float | None = None,
) -> tuple[VideoHeader, VideoIndex, VideoPlan]:
    """Header, packet index and plan, nothing decoded: the video's exact token count (for /tokenize,
    admission). The video's deadline starts here (unless given): ``index.deadline_used_s`` carries
    what was spent to the decode."""
    be = _backend(backend)
    check_ask(limits, ask, param)
    deadline = deadline if deadline is not None else be.clock() + limits.video_decode_timeout_s
    header, index = read_video(data, limits, be, deadline)
    plan = plan_video(
        index.num_frames, index.fps, header.width, header.height, limits, proc, ask, param
    )
    return header, index, plan


def load_video(
    data: bytes, limits: VideoConfig, proc: ImageProcessorConfig, ask: VideoAsk = VideoAsk(),
    backend: PyAVBackend | None = None, param: str = "video_url", resize: bool = True,
) -> LoadedVideo:
    """Probe, index, plan, decode: everything a video part needs, under one deadline."""
    be = _backend(backend)
    header, index, plan = plan_video_bytes(data, limits, proc, ask, be, param)
    return LoadedVideo(
        header, index, plan, decode_video(data, header, index, plan, limits, be, resize=resize)
    )


# -------------------------------------------------------------------------------------- frame lists


def plan_frame_list(
    frames: Sequence[bytes],
    limits: VideoConfig,
    proc: ImageProcessorConfig,
    ask: VideoAsk = VideoAsk(),
    max_image_pixels: int | None = None,
    param: str = "video_url",
) -> VideoPlan:
    """A video given as a list of encoded images (vLLM's and qwen-vl-utils' list form). Every
    image's header is read (none decoded); all must share one size. Like qwen-vl-utils, an odd count
    is padded with the last frame and the list's fps is the asked one (default 2). Over the frame
    cap, or over what the token cap allows at the per-frame minimum, frames are sampled evenly
    (linspace) from the list."""
    check_ask(limits, ask, param)
    if not frames:
        raise VideoInputError(
            "invalid_video", "a video given as frames needs at least one frame; got 0"
        )
    pixel_cap = (
        limits.max_video_pixels
        if max_image_pixels is None
        else min(limits.max_video_pixels, max_image_pixels)
    )
    # Refuse absurd lists before reading any header: more than the container limit is never planned.
    if len(frames) > limits.max_video_source_frames:
        raise VideoInputError(
            "video_too_long",
            f"video is {len(frames)} frames; the limit is {limits.max_video_source_frames}",
        )
    sizes = []
    for k, data in enumerate(frames):
        try:
            h = probe_image(data, pixel_cap)
        except ImageInputError as err:
            raise VideoInputError(err.code, f"frame {k + 1} of {len(frames)}: {err}") from None
        sizes.append((h.width, h.height))
        if sizes[-1] != sizes[0]:
            raise VideoInputError(
                "invalid_video",
                f"frame {k + 1} of {len(frames)} is {h.width}x{h.height}, frame 1 is "
                f"{sizes[0][0]}x{sizes[0][1]}; all frames of a video must have one size",
            )
    budget = limits.video_max_tokens if ask.max_visual_tokens is None else ask.max_visual_tokens
    fps = limits.video_fps if ask.fps is None else ask.fps
    max_frames = limits.video_max_frames if ask.max_frames is None else ask.max_frames
    n = len(frames)
    nframes = _ceil_by(n, FRAME_FACTOR)
    if nframes <= _floor_by(max_frames, FRAME_FACTOR):
        indices = list(range(n)) + [n - 1] * (nframes - n)  # qwen-vl-utils pads with the last frame
    else:
        nframes = _floor_by(max_frames, FRAME_FACTOR)
        indices = frame_indices(n, nframes)
    width, height = sizes[0]
    return _plan(
        n,
        fps,
        width,
        height,
        nframes,
        indices,
        budget,
        limits,
        proc,
        fit_by_resampling=False,
        list_fps=fps,
    )


def decode_frame_list(
    frames: Sequence[bytes],
    plan: VideoPlan,
    limits: VideoConfig,
    max_image_pixels: int | None = None,
    resize: bool = True,
) -> DecodedVideo:
    """Decode only the plan's frames of a list (each once), resized to the plan's size."""
    pixel_cap = (
        limits.max_video_pixels
        if max_image_pixels is None
        else min(limits.max_video_pixels, max_image_pixels)
    )
    rw, rh = plan.resized_size
    w0, h0 = plan.original_size
    shape = (rh, rw) if resize else (h0, w0)
    out = np.empty((plan.num_frames, *shape, 3), dtype=np.uint8)
    deadline = time.monotonic() + limits.video_decode_timeout_s
    last: tuple[int, np.ndarray] | None = None
    for k, i in enumerate(plan.frame_indices):
        if last is not None and last[0] == i:
            out[k] = last[1]
            continue
        if time.monotonic() > deadline:
            raise _timeout(limits)
        try:
            image = decode_image(frames[i], pixel_cap)
        except ImageInputError as err:
            raise VideoInputError(err.code, f"frame {i + 1} of {len(frames)}: {err}") from None
        if image.size != (w0, h0):
            raise VideoInputError(
                "invalid_video",
                f"frame {i + 1} decoded at {image.size[0]}x{image.size[1]}, not "
                f"the {w0}x{h0} its header declares",
            )
        rgb = np.asarray(image)  # [h0, w0, 3] uint8
        out[k] = resize_frame(rgb, shape) if resize else rgb
        last = (i, out[k])
    return DecodedVideo(out, plan, [i / plan.source_fps for i in plan.frame_indices])

