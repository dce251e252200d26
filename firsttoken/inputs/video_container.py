"""What a video container says about itself before FFmpeg reads it: its kind, from the first bytes,
and how many streams it holds, from its own structure (MP4 boxes, Matroska elements, AVI chunks),
nothing decoded.

FFmpeg sets up every stream of a container it opens (a decoder context each, while probing), so the
stream count is what the server checks before handing the bytes to FFmpeg. ``count_streams`` reads
only the structure that declares the streams, at most ``MAX_ELEMENTS`` elements in all, and answers
None ("cannot tell") where that structure is not within them whole (a truncated file, Matroska
tracks after the first cluster, an MP4 whose index is compressed, a file of many small elements
before the declaring one); FFmpeg's own stream cap (``max_streams``) then bounds what it sets up."""

from __future__ import annotations

import struct
from collections.abc import Iterator

# Containers we let FFmpeg parse, told by their first bytes; anything else is refused before FFmpeg
# sees it (its playlist and concat demuxers open other files and URLs by themselves). Key: FFmpeg's
# demuxer name, passed to av.open so FFmpeg probes no format.
CONTAINERS = {"mov": "MP4/MOV", "matroska": "WebM/Matroska", "avi": "AVI"}
_ISO_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot")

# Elements (MP4 boxes, EBML elements, RIFF chunks) one count reads at most, over every level it
# walks. A real file declares its streams within its first few top-level elements, one element per
# stream plus a few; a walk over this many is bounded work (each element is a few byte reads),
# whatever the file holds.
MAX_ELEMENTS = 4096

# Matroska (EBML) element ids, marker bits kept, as the specification writes them
_SEGMENT, _TRACKS, _TRACK_ENTRY, _CLUSTER = 0x18538067, 0x1654AE6B, 0xAE, 0x1F43B675


def sniff_container(data: bytes) -> str | None:
    """FFmpeg's demuxer name for the container ``data`` starts like, or None."""
    if len(data) >= 12 and data[4:8] in _ISO_BOXES:
        return "mov"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


class StructureWalk:
    """The elements one ``count_streams`` call reads: counted (``visited``), and stopped at
    ``max_elements``, after which the call answers None. A fresh one per call; tests pass one in to
    count the work."""

    def __init__(self, max_elements: int = MAX_ELEMENTS) -> None:
        self.max_elements = max_elements
        self.visited = 0
        self.stopped = False  # True once an element past the cap was due: the walk did not finish

    def visit(self) -> bool:
        """One more element to read: True while within the cap."""
        if self.visited >= self.max_elements:
            self.stopped = True
            return False
        self.visited += 1
        return True


def count_streams(data: bytes, container: str, walk: StructureWalk | None = None) -> int | None:
    """Streams (tracks) the container declares: an MP4's ``trak`` boxes, a Matroska file's
    TrackEntry elements, an AVI's ``strl`` lists. None where the declaring structure cannot be found
    whole within ``walk``'s cap."""
    walk = walk if walk is not None else StructureWalk()
    if container == "mov":
        count = _mp4_streams(data, walk)
    elif container == "matroska":
        count = _matroska_streams(data, walk)
    elif container == "avi":
        count = _avi_streams(data, walk)
    else:
        return None
    return None if walk.stopped else count


def _mp4_boxes(
    data: bytes, start: int, end: int, walk: StructureWalk
) -> Iterator[tuple[bytes, int, int]]:
    """(type, body start, body end) of the boxes in data[start:end]; stops at the first that does
    not fit, or at the walk's cap."""
    at = start
    while at + 8 <= end and walk.visit():
        size, kind = struct.unpack_from(">I4s", data, at)
        head = 8
        if size == 1:  # a 64-bit size follows the type
            if at + 16 > end:
                return
            size, head = struct.unpack_from(">Q", data, at + 8)[0], 16
        elif size == 0:  # the box runs to the end of its parent
            size = end - at
        if size < head or at + size > end:
            return
        yield kind, at + head, at + size
        at += size


def _mp4_streams(data: bytes, walk: StructureWalk) -> int | None:
    for kind, start, end in _mp4_boxes(data, 0, len(data), walk):
        if kind == b"moov":
            children = [child for child, _, _ in _mp4_boxes(data, start, end, walk)]
            # a compressed index: its trak boxes are inside the compressed bytes
            if b"cmov" in children:
                return None
            return children.count(b"trak")
    return None


def _riff_chunks(
    data: bytes, start: int, end: int, walk: StructureWalk
) -> Iterator[tuple[bytes, int, int]]:
    """(fourcc, body start, body end) of the RIFF chunks in data[start:end] (bodies padded to an
    even length); stops at the first that does not fit, or at the walk's cap."""
    at = start
    while at + 8 <= end and walk.visit():
        fourcc, size = struct.unpack_from("<4sI", data, at)
        if at + 8 + size > end:
            return
        yield fourcc, at + 8, at + 8 + size
        at += 8 + size + (size & 1)


def _avi_streams(data: bytes, walk: StructureWalk) -> int | None:
    # RIFF <size> "AVI " <chunks>: LIST "hdrl" holds the main header, then one LIST "strl" per
    # stream
    for fourcc, start, end in _riff_chunks(data, 12, len(data), walk):
        if fourcc == b"LIST" and data[start:start + 4] == b"hdrl":
            return sum(1 for f, s, _ in _riff_chunks(data, start + 4, end, walk)
                       if f == b"LIST" and data[s:s + 4] == b"strl")
    return None


def _vint(data: bytes, at: int, keep_marker: bool) -> tuple[int, int, bool] | None:
    """An EBML variable-length integer at ``at``: (value, length in bytes, all value bits set), or
    None."""
    if at >= len(data) or data[at] == 0:
        return None
    length = 9 - data[at].bit_length()  # leading zero bits + 1
    if at + length > len(data):
        return None
    raw = int.from_bytes(data[at:at + length], "big")
    value = raw & ((1 << (7 * length)) - 1)
    return (raw if keep_marker else value), length, value == (1 << (7 * length)) - 1


def _ebml_elements(
    data: bytes, start: int, end: int, walk: StructureWalk
) -> Iterator[tuple[int, int, int | None]]:
    """(id, body start, body end or None for an unknown size) of the elements in data[start:end];
    stops at the first that cannot be read, or at the walk's cap."""
    at = start
    while at < end and walk.visit():
        element, size = _vint(data, at, keep_marker=True), None
        if element is not None:
            size = _vint(data, at + element[1], keep_marker=False)
        if element is None or size is None:
            return
        body = at + element[1] + size[1]
        if size[2]:  # unknown size: the element runs to the end of its parent
            yield element[0], body, None
            return
        yield element[0], body, body + size[0]
        at = body + size[0]


def _matroska_streams(data: bytes, walk: StructureWalk) -> int | None:
    # EBML header, then Segment: SeekHead, Info, Tracks (one TrackEntry per stream) ... Clusters
    for element, start, end in _ebml_elements(data, 0, len(data), walk):
        if element != _SEGMENT:
            continue
        for child, body, body_end in _ebml_elements(
            data, start, min(end or len(data), len(data)), walk
        ):
            if child == _TRACKS:
                if body_end is None or body_end > len(data):
                    return None
                return sum(
                    1
                    for entry, _, _ in _ebml_elements(data, body, body_end, walk)
                    if entry == _TRACK_ENTRY
                )
            # frames before the tracks: left to FFmpeg (which follows the SeekHead)
            if child == _CLUSTER:
                return None
        return None
    return None
