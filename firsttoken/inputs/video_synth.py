"""Synthetic video clips made locally with PyAV: for tests, the decoder benchmark and (later)
`firsttoken bench`'s video workload. Nothing is downloaded.

Each frame is drawn straight in YUV 4:2:0 (no RGB conversion per frame, so a 60 s 1080p clip is
cheap to make): a luma ramp that moves with the frame index and a chroma value that encodes it, so a
decoded frame can be told apart from its neighbours (``frame_marker``)."""

from __future__ import annotations

import io
import tempfile
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

# Encoders tried in order for ``codec="auto"``: h264 when the PyAV wheel carries libx264 (the PyPI
# wheels do).
_AUTO_CODECS = ("libx264", "mpeg4", "libvpx-vp9")


def pick_codec(codec: str = "auto") -> str:
    if codec != "auto":
        return codec
    for name in _AUTO_CODECS:
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:  # av raises UnknownCodecError (a ValueError) or FFmpegError subclasses
            continue
    raise RuntimeError("this PyAV build has none of the encoders " + ", ".join(_AUTO_CODECS))


def frame_marker(index: int) -> int:
    """The U-plane value frame ``index`` is drawn with (its identity, readable after a lossy encode
    within ~4)."""
    return (index * 37) % 200 + 28


def make_clip(
    seconds: float,
    width: int,
    height: int,
    fps: int = 30,
    codec: str = "auto",
    container: str = "mp4",
    gop: int | None = None,
    audio: bool = False,
    video: bool = True,
    options: dict[str, str] | None = None,
    num_frames: int | None = None,
    flat: bool = False,
    bframes: int | None = None,
) -> bytes:
    """An encoded clip of round(seconds * fps) frames. ``gop``: frames between key frames (None: the
    encoder's default, 250 for libx264). ``video=False`` with ``audio=True`` makes an audio-only
    container. ``options``: the muxer's (``{"movflags": "faststart"}`` puts an MP4's index before
    its frames). ``num_frames``: video frames to draw instead of seconds x fps (0 with
    ``audio=True``: a video stream that holds no frame). ``flat``: every frame one grey (huge frames
    in a tiny file: a decompression bomb). ``bframes``: frames the encoder may code out of display
    order between two references (None: the encoder's default; libx264's ultrafast preset uses none;
    for libvpx, VP9 or VP8, any value > 0 turns on hidden alt-ref frames, their counterpart)."""
    if video and (width % 2 or height % 2):
        raise ValueError("make_clip draws yuv420p frames: give an even width and height")
    n = round(seconds * fps) if num_frames is None else num_frames
    if options and "faststart" in options.get("movflags", ""):
        # FFmpeg's faststart rewrites the file by name in a second pass: it cannot write to memory.
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"clip.{container}"
            _write(
                str(path),
                n,
                width,
                height,
                fps,
                codec,
                container,
                gop,
                audio,
                video,
                options,
                seconds,
                flat,
                bframes,
            )
            return path.read_bytes()
    out = io.BytesIO()
    _write(
        out,
        n,
        width,
        height,
        fps,
        codec,
        container,
        gop,
        audio,
        video,
        options or {},
        seconds,
        flat,
        bframes,
    )
    return out.getvalue()


def _write(
    out: object,
    n: int,
    width: int,
    height: int,
    fps: int,
    codec: str,
    container: str,
    gop: int | None,
    audio: bool,
    video: bool,
    options: dict[str, str],
    seconds: float,
    flat: bool,
    bframes: int | None,
) -> None:
    with av.open(out, "w", format=container, options=options) as c:
        vs = None
        if video:
            vs = c.add_stream(pick_codec(codec), rate=fps)
            vs.width, vs.height, vs.pix_fmt = width, height, "yuv420p"
            if gop is not None:
                vs.codec_context.gop_size = gop
            if vs.codec_context.name == "libx264":
                vs.options = {"preset": "ultrafast"}
            elif vs.codec_context.name == "libx265":
                vs.options = {"preset": "ultrafast", "x265-params": "log-level=error"}
            if bframes is not None:
                if vs.codec_context.name.startswith("libvpx"):
                    vs.options = {
                        "auto-alt-ref": "1" if bframes else "0",
                        "lag-in-frames": str(4 * bframes),
                    }
                else:
                    vs.codec_context.max_b_frames = bframes
        aus = None
        if audio:
            aus = c.add_stream("aac", rate=16000)
            aus.layout = "mono"
        if vs is not None:
            ramp = np.arange(width, dtype=np.int32)[None, :] + np.zeros((height, 1), dtype=np.int32)
            cw, ch = (width + 1) // 2, (height + 1) // 2
            for i in range(n):
                y = (
                    np.full((height, width), 128, np.uint8)
                    if flat
                    else ((ramp + 3 * i) % 220 + 16).astype(np.uint8)
                )
                u = np.full((ch, cw), 128 if flat else frame_marker(i), dtype=np.uint8)
                v = np.full((ch, cw), 128, dtype=np.uint8)
                planes = np.concatenate([y.reshape(-1), u.reshape(-1), v.reshape(-1)])
                frame = av.VideoFrame.from_ndarray(planes.reshape(-1, width), format="yuv420p")
                frame.pts = i
                frame.time_base = Fraction(1, fps)
                for packet in vs.encode(frame):
                    c.mux(packet)
            for packet in vs.encode():
                c.mux(packet)
        if aus is not None:
            samples = round(seconds * 16000)
            step = 1024
            for start in range(0, samples, step):
                k = min(step, samples - start)
                tone = (0.1 * np.sin(np.arange(start, start + k) * 0.05)).astype(np.float32)[
                    None, :
                ]
                af = av.AudioFrame.from_ndarray(tone, format="fltp", layout="mono")
                af.sample_rate = 16000
                af.pts = start
                for packet in aus.encode(af):
                    c.mux(packet)
            for packet in aus.encode():
                c.mux(packet)


def trim_clip(data: bytes, start_s: float) -> bytes:
    """An MP4 cut from ``start_s`` without re-encoding, as
    ``ffmpeg -ss START -i in.mp4 -c copy out.mp4`` cuts it: the packets from the key frame at or
    before ``start_s`` on, their timestamps moved so that ``start_s`` is 0. The frames before it
    (the pre-roll the decoder needs) get negative timestamps, which the MP4 muxer hides behind an
    edit list: a player shows the clip from ``start_s``, a reader that ignores the edit list sees
    them all."""
    out = io.BytesIO()
    with av.open(io.BytesIO(data)) as src, av.open(out, "w", format="mp4") as dst:
        stream = src.streams.video[0]
        shift = round(start_s / stream.time_base)
        cut = dst.add_stream_from_template(stream)
        src.seek(shift, stream=stream, backward=True, any_frame=False)
        for packet in src.demux(stream):
            if packet.size == 0:  # the end-of-stream marker PyAV yields per stream
                continue
            packet.pts -= shift
            packet.dts -= shift
            packet.stream = cut
            dst.mux(packet)
    return out.getvalue()


def write_clip(path: Path, **kwargs: object) -> Path:
    path.write_bytes(make_clip(**kwargs))  # type: ignore[arg-type]
    return path
