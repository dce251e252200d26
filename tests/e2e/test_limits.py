"""Budgets and limits through the real server: /tokenize counts what the engine prefills, every limit answers
with its status and the counted numbers, and a refused request leaves no trace in the engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from tests.e2e.conftest import (
    LiveServer,
    image_data_url,
    make_image,
    start_server,
    stop_server,
)

CAP, LOW, MAX_IMAGES, MAX_PIXELS, MAX_INPUT, MAX_BODY = 64, 16, 3, 1_000_000, 400, 2 * 2**20


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Path) -> Iterator[LiveServer]:
    live, server, thread = start_server(
        tiny_model_dir,
        image_max_tokens=CAP,
        image_low_detail_tokens=LOW,
        max_images_per_request=MAX_IMAGES,
        max_image_pixels=MAX_PIXELS,
        max_input_tokens=MAX_INPUT,
        max_request_bytes=MAX_BODY,
    )
    yield live
    stop_server(server, thread, live.engine)


def part(img: Image.Image, **fields) -> dict:
    return {"type": "image_url", "image_url": {"url": image_data_url(img), **fields}}


def messages(*parts: dict, text: str = "Describe.") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def tokenize(live: LiveServer, msgs: list[dict]) -> dict:
    r = httpx.post(f"{live.base_url}/tokenize", json={"model": live.model, "messages": msgs})
    assert r.status_code == 200, r.text
    return r.json()


SIZES = [(1, 1), (10, 10), (27, 29), (56, 56), (64, 48), (300, 200), (640, 480), (1000, 30), (30, 1000),
         (5600, 28), (28, 5600), (997, 13)]


def test_tokenize_count_equals_the_prompt_the_engine_prefilled_for_many_shapes(limited: LiveServer) -> None:
    client = limited.client()
    cases = [messages(part(make_image(w, h, seed=i))) for i, (w, h) in enumerate(SIZES)]
    cases += [
        messages(part(make_image(900, 700), detail="low"), part(make_image(200, 900), max_visual_tokens=10)),
        messages(part(make_image(120, 90), detail="high"), part(make_image(48, 640)), text="Compare " * 20),
    ]
    for msgs in cases:
        counted = tokenize(limited, msgs)
        out = client.chat.completions.create(model=limited.model, messages=msgs, max_tokens=1, temperature=0.0)
        assert out.usage.prompt_tokens == counted["count"], counted["images"]
        for im, p in zip(counted["images"], [p for p in msgs[0]["content"] if p["type"] == "image_url"]):
            fields = p["image_url"]
            expected_budget = min(CAP, LOW if fields.get("detail") == "low" else CAP, fields.get("max_visual_tokens", CAP))
            assert im["budget_tokens"] == expected_budget and 1 <= im["num_tokens"] <= expected_budget
            w, h = im["resized_size"]
            assert w % 28 == 0 and h % 28 == 0 and im["num_tokens"] == (w // 28) * (h // 28)
    assert tokenize(limited, cases[0])["max_input_tokens"] == MAX_INPUT
    limited.wait_idle()


def rejected(live: LiveServer, body: dict, status: int = 400) -> str:
    """POST body, assert the status and OpenAI's error shape, and that the engine never saw the request."""
    before = live.stats()
    body = {"model": live.model, "max_tokens": 1, **body}
    r = httpx.post(f"{live.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    after = live.stats()
    assert after["num_steps"] == before["num_steps"]  # no step ran for it: it never queued
    assert after["kv_blocks_used"] == after["num_running"] == after["num_waiting"] == 0
    return error["message"]


def test_each_limit_gives_its_status_and_the_counted_numbers(limited: LiveServer) -> None:
    limited.wait_idle()
    small = make_image(100, 80)
    msg = rejected(limited, {"messages": messages(*[part(small)] * 4)})
    assert "4 in this request" in msg and "send at most 3 images" in msg

    msg = rejected(limited, {"messages": messages(part(Image.new("RGB", (1250, 1000))))})
    assert "1250x1000 = 1250000 pixels; the limit is 1000000" in msg and "downscale" in msg

    msg = rejected(limited, {"messages": messages(part(small, max_visual_tokens=CAP + 1))})
    assert f"above this server's cap of {CAP}" in msg

    msg = rejected(limited, {"messages": messages(part(make_image(600, 600)), part(make_image(600, 600)), part(
        make_image(600, 600)), text="many words " * 150)})
    assert "3 images of 49, 49, 49 visual tokens" in msg and f"at most {MAX_INPUT} input tokens" in msg
    assert "detail=low" in msg

    msg = rejected(limited, {"messages": messages(part(small), text="word " * 500)})
    assert "text and template tokens + 1 image of" in msg and f"{MAX_INPUT} input tokens" in msg

    msg = rejected(limited, {"messages": messages(part(small)), "max_tokens": 10**6})
    assert "Reduce max_tokens to at most" in msg and "for the output" in msg

    msg = rejected(limited, {"messages": messages(part(Image.new("RGB", (5628, 28))))})
    assert "5628x28, aspect ratio 201.0:1" in msg and "at most 200:1" in msg

    msg = rejected(limited, {"messages": messages(text="x" * (MAX_BODY + 10))}, status=413)
    assert f"the limit is {MAX_BODY} bytes" in msg


def test_openai_client_sees_the_limit_as_a_bad_request(limited: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError, match="send at most 3 images"):
        limited.client().chat.completions.create(
            model=limited.model, messages=messages(*[part(make_image(60, 60))] * 5), max_tokens=1
        )
    limited.wait_idle()
