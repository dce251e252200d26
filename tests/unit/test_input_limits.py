"""Input limits checked before any image is decoded, with messages that state what was counted."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

from firsttoken.api.protocol import ChatCompletionRequest, to_chat_prompt
from firsttoken.inputs.image import ImageInputError
from firsttoken.inputs.processor import InputError, InputProcessor
from tests.helpers import make_processor, process


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> InputProcessor:
    return make_processor(tiny_model_dir, 2048, image_max_tokens=256, image_min_tokens=4, image_low_detail_tokens=64,
                          max_images_per_request=3, max_image_pixels=4_000_000, max_input_tokens=600)


def png_bytes(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height and whose pixel data is garbage: only decoding fails."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"not zlib data")


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(*images: dict, text: str = "What is this?", **fields) -> ChatCompletionRequest:
    content = [*({"type": "image_url", "image_url": im} for im in images), {"type": "text", "text": text}]
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": content}], **fields)


def test_detail_and_max_visual_tokens_shrink_images_and_tokenize_equals_the_engine_prompt(processor) -> None:
    img = url(png_bytes(800, 600))
    req = chat({"url": img}, {"url": img, "detail": "low"}, {"url": img, "max_visual_tokens": 20})
    count = processor.count(to_chat_prompt(req.messages))
    assert [(im.num_tokens, im.budget_tokens) for im in count.images] == [(234, 256), (54, 64), (15, 20)]
    engine_request = process(processor, req, "r")
    assert engine_request.prompt_token_ids == count.token_ids
    assert [im.num_tokens for im in engine_request.images] == [234, 54, 15]


def test_a_budget_above_the_cap_is_refused_naming_the_field(processor) -> None:
    with pytest.raises(InputError, match="max_visual_tokens=257 is above this server's cap of 256") as err:
        processor.count(to_chat_prompt(chat({"url": url(png_bytes(64, 64))}, {"url": "x", "max_visual_tokens": 257}).messages))
    assert err.value.param == "messages[0].content[1].image_url.max_visual_tokens"


def test_the_input_token_limit_is_checked_from_headers_before_decoding(processor) -> None:
    # Three 560x560 headers with no pixel data: counting needs only the header, and the limit fires first.
    blob = url(header_only_png(560, 560))
    with pytest.raises(InputError) as err:
        process(processor, chat({"url": blob}, {"url": blob}, {"url": blob}), "r")
    message = str(err.value)
    assert "3 images of 256, 256, 256 visual tokens" in message and "at most 600 input tokens" in message
    assert "detail=low" in message and err.value.param == "messages"
    # Under the limit, the missing pixels are found when decoding.
    with pytest.raises(ImageInputError, match="truncated or corrupt"):
        process(processor, chat({"url": blob, "detail": "low"}), "r")


def test_text_over_the_input_limit_says_to_shorten_it(processor) -> None:
    with pytest.raises(InputError, match=r"the prompt has \d+ tokens \(\d+ text and template tokens\).*600.*shorten"):
        process(processor, chat(text="word " * 700), "r")


def test_prompt_plus_max_tokens_over_the_context_says_how_much_room_is_left(processor) -> None:
    req = chat({"url": url(png_bytes(100, 100))}, max_tokens=2040)
    with pytest.raises(InputError, match=r"you requested \d+ \(\d+ in the prompt: \d+ text .* \+ 1 image of 16 "
                       r"visual tokens; 2040 for the output\)\. Reduce max_tokens to at most \d+") as err:
        process(processor, req, "r")
    assert err.value.param == "max_tokens"


def test_too_many_images_are_counted_before_any_is_loaded(processor) -> None:
    with pytest.raises(InputError, match="too many images: 4 in this request, the limit is 3.*send at most 3"):
        processor.count(to_chat_prompt(chat(*[{"url": "data:,not-even-an-image"}] * 4).messages))


def test_image_pixels_are_refused_from_the_header(processor) -> None:
    big = url(header_only_png(3000, 2000))
    with pytest.raises(ImageInputError, match=r"image 2 of 2: .*3000x2000 = 6000000 pixels; the limit is 4000000.*"
                       "downscale") as err:
        processor.count(to_chat_prompt(chat({"url": url(png_bytes(8, 8))}, {"url": big}).messages))
    assert err.value.code == "image_too_large"


@pytest.mark.parametrize(("bad", "reason"), [
    ("data:image/png;base64,!!", "image data URL is not valid base64"),  # refused while loading its bytes
    (url(header_only_png(3000, 2000)), "3000x2000 = 6000000 pixels"),  # from its header
    (url(header_only_png(56, 56)), "image data is truncated or corrupt"),  # while decoding
], ids=["load", "header", "decode"])
def test_a_refused_image_is_named_by_its_field_and_place_whatever_the_stage(processor, bad: str, reason: str) -> None:
    """Found by the API fuzz: of two images, a bad second one was refused as 'image data URL is not valid base64',
    param 'messages': the client could not tell which image to fix. Every stage now names it."""
    with pytest.raises(ImageInputError, match=f"^image 2 of 2: .*{reason}") as err:
        process(processor, chat({"url": url(png_bytes(8, 8))}, {"url": bad}), "r")
    assert err.value.param == "messages[0].content[1].image_url"


def test_aspect_ratio_over_200_is_refused_and_200_is_served(processor) -> None:
    assert processor.count(to_chat_prompt(chat({"url": url(header_only_png(5600, 28))}).messages)).images[0].num_tokens == 200
    with pytest.raises(ImageInputError, match="aspect ratio 201.0:1; this model accepts at most 200:1"):
        processor.count(to_chat_prompt(chat({"url": url(header_only_png(28, 5628))}).messages))
