"""Turn an OpenAI ``image_url`` string into image bytes, without trusting it.

Accepted: ``data:image/<type>;base64,<payload>`` (strict base64), and local paths / ``file://`` URLs only
when the server has an allowed media directory and the path, after following symlinks, lies inside it.
Remote http(s) URLs are refused for now. Size is checked before decoding base64 or reading a file.
Errors are ImageInputError with messages that never echo payload bytes or reveal files outside the dir.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlparse

from firsttoken.inputs.image import ImageInputError

_NOT_ALLOWED_PATH = "local image paths are only allowed inside the server's media directory"


def load_image_bytes(url: str, allowed_media_dir: Path | None, max_image_bytes: int) -> bytes:
    """The raw (still encoded) image bytes ``url`` names, at most ``max_image_bytes`` of them."""
    scheme = url[: url.find(":")].lower() if ":" in url else ""
    if scheme == "data":
        return _load_data_url(url, max_image_bytes)
    if scheme in ("http", "https"):
        raise ImageInputError("media_not_allowed", "remote image URLs are disabled on this server")
    if scheme == "file":
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ImageInputError("media_not_allowed", "file:// URLs must name a local file")
        return _load_file(unquote(parsed.path), allowed_media_dir, max_image_bytes)
    if scheme and len(scheme) > 1:  # "c:" would be a Windows drive, anything longer a URL scheme
        raise ImageInputError("media_not_allowed", "unsupported image URL scheme; use a data: URL")
    return _load_file(url, allowed_media_dir, max_image_bytes)


def base64_decoded_len(payload: str) -> int:
    """Bytes a padded base64 payload decodes to, from its length alone."""
    padding = len(payload) - len(payload.rstrip("="))
    return len(payload) // 4 * 3 - min(padding, 2)


def _load_data_url(url: str, max_image_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageInputError("invalid_image", "malformed data URL: missing ','")
    params = header[len("data:") :].split(";")
    media_type = params[0].strip().lower()
    if not media_type.startswith("image/"):
        raise ImageInputError("invalid_image", "data URL must have an image/* media type")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise ImageInputError("invalid_image", "image data URLs must be base64-encoded")
    size = base64_decoded_len(payload)
    if size > max_image_bytes:
        raise ImageInputError(
            "image_too_large", f"image is {size} bytes; the limit is {max_image_bytes} bytes"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError("invalid_image", "image data URL is not valid base64") from None


def _load_file(raw_path: str, allowed_media_dir: Path | None, max_image_bytes: int) -> bytes:
    if allowed_media_dir is None:
        raise ImageInputError("media_not_allowed", "local image paths are disabled on this server")
    root = allowed_media_dir.resolve()
    path = (root / raw_path).resolve()  # an absolute raw_path replaces root; symlinks are followed
    if not path.is_relative_to(root):
        raise ImageInputError("media_not_allowed", _NOT_ALLOWED_PATH)
    try:
        # O_NOFOLLOW: a symlink swapped in after resolve() is refused; O_NONBLOCK: a FIFO can't hang us.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        raise ImageInputError("invalid_image", "image file not found in the media directory") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ImageInputError("invalid_image", "image path is not a regular file")
        if st.st_size > max_image_bytes:
            raise ImageInputError(
                "image_too_large", f"image is {st.st_size} bytes; the limit is {max_image_bytes} bytes"
            )
        data = f.read(max_image_bytes + 1)
    if len(data) > max_image_bytes:  # the file grew after fstat
        raise ImageInputError("image_too_large", f"image exceeds the limit of {max_image_bytes} bytes")
    return data
