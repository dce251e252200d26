"""Local image paths under --allowed-media-dir: directories, NUL bytes and odd files get a 400-class
ImageInputError, and no request leaves a file descriptor open (counted in /proc/self/fd)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from PIL import Image

from firsttoken.inputs.image import ImageInputError
from firsttoken.inputs.media import load_image_bytes

LIMIT = 1 << 20


@pytest.fixture()
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    (root / "ok.png").write_bytes(buf.getvalue())
    (root / "album").mkdir()
    os.mkfifo(root / "pipe")
    (root / "loop-a").symlink_to(root / "loop-b")
    (root / "loop-b").symlink_to(root / "loop-a")
    return root


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (".", "image path is a directory"),
        ("album", "image path is a directory"),
        ("album/", "image path is a directory"),
        ("pipe", "image path is not a regular file"),
        ("ok.png\x00.jpg", "NUL byte"),
        ("file://{root}/ok.png%00.jpg", "NUL byte"),
        ("loop-a", "image path cannot be resolved"),
    ],
)
def test_odd_local_paths_are_client_errors(media_dir: Path, url: str, message: str) -> None:
    with pytest.raises(ImageInputError, match=message):
        load_image_bytes(url.format(root=media_dir), media_dir, LIMIT)


def test_no_descriptor_leaks_whatever_the_path(media_dir: Path) -> None:
    load_image_bytes("ok.png", media_dir, LIMIT)  # warm up anything opened once
    before = open_fds()
    for _ in range(50):
        for url in (".", "album", "pipe", "ok.png\x00", "missing.png"):
            with pytest.raises(ImageInputError):
                load_image_bytes(url, media_dir, LIMIT)
        assert load_image_bytes("ok.png", media_dir, LIMIT).startswith(b"\x89PNG")
    assert open_fds() == before


def test_a_file_over_the_byte_limit_is_refused_and_closed(media_dir: Path) -> None:
    (media_dir / "big.png").write_bytes(b"\x89PNG" + bytes(2 * LIMIT))
    before = open_fds()
    with pytest.raises(ImageInputError, match="the limit is"):
        load_image_bytes("big.png", media_dir, LIMIT)
    assert open_fds() == before
