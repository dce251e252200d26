"""Bad and lying videos for tests, made from small synthetic clips (firsttoken/inputs/video_synth.py); nothing is
read from outside the repository."""

from __future__ import annotations

import ast
import importlib.util
import logging
import math
import os
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

MKV_DURATION = b"\x44\x89\x88"  # EBML element Duration (0x4489), 8-byte float, in timecode-scale units (ms)


def patch_mkv_duration(data: bytes, seconds: float) -> bytes:
    """A Matroska file whose Segment Info claims ``seconds`` (the frames stay as they are): a lying header."""
    at = data.find(MKV_DURATION)
    if at < 0:
        raise ValueError("no 8-byte Duration element in this Matroska file")
    at += len(MKV_DURATION)
    return data[:at] + struct.pack(">d", seconds * 1000.0) + data[at + 8:]


MKV_DEFAULT_DURATION = b"\x23\xe3\x83"  # EBML element DefaultDuration (0x23E383): a track's nanoseconds per frame


def unstate_mkv_rate(data: bytes, duration_too: bool = False) -> bytes:
    """A Matroska file that states no frame rate (its DefaultDuration element made a Void element of the same
    length, as many muxers write none) and, with ``duration_too``, no duration (Segment Info's Duration likewise,
    as a browser's MediaRecorder writes neither); every frame and offset stays as it was."""
    data = _void_element(data, MKV_DEFAULT_DURATION)
    return _void_element(data, MKV_DURATION) if duration_too else data


def _void_element(data: bytes, marker: bytes) -> bytes:
    at = data.find(marker)
    if at < 0:
        raise ValueError(f"no element {marker.hex()} in this Matroska file")
    size_at = at + len(marker) if marker != MKV_DURATION else at + 2  # MKV_DURATION holds its size byte
    if data[size_at] & 0x80 == 0:
        raise ValueError("the element's size is not one byte")
    total = size_at + 1 + (data[size_at] & 0x7F) - at
    return data[:at] + bytes([0xEC, 0x80 | (total - 2)]) + bytes(total - 2) + data[at + total:]  # Void (0xEC)


def many_streams(clip: bytes, num_streams: int, container: str) -> bytes:
    """``clip``'s video stream muxed ``num_streams`` times into one ``container`` file (packets copied, nothing
    re-encoded): a container of many streams, each as big as the clip's frames. ``clip`` must suit ``container``
    (AVI takes H.264 only as an AVI clip's packets)."""
    return remux(clip, container, num_streams)


def remux(clip: bytes, container: str, num_streams: int = 1, skip_packets: int = 0) -> bytes:
    """``clip``'s video packets copied into a ``container`` file (nothing re-encoded; ``num_streams`` copies of the
    stream), less its first ``skip_packets`` (a cut that is not at a key frame). Their stamps are kept as they are,
    decode-order stamps from an AVI clip included; an AVI file's are renumbered from 0 (it stores a frame's place,
    and a gap would be filled with empty frames)."""
    import io

    import av

    out = io.BytesIO()
    with av.open(io.BytesIO(clip)) as src, av.open(out, "w", format=container) as dst:
        stream = src.streams.video[0]
        copies = [dst.add_stream_from_template(stream) for _ in range(num_streams)]
        for n, packet in enumerate([p for p in src.demux(stream) if p.size][skip_packets:]):
            if container == "avi":
                packet.pts = packet.dts = n
            for copy in copies:
                packet.stream = copy
                dst.mux(packet)
    return out.getvalue()


def _box(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I4s", 8 + len(body), kind) + body


def compress_moov(mp4: bytes) -> bytes:
    """``mp4`` with its index compressed as QuickTime writes it (moov holding one cmov: dcom "zlib", cmvd = the
    uncompressed size and the zlib-compressed moov box), which FFmpeg reads. The moov must follow the frames (the
    muxer's default), so that no chunk offset moves."""
    at = 0
    while at + 8 <= len(mp4):
        size, kind = struct.unpack_from(">I4s", mp4, at)
        if kind == b"moov":
            moov = mp4[at:at + size]
            cmvd = _box(b"cmvd", struct.pack(">I", len(moov)) + zlib.compress(moov))
            return mp4[:at] + _box(b"moov", _box(b"cmov", _box(b"dcom", b"zlib") + cmvd)) + mp4[at + size:]
        at += size
    raise ValueError("no moov box at the top level of this MP4")


def many_tiny_elements(container: str, num_elements: int) -> bytes:
    """A crafted file of the smallest structure elements where ``count_streams`` looks for the streams, none of them
    the declaring one: Matroska, a Segment of unknown size holding 2-byte Void elements; MP4, a moov of empty free
    boxes; AVI, a LIST hdrl of empty JUNK chunks."""
    if container == "matroska":
        return b"\x1a\x45\xdf\xa3\x80" + b"\x18\x53\x80\x67\x01" + b"\xff" * 7 + b"\xec\x80" * num_elements
    if container == "mov":
        return _box(b"ftyp", b"isom\0\0\0\0") + _box(b"moov", _box(b"free", b"") * num_elements)
    if container == "avi":
        hdrl = b"LIST" + struct.pack("<I", 4 + 8 * num_elements) + b"hdrl" + (b"JUNK" + bytes(4)) * num_elements
        return b"RIFF" + struct.pack("<I", 4 + len(hdrl)) + b"AVI " + hdrl
    raise ValueError(container)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads_alive() -> int:
    """OS threads of this process (FFmpeg's decoder threads are not Python threads)."""
    return len(os.listdir("/proc/self/task"))


# qwen-vl-utils as the oracle. Its module imports torchvision at the top (which this project does not install: the
# PyPI wheel is built against CUDA torch), so the sampling rules are taken from its source file as published: the
# constants and the pure functions below are compiled from the installed vision_process.py, nothing rewritten.
_ORACLE_CONSTANTS = {"MAX_RATIO", "SPATIAL_MERGE_SIZE", "IMAGE_MIN_TOKEN_NUM", "IMAGE_MAX_TOKEN_NUM",
                     "VIDEO_MIN_TOKEN_NUM", "VIDEO_MAX_TOKEN_NUM", "FPS", "FRAME_FACTOR", "FPS_MIN_FRAMES",
                     "FPS_MAX_FRAMES"}
_ORACLE_FUNCTIONS = {"round_by_factor", "ceil_by_factor", "floor_by_factor", "smart_resize", "smart_nframes"}


def qwen_vl_utils_oracle() -> SimpleNamespace | None:
    """The installed qwen-vl-utils' sampling functions and constants, or None when it is not installed."""
    spec = importlib.util.find_spec("qwen_vl_utils")
    if spec is None or not spec.submodule_search_locations:
        return None
    from importlib.metadata import version

    source = Path(next(iter(spec.submodule_search_locations))) / "vision_process.py"
    tree = ast.parse(source.read_text())
    keep: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id in _ORACLE_CONSTANTS
                                                for t in node.targets):
            keep.append(node)
        elif isinstance(node, ast.FunctionDef) and node.name in _ORACLE_FUNCTIONS:
            keep.append(node)
    from typing import Any as _Any, Dict, List, Optional, Tuple, Union

    ns: dict[str, Any] = {"math": math, "logger": logging.getLogger("qwen-vl-utils-oracle"), "Any": _Any,
                          "Dict": Dict, "List": List, "Optional": Optional, "Tuple": Tuple, "Union": Union}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(source), "exec"), ns)  # noqa: S102
    missing = (_ORACLE_CONSTANTS | _ORACLE_FUNCTIONS) - set(ns)
    if missing:
        raise RuntimeError(f"qwen-vl-utils {version('qwen-vl-utils')} no longer defines {sorted(missing)}")
    ns["version"] = version("qwen-vl-utils")
    return SimpleNamespace(**{k: v for k, v in ns.items() if not k.startswith("__")})


def qwen_plan(q: SimpleNamespace, total: int, video_fps: float, width: int, height: int, budget_tokens: int,
              fps: float | None = None, max_frames: int | None = None, patch: int = 14) -> tuple:
    """What qwen-vl-utils' fetch_video samples and resizes to for a decoded video of ``total`` frames (its decord /
    torchcodec path: smart_nframes, torch.linspace(0, total - 1, n).round(), then its max_pixels rule with
    total_pixels = the budget in 28x28 cells): (nframes, indices, (resized_w, resized_h))."""
    import torch

    ele: dict[str, Any] = {}
    if fps is not None:
        ele["fps"] = fps
    if max_frames is not None:
        ele["max_frames"] = max_frames
    nframes = q.smart_nframes(ele, total_frames=total, video_fps=video_fps)
    idx = torch.linspace(0, total - 1, nframes).round().long().tolist()
    factor = patch * q.SPATIAL_MERGE_SIZE
    min_pixels = q.VIDEO_MIN_TOKEN_NUM * factor * factor
    total_pixels = budget_tokens * factor * factor
    max_pixels = max(min(q.VIDEO_MAX_TOKEN_NUM * factor * factor, total_pixels / nframes * q.FRAME_FACTOR),
                     int(min_pixels * 1.05))
    rh, rw = q.smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return nframes, idx, (rw, rh)


class TickingClock:
    """A clock for PyAVBackend that moves one second each time it is read: the backend reads it at every packet and
    every decoded frame, so a deadline of N seconds is N reads."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now
