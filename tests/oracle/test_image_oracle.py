"""firsttoken's image pipeline against transformers' Qwen2VLImageProcessorPil: same sizes, bit-identical pixels."""

from __future__ import annotations

import io

import numpy as np
import pytest
import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as qwen2_vl_pil  # noqa: E402
from PIL import Image
from transformers.image_transforms import convert_to_rgb  # noqa: E402

from firsttoken.inputs.image import (
    ImageInputError,
    decode_image,
    max_pixels_within_tokens,
    preprocess_image,
    smart_resize,
    to_rgb,
)
from firsttoken.models.model_config import ImageProcessorConfig

Qwen2VLImageProcessorPil = qwen2_vl_pil.Qwen2VLImageProcessorPil
ref_smart_resize = qwen2_vl_pil.smart_resize

VISION = ImageProcessorConfig()  # Qwen2-VL: 14-px patches, 2x2 merge, CLIP mean and std
DEFAULT_MIN, DEFAULT_MAX = 56 * 56, 28 * 28 * 1280

SIDES = [1, 2, 13, 14, 27, 28, 29, 55, 56, 57, 111, 200, 201, 447, 448, 999, 1024, 1536, 2048, 4000]


@pytest.mark.parametrize("min_pixels, max_pixels", [(DEFAULT_MIN, DEFAULT_MAX), (28 * 28, 256 * 28 * 28), (4 * 28 * 28, 16384 * 28 * 28)])
def test_smart_resize_matches_reference(min_pixels: int, max_pixels: int) -> None:
    for h in SIDES:
        for w in SIDES:
            if max(h, w) / min(h, w) > 200:
                with pytest.raises(ValueError):
                    ref_smart_resize(h, w, 28, min_pixels, max_pixels)
                with pytest.raises(ImageInputError):
                    smart_resize(h, w, 28, min_pixels, max_pixels)
                continue
            assert smart_resize(h, w, 28, min_pixels, max_pixels) == ref_smart_resize(h, w, 28, min_pixels, max_pixels)


def random_image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgba = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    if mode == "RGBA":
        return Image.fromarray(rgba, "RGBA")
    rgb = Image.fromarray(rgba[..., :3])
    if mode == "P":
        image = rgb.quantize(colors=64)
        image.info["transparency"] = 3
        return image
    return rgb.convert(mode)


CASES = [
    (448, 448, "RGB", DEFAULT_MIN, DEFAULT_MAX),
    (1024, 1024, "RGB", DEFAULT_MIN, DEFAULT_MAX),
    (640, 480, "RGB", DEFAULT_MIN, DEFAULT_MAX),
    (1, 1, "RGB", DEFAULT_MIN, DEFAULT_MAX),
    (27, 27, "L", DEFAULT_MIN, DEFAULT_MAX),
    (56, 29, "RGBA", DEFAULT_MIN, DEFAULT_MAX),
    (200, 1, "RGB", DEFAULT_MIN, DEFAULT_MAX),
    (4000, 20, "RGB", DEFAULT_MIN, DEFAULT_MAX),
    (37, 401, "P", DEFAULT_MIN, DEFAULT_MAX),
    (333, 777, "CMYK", DEFAULT_MIN, DEFAULT_MAX),
    (2048, 1536, "RGB", DEFAULT_MIN, 16384 * 28 * 28),  # upscale-free, 4015 tokens
    (1000, 700, "RGB", 28 * 28, 256 * 28 * 28),
    (300, 200, "RGBA", 1024 * 28 * 28, 4096 * 28 * 28),  # scaled up
]


@pytest.mark.parametrize("width, height, mode, min_pixels, max_pixels", CASES)
def test_preprocess_matches_reference_exactly(width: int, height: int, mode: str, min_pixels: int, max_pixels: int) -> None:
    image = random_image(width, height, mode, seed=width * 7 + height)
    reference = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)(image)
    ours = preprocess_image(image, VISION, min_pixels, max_pixels)
    expected = np.asarray(reference["pixel_values"])
    assert list(ours.grid_thw) == np.asarray(reference["image_grid_thw"])[0].tolist()
    assert ours.pixel_values.shape == expected.shape
    assert np.array_equal(ours.pixel_values.numpy(), expected)
    assert ours.num_tokens == expected.shape[0] // 4
    assert ours.original_size == (width, height)


def test_budgeted_preprocess_is_what_the_reference_makes_at_that_max_pixels() -> None:
    image = random_image(2000, 30, "RGB", seed=1)
    max_pixels = max_pixels_within_tokens(30, 2000, 50)
    reference = Qwen2VLImageProcessorPil(min_pixels=DEFAULT_MIN, max_pixels=max_pixels)(image)
    ours = preprocess_image(image, VISION, DEFAULT_MIN, max_pixels)
    assert ours.num_tokens <= 50
    assert np.array_equal(ours.pixel_values.numpy(), np.asarray(reference["pixel_values"]))


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "LA", "L", "P", "CMYK", "I;16", "1"])
def test_rgb_conversion_matches_reference(mode: str) -> None:
    if mode == "I;16":
        image = Image.fromarray((np.arange(40 * 30, dtype=np.uint16).reshape(30, 40) * 50))
    else:
        image = random_image(40, 30, "RGBA" if mode in ("RGBA", "LA") else "RGB", seed=3)
        image = image if mode in ("RGB", "RGBA") else image.convert(mode)
    assert np.array_equal(np.asarray(to_rgb(image)), convert_to_rgb(image, return_numpy=True))
    buf = io.BytesIO()
    image.save(buf, "TIFF" if mode == "CMYK" else "PNG")
    decoded = decode_image(buf.getvalue(), 10_000_000)
    reopened = Image.open(io.BytesIO(buf.getvalue()))
    assert np.array_equal(np.asarray(decoded), convert_to_rgb(reopened, return_numpy=True))
