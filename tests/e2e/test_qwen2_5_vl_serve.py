"""`firsttoken serve --model <tiny Qwen2.5-VL>` as a user runs it (a real subprocess), through the official openai
client: the README's image example answers what transformers' generate answers, /tokenize counts exactly what is
prefilled under the visual-token budget, and a repeated image is neither encoded nor prefilled again."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from firsttoken.models.checkpoint import make_model
from tests.e2e.conftest import image_data_url, make_image, transformers_answer
from tests.e2e.test_shutdown import _serve

IMAGE_MAX_TOKENS = 300  # the README's 448x448 picture (256 tokens) fits; 1000x700 (~900) is resized to fit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("q25-serve"), size="tiny", seed=0, family="qwen2.5-vl")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[str]:
    proc, base = _serve(model_dir, "--image-max-tokens", str(IMAGE_MAX_TOKENS))
    yield base
    proc.terminate()
    proc.wait(60)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def readme_messages() -> list[dict]:
    """The README's example: a 448x448 red PNG and "What colour is this?"."""
    buf = io.BytesIO()
    Image.new("RGB", (448, 448), (200, 40, 40)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What colour is this?"}]}]


def tokenize(base: str, messages: list[dict]) -> dict:
    r = httpx.post(f"{base}/tokenize", json={"model": "tiny", "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()


def test_readme_image_example_answers_what_transformers_generates(server: str, model_dir: Path) -> None:
    messages = readme_messages()
    counted = tokenize(server, messages)
    out = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=32, temperature=0.0)
    assert out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == counted["count"]
    assert counted["images"][0]["num_tokens"] == 256  # 448 / 28 = 16 per side

    image = Image.new("RGB", (448, 448), (200, 40, 40))
    expected, num_tokens = transformers_answer(model_dir, counted["tokens"], [image], 32)
    assert out.choices[0].message.content == expected
    assert out.usage.completion_tokens == num_tokens


SHAPES = [(1, 1), (56, 56), (300, 200), (1000, 700), (30, 1000), (997, 13)]


@pytest.mark.parametrize("fields", [{}, {"detail": "low"}, {"max_visual_tokens": 40}])
def test_tokenize_counts_what_is_prefilled_within_the_budget(server: str, fields: dict) -> None:
    budget = min(IMAGE_MAX_TOKENS, fields.get("max_visual_tokens", IMAGE_MAX_TOKENS),
                 256 if fields.get("detail") == "low" else IMAGE_MAX_TOKENS)
    for i, (w, h) in enumerate(SHAPES):
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_data_url(make_image(w, h, seed=i)), **fields}},
            {"type": "text", "text": "Describe."}]}]
        counted = tokenize(server, messages)
        out = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0.0)
        assert out.usage.prompt_tokens == counted["count"]
        (image,) = counted["images"]
        rw, rh = image["resized_size"]
        assert image["budget_tokens"] == budget and 1 <= image["num_tokens"] <= budget
        assert rw % 28 == 0 and rh % 28 == 0 and image["num_tokens"] == (rw // 28) * (rh // 28)


def test_a_repeated_image_is_neither_encoded_nor_prefilled_again(server: str) -> None:
    picture = make_image(336, 224, seed=9)
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(picture)}},
                                          {"type": "text", "text": "What is in it?"}]}]
    a = client(server).chat.completions.create(model="tiny", messages=first, max_tokens=4, temperature=0.0)
    follow = first + [{"role": "assistant", "content": a.choices[0].message.content},
                      {"role": "user", "content": "And the colours?"}]
    b = client(server).chat.completions.create(model="tiny", messages=follow, max_tokens=4, temperature=0.0)
    timings_a, timings_b = a.usage.model_extra["firsttoken"], b.usage.model_extra["firsttoken"]
    assert timings_a["images_encoded"] == 1
    assert timings_b["images_encoded"] == 0
    assert timings_b["cached_prompt_tokens"] >= (a.usage.prompt_tokens // 16) * 16
