"""Synthetic test videos for bench's ``video`` class, deterministic from a seed, made locally
(nothing downloaded).

A clip is one seeded picture (``images.synth_image``: gradients, shapes, text) panning across the
frame, one pixel column step per frame, encoded as MP4 with the encoder ``inputs/video_synth`` picks
(h264 where PyAV has libx264). Every clip of a run is distinct (seeded by session), so no encoder or
prefix cache hits across requests; the same seed gives the same bytes."""

from __future__ import annotations

import base64
import io
from fractions import Fraction

import av
import numpy as np

from firsttoken.inputs.video_synth import pick_codec
from firsttoken.tools.bench.images import synth_image


def synth_clip(seconds: float, width: int, height: int, fps: int, seed: str) -> bytes:
    """An MP4 of round(seconds x fps) frames of width x height pixels (both even: yuv420p)."""
    if width % 2 or height % 2:
        raise ValueError(f"video size must be even in both sides (yuv420p), got {width}x{height}")
    num_frames = max(1, round(seconds * fps))
    pan = max(1, width // 4)  # columns the picture moves over the clip
    picture = np.asarray(synth_image(width + pan, height, seed))  # [H, W + pan, 3] RGB
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream(pick_codec(), rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1  # one encoder thread: the same bytes on every machine
        if stream.codec_context.name == "libx264":
            stream.options = {"preset": "ultrafast"}
        for i in range(num_frames):
            x = i * pan // num_frames
            frame = av.VideoFrame.from_ndarray(
                np.ascontiguousarray(picture[:, x : x + width]), format="rgb24"
            )
            frame = frame.reformat(format="yuv420p")
            frame.pts, frame.time_base = i, Fraction(1, fps)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def encode_video_data_url(data: bytes) -> str:
    return f"data:video/mp4;base64,{base64.b64encode(data).decode('ascii')}"
