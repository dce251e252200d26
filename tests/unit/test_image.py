"""Image inputs without transformers: sizes, token budgets, untrusted bytes, patch layout, media loading."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from firsttoken.inputs.image import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImageInputError,
    _normalize,
    decode_image,
    max_pixels_within_tokens,
    num_visual_tokens,
    pixels_for_tokens,
    preprocess_image,
    probe_image,
    smart_resize,
)
from firsttoken.inputs.media import base64_decoded_len, load_image_bytes
from firsttoken.models.model_config import ImageProcessorConfig

VISION = ImageProcessorConfig()  # Qwen2-VL: 14-px patches, 2x2 merge, CLIP mean and std
MAX_PIXELS = 10_000_000
MB = 1 << 20


def encode(image: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_declaring(width: int, height: int) -> bytes:
    """A syntactically valid PNG header whose IHDR claims width x height (no real pixel data)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


# ------------------------------------------------------------------------------------- smart_resize


@pytest.mark.parametrize(
    "h, w, expected",
    [
        (1, 1, (56, 56)),  # below one cell: scaled up to min_pixels like the reference
        (27, 27, (56, 56)),
        (28, 28, (56, 56)),  # one cell is below min_pixels too
        (56, 56, (56, 56)),
        (29, 56, (56, 84)),  # rounds to 28x56 < min_pixels, so scaled up
        (1024, 1024, (980, 980)),  # 1225 tokens at the default max_pixels (FACTS)
        (1, 200, (28, 812)),  # strip: the short side clamps to one cell
        (20, 4000, (28, 4004)),
    ],
)
def test_smart_resize_known_sizes(h: int, w: int, expected: tuple[int, int]) -> None:
    assert smart_resize(h, w) == expected


def test_smart_resize_refuses_extreme_aspect_ratio_with_ratio_and_limit() -> None:
    with pytest.raises(ImageInputError) as err:
        smart_resize(1, 201)
    assert err.value.code == "image_aspect_ratio"
    assert "201" in str(err.value) and "200" in str(err.value)


def test_num_visual_tokens_matches_facts() -> None:
    assert num_visual_tokens(448, 448) == 256
    assert num_visual_tokens(*smart_resize(1024, 1024, max_pixels=12845056)) == 1369
    assert num_visual_tokens(*smart_resize(1536, 2048, max_pixels=12845056)) == 4015


# ------------------------------------------------------------------------------------- token budget


BUDGET_SIZES = list(range(1, 120, 5)) + list(range(120, 4200, 211))


@pytest.mark.parametrize("budget", [1, 4, 16, 64, 256, 1280])
def test_budgeted_max_pixels_never_exceeds_budget(budget: int) -> None:
    """pixels_for_tokens alone is not enough for strips and tiny images (smart_resize clamps a side to one
    cell, and min_pixels scales tiny images up); max_pixels_within_tokens must be, for every size."""
    for h in BUDGET_SIZES:
        for w in BUDGET_SIZES:
            if max(h, w) / min(h, w) > 200:
                continue
            try:
                max_pixels = max_pixels_within_tokens(h, w, budget)
            except ImageInputError as err:
                assert err.code == "image_too_large"
                # only legitimate when min_pixels alone forces more tokens than the budget
                assert num_visual_tokens(*smart_resize(h, w, max_pixels=1)) > budget
                continue
            assert max_pixels <= pixels_for_tokens(budget)
            assert num_visual_tokens(*smart_resize(h, w, max_pixels=max_pixels)) <= budget


def test_budget_is_not_shrunk_for_ordinary_images() -> None:
    assert max_pixels_within_tokens(1024, 1024, 1280) == pixels_for_tokens(1280)
    assert max_pixels_within_tokens(768, 1024, 256) == pixels_for_tokens(256)


def test_budget_shrinks_for_a_strip() -> None:
    h, w, budget = 20, 4000, 100
    assert num_visual_tokens(*smart_resize(h, w, max_pixels=pixels_for_tokens(budget))) > budget
    max_pixels = max_pixels_within_tokens(h, w, budget)
    assert num_visual_tokens(*smart_resize(h, w, max_pixels=max_pixels)) == budget


# ------------------------------------------------------------------------------------- probe / decode


def test_probe_reads_header() -> None:
    header = probe_image(encode(noise(40, 30)), MAX_PIXELS)
    assert (header.width, header.height, header.format) == (40, 30, "PNG")


def test_probe_refuses_decompression_bomb_header() -> None:
    with pytest.raises(ImageInputError) as err:
        probe_image(png_declaring(100_000, 100_000), MAX_PIXELS)
    assert err.value.code == "image_too_large"


def test_probe_refuses_oversized_declaration_with_size_and_limit() -> None:
    with pytest.raises(ImageInputError) as err:
        probe_image(png_declaring(5000, 4000), 1_000_000)
    assert err.value.code == "image_too_large"
    assert "5000x4000" in str(err.value) and "1000000" in str(err.value)


@pytest.mark.parametrize(
    "data",
    [b"", b"hello, this is not an image", encode(noise(8, 8))[:20], b"%!PS-Adobe-3.0 EPSF-3.0\n"],
    ids=["empty", "text", "truncated-header", "eps"],
)
def test_probe_refuses_non_images(data: bytes) -> None:
    with pytest.raises(ImageInputError) as err:
        probe_image(data, MAX_PIXELS)
    assert err.value.code == "invalid_image"
    assert "hello" not in str(err.value)


def test_decode_refuses_truncated_jpeg() -> None:
    data = encode(noise(64, 64), "JPEG", quality=90)
    truncated = data[: len(data) // 2]
    assert probe_image(truncated, MAX_PIXELS).width == 64  # the header survives, the pixels do not
    with pytest.raises(ImageInputError) as err:
        decode_image(truncated, MAX_PIXELS)
    assert err.value.code == "invalid_image"


def test_decode_composites_alpha_onto_white() -> None:
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[0, 0, 3] = 255  # one opaque red-ish pixel, the rest fully transparent
    image = decode_image(encode(Image.fromarray(rgba, "RGBA")), MAX_PIXELS)
    pixels = np.asarray(image)
    assert image.mode == "RGB"
    assert pixels[0, 0].tolist() == [200, 0, 0]
    assert pixels[1, 1].tolist() == [255, 255, 255]


def test_decode_palette_transparency_becomes_white() -> None:
    p = Image.new("P", (4, 4), 0)
    p.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    p.putpixel((1, 1), 1)
    pixels = np.asarray(decode_image(encode(p, transparency=0), MAX_PIXELS))
    assert pixels[0, 0].tolist() == [255, 255, 255]
    assert pixels[1, 1].tolist() == [10, 20, 30]


@pytest.mark.parametrize("mode, fmt", [("L", "PNG"), ("CMYK", "JPEG"), ("CMYK", "TIFF"), ("I;16", "PNG")])
def test_decode_other_modes_to_rgb(mode: str, fmt: str) -> None:
    gray = np.arange(32 * 32, dtype=np.uint16).reshape(32, 32)
    if mode == "I;16":
        source = Image.fromarray(gray * 60)
    elif mode == "CMYK":
        source = noise(32, 32).convert("CMYK")
    else:
        source = Image.fromarray((gray % 256).astype(np.uint8), "L")
    data = encode(source, fmt)
    image = decode_image(data, MAX_PIXELS)
    assert image.mode == "RGB" and image.size == (32, 32)
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


# ------------------------------------------------------------------------------------- preprocess


def test_normalize_matches_reference_arithmetic_for_every_byte() -> None:
    """The reference: float32(float64(x) * (1/255)), then float32 (x - mean) / std."""
    values = np.arange(256, dtype=np.uint8)
    rescaled = (values.astype(np.float64) * (1 / 255)).astype(np.float32)
    expected = np.stack(
        [(rescaled - np.float32(m)) / np.float32(s) for m, s in zip(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)]
    )
    assert np.array_equal(_normalize(np.stack([values] * 3)[None])[0], expected)


def test_patch_layout_groups_merge_windows_and_repeats_the_frame() -> None:
    # 56x84 image = 4x6 patches; pixel value encodes which patch it lies in.
    patch_id = (np.arange(56)[:, None] // 14) * 6 + (np.arange(84)[None, :] // 14)
    image = Image.fromarray(np.repeat(patch_id[..., None], 3, axis=2).astype(np.uint8))
    out = preprocess_image(image, VISION, 56 * 56, 28 * 28 * 1280)
    assert out.grid_thw == (1, 4, 6) and out.num_tokens == 6
    assert out.original_size == (84, 56) and out.resized_size == (84, 56)
    pv = out.pixel_values.view(24, 3, 2, 14 * 14)
    assert torch.equal(pv[:, :, 0], pv[:, :, 1])
    lut = ((np.arange(30) / 255).astype(np.float32) - np.float32(OPENAI_CLIP_MEAN[0])) / np.float32(OPENAI_CLIP_STD[0])
    source_patch = [int(np.argmin(np.abs(lut - pv[i, 0, 0, 0].item()))) for i in range(24)]
    # merge window (0,0) holds patches (0,0),(0,1),(1,0),(1,1), then window (0,1), ...
    assert source_patch[:8] == [0, 1, 6, 7, 2, 3, 8, 9]
    assert source_patch[-4:] == [16, 17, 22, 23]


def test_preprocess_respects_budget() -> None:
    image = noise(1024, 768)
    budget = 300
    out = preprocess_image(image, VISION, 56 * 56, max_pixels_within_tokens(768, 1024, budget))
    assert out.num_tokens <= budget
    assert out.pixel_values.shape == (out.num_tokens * 4, 3 * 2 * 14 * 14)
    assert out.pixel_values.dtype == torch.float32 and out.content_hash is None


# ------------------------------------------------------------------------------------- media loading


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_data_url_round_trip() -> None:
    png = encode(noise(8, 8))
    assert load_image_bytes(data_url(png), None, MB) == png
    assert base64_decoded_len(base64.b64encode(png).decode()) == len(png)


@pytest.mark.parametrize("url", ["data:image/png;base64,@@not*base64!!", "data:image/png;base64,abc"])
def test_bad_base64_is_invalid_image(url: str) -> None:
    with pytest.raises(ImageInputError) as err:
        load_image_bytes(url, None, MB)
    assert err.value.code == "invalid_image" and "@@" not in str(err.value)


def test_data_url_needs_image_type_and_base64() -> None:
    for url in ["data:text/plain;base64,aGk=", "data:image/png,rawbytes", "data:image/png;base64"]:
        with pytest.raises(ImageInputError):
            load_image_bytes(url, None, MB)


def test_data_url_size_checked_before_decoding() -> None:
    with pytest.raises(ImageInputError) as err:
        load_image_bytes(data_url(b"\0" * 3000), None, 1000)
    assert err.value.code == "image_too_large"


def test_http_urls_are_refused() -> None:
    for url in ["http://example.com/a.png", "HTTPS://example.com/a.png"]:
        with pytest.raises(ImageInputError) as err:
            load_image_bytes(url, Path("/"), MB)
        assert err.value.code == "media_not_allowed"
        assert "remote image URLs are disabled" in str(err.value)


def test_local_files_need_an_allowed_dir(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"x")
    with pytest.raises(ImageInputError) as err:
        load_image_bytes(str(tmp_path / "a.png"), None, MB)
    assert err.value.code == "media_not_allowed"


def test_file_inside_dir_is_read(tmp_path: Path) -> None:
    png = encode(noise(8, 8))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a b.png").write_bytes(png)
    assert load_image_bytes(str(tmp_path / "sub" / "a b.png"), tmp_path, MB) == png
    assert load_image_bytes((tmp_path / "sub" / "a b.png").as_uri(), tmp_path, MB) == png
    assert load_image_bytes("sub/a b.png", tmp_path, MB) == png
    with pytest.raises(ImageInputError) as err:
        load_image_bytes("sub/a b.png", tmp_path, 10)
    assert err.value.code == "image_too_large"


def test_outside_dir_is_refused_the_same_whether_or_not_it_exists(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"secret")
    (media / "escape.png").symlink_to(secret)
    errors = []
    for url in [str(secret), str(tmp_path / "missing.png"), "../secret.png", "escape.png", secret.as_uri()]:
        with pytest.raises(ImageInputError) as err:
            load_image_bytes(url, media, MB)
        errors.append((err.value.code, str(err.value)))
    assert len(set(errors)) == 1 and errors[0][0] == "media_not_allowed"
    assert "secret" not in errors[0][1]


def test_missing_file_inside_dir_is_invalid_image(tmp_path: Path) -> None:
    with pytest.raises(ImageInputError) as err:
        load_image_bytes("nope.png", tmp_path, MB)
    assert err.value.code == "invalid_image"
