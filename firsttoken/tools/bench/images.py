"""Synthetic test images with real detail (gradients, shapes, rendered text), deterministic from a
seed.

Real detail matters: a flat image compresses to nothing and some servers' preprocessing has fast
paths for it. Every image of a run is distinct (seeded by session, turn and position), so no encoder
or prefix cache can hit across requests unless the workload asks for it (multiturn resends the same
images on purpose).
"""

from __future__ import annotations

import base64
import io
import random

import numpy as np
from PIL import Image, ImageDraw, ImageFont

_WORDS = (
    "invoice",
    "total",
    "ACME",
    "42.00",
    "route",
    "north",
    "sensor",
    "alpha",
    "delta",
    "page 3",
    "Q4",
    "warning",
    "flow",
    "2026-11-29",
    "node",
    "chart",
    "cell B7",
    "OK",
    "label",
)


def synth_image(width: int, height: int, seed: str) -> Image.Image:
    """An RGB image of exactly width x height pixels; the same seed gives the same pixels."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(rng.getrandbits(64))
    # Two-colour diagonal gradient plus mild noise, so the picture has texture everywhere.
    c0 = nrng.integers(0, 256, size=3).astype(np.float32)
    c1 = nrng.integers(0, 256, size=3).astype(np.float32)
    xs = np.linspace(0.0, 0.5, width, dtype=np.float32)
    ys = np.linspace(0.0, 0.5, height, dtype=np.float32)
    t = (ys[:, None] + xs[None, :])[..., None]  # [H, W, 1] in 0..1 along the diagonal
    pixels = c0 + (c1 - c0) * t + nrng.integers(-10, 11, size=(height, width, 3), dtype=np.int8)
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    scale = max(1, min(width, height))
    for _ in range(8 + (width * height) // 40_000):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1 = min(width - 1, x0 + rng.randrange(1, max(2, scale // 4)))
        y1 = min(height - 1, y0 + rng.randrange(1, max(2, scale // 4)))
        colour = tuple(rng.randrange(256) for _ in range(3))
        kind = rng.randrange(4)
        if kind == 0:
            draw.rectangle((x0, y0, x1, y1), outline=colour, width=rng.randrange(1, 5))
        elif kind == 1:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        elif kind == 2:
            draw.line((x0, y0, x1, y1), fill=colour, width=rng.randrange(1, 6))
        else:
            pts = [(rng.randrange(width), rng.randrange(height)) for _ in range(3)]
            draw.polygon(pts, outline=colour)
    font = _font(max(10, scale // 24))
    for _ in range(4 + scale // 128):
        xy = (rng.randrange(width), rng.randrange(height))
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(1, 4)))
        draw.text(xy, words, fill=tuple(rng.randrange(256) for _ in range(3)), font=font)
    return img


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def encode_data_url(img: Image.Image, fmt: str = "jpeg") -> str:
    buf = io.BytesIO()
    if fmt == "jpeg":
        img.save(buf, format="JPEG", quality=90)
    else:
        img.save(buf, format="PNG", compress_level=1)
    return f"data:image/{fmt};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def decode_data_url(url: str) -> Image.Image:
    """Inverse of encode_data_url (for tests and for counting workload-file images' sizes)."""
    _, _, data = url.partition(",")
    return Image.open(io.BytesIO(base64.b64decode(data)))
