"""What a container says about itself before FFmpeg reads it (firsttoken/inputs/video_container.py): the stream
count from its own structure, read within a bounded number of elements, and "cannot tell" (None) wherever the
declaring structure is not within them whole. Work is counted through ``StructureWalk``, never timed."""

from __future__ import annotations

import pytest

from firsttoken.config import VideoConfig
from firsttoken.inputs.video import PyAVBackend, VideoInputError, load_video
from firsttoken.inputs.video_container import MAX_ELEMENTS, StructureWalk, count_streams
from firsttoken.inputs.video_synth import make_clip
from firsttoken.models.model_config import ImageProcessorConfig
from tests.video_fakes import compress_moov, many_streams, many_tiny_elements

CONTAINERS = [("mov", "mp4"), ("matroska", "matroska"), ("avi", "avi")]  # (FFmpeg's demuxer, the muxer making it)


@pytest.mark.parametrize("container", [c for c, _ in CONTAINERS])
def test_a_file_of_many_tiny_elements_is_walked_up_to_the_cap_and_cannot_be_told(container: str) -> None:
    """100,000 elements of 2 to 8 bytes where the declaring structure should be: the walk reads MAX_ELEMENTS of
    them and answers None (FFmpeg's own stream cap then bounds what it sets up), however many follow."""
    for num_elements in (100_000, 10 * MAX_ELEMENTS):
        assert count_streams(many_tiny_elements(container, num_elements), container) is None
        walk = StructureWalk()
        assert count_streams(many_tiny_elements(container, num_elements), container, walk) is None
        assert (walk.visited, walk.stopped) == (MAX_ELEMENTS, True)


@pytest.mark.parametrize(("container", "muxer"), CONTAINERS)
def test_real_files_are_counted_in_a_few_elements(container: str, muxer: str) -> None:
    one = make_clip(0.2, 32, 32, fps=10, container=muxer)
    for num_streams in (1, 3, 16):
        data = one if num_streams == 1 else many_streams(one, num_streams, muxer)
        walk = StructureWalk()
        assert count_streams(data, container, walk) == num_streams
        assert not walk.stopped and walk.visited <= 2 * num_streams + 16, walk.visited
    walk = StructureWalk(max_elements=3)  # too few for the 16 tracks: cannot tell, not a short count
    assert count_streams(many_streams(one, 16, muxer), container, walk) is None and walk.stopped


def test_an_mp4_with_a_compressed_index_cannot_be_told_and_ffmpegs_cap_holds() -> None:
    """moov/cmov holds the trak boxes zlib-compressed: count_streams cannot see them (None, not 0); FFmpeg reads
    them, and its max_streams (the server's stream limit) refuses a 17th stream as it sets them up."""
    one = make_clip(0.4, 32, 32, fps=10)
    for num_streams in (1, 16, 17):
        data = compress_moov(one if num_streams == 1 else many_streams(one, num_streams, "mp4"))
        assert count_streams(data, "mov") is None
        be = PyAVBackend()
        if num_streams <= VideoConfig().max_video_streams:
            loaded = load_video(data, VideoConfig(), ImageProcessorConfig(), backend=be)
            assert (loaded.header.num_streams, loaded.plan.num_frames) == (num_streams, 4)
            continue
        with pytest.raises(VideoInputError, match=r"video container \(MP4/MOV\) is truncated or corrupt"):
            load_video(data, VideoConfig(), ImageProcessorConfig(), backend=be)
        assert (be.opened, be.packets_demuxed, be.frames_decoded) == (1, 0, 0)
