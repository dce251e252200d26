"""A tiny Qwen3-VL checkpoint served end to end: `firsttoken serve --model DIR` (a real subprocess) answers the
README's image example through the official openai client as transformers' greedy generate does; token counts
follow the checkpoint's 16-px patches (32 px per visual token) in /tokenize, the usage block and `firsttoken tokens
--model`, equal to what transformers' own processor makes; the long lane splits a big image's encode across steps
while a short question is answered first."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from firsttoken.cli.main import main as cli_main
from firsttoken.models.checkpoint import make_model
from firsttoken.models.recipe import TOKEN_IDS
from tests.e2e.conftest import LiveServer, image_message, make_image, start_server, stop_server, transformers_answer
from tests.e2e.test_lanes_e2e import assert_short_answered_first
from tests.e2e.test_shutdown import _serve

IMAGE_PAD = TOKEN_IDS["<|image_pad|>"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("qwen3-vl-tiny"), size="tiny", seed=0, family="qwen3-vl")


@pytest.fixture(scope="module")
def live(qwen3_dir: Path) -> Iterator[LiveServer]:
    server, uvicorn_server, thread = start_server(qwen3_dir, max_batched_tokens=2048)
    yield server
    stop_server(uvicorn_server, thread, server.engine)


def reference_pixels(model_dir: Path, images: list[Image.Image], max_pixels: int | None = None) -> dict:
    """transformers' image processor as the checkpoint configures it (Qwen2VLImageProcessorPil at 16 px), with
    its longest_edge (max pixels) replaced when given."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    if max_pixels is not None:
        processor = AutoImageProcessor.from_pretrained(
            model_dir, backend="pil", size={"shortest_edge": processor.size.shortest_edge, "longest_edge": max_pixels})
    return processor(images=images, return_tensors="pt")


def readme_example() -> tuple[Image.Image, list[dict]]:
    """The README's request: a 448 x 448 red square and "What colour is this?"."""
    image = Image.new("RGB", (448, 448), (200, 40, 40))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return image, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "What colour is this?"}]}]


def test_serve_subprocess_answers_the_readme_image_example_as_transformers_does(qwen3_dir: Path):
    image, messages = readme_example()
    proc, base = _serve(qwen3_dir, "--max-batched-tokens", "256")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=32, temperature=0.0)
        tokens = httpx.post(f"{base}/tokenize", json={"model": "tiny", "messages": messages}).json()
    finally:
        proc.terminate()
        proc.wait(30)
    assert tokens["images"][0]["num_tokens"] == 14 * 14  # 448 px / 32 px per visual token, squared
    assert tokens["tokens"].count(IMAGE_PAD) == 196 and out.usage.prompt_tokens == tokens["count"]
    assert out.choices[0].message.content
    assert out.choices[0].message.content == transformers_answer(qwen3_dir, tokens["tokens"], [image], 32)[0]


def test_tokenize_and_usage_count_32_px_per_visual_token_as_transformers_does(live: LiveServer, qwen3_dir: Path):
    square, photo = make_image(1024, 1024, seed=1), make_image(600, 400, seed=2)
    messages = image_message("Compare.", square, photo)
    tokens = httpx.post(f"{live.base_url}/tokenize", json={"model": "tiny", "messages": messages}).json()
    expected = [int(g.prod()) // 4 for g in reference_pixels(qwen3_dir, [square, photo])["image_grid_thw"]]
    assert expected == [1024, 228]  # 32 x 32 and 19 x 12 (600 x 400 resized to 608 x 384); Qwen2-VL: 1369 and 294
    assert [im["num_tokens"] for im in tokens["images"]] == expected
    assert tokens["tokens"].count(IMAGE_PAD) == sum(expected)
    text_only = httpx.post(f"{live.base_url}/tokenize", json={"model": "tiny", "messages": image_message("Compare.")})
    assert tokens["count"] == text_only.json()["count"] + sum(expected) + 2 * 2  # + vision start/end per image
    out = live.client().chat.completions.create(model=live.model, messages=messages, max_tokens=2, temperature=0.0)
    assert out.usage.prompt_tokens == tokens["count"]
    live.wait_idle()


def test_tokens_cli_follows_the_checkpoint_geometry(qwen3_dir: Path, tmp_path: Path, capsys) -> None:
    square, photo = tmp_path / "square.png", tmp_path / "photo.jpg"
    Image.new("RGB", (1024, 1024)).save(square)
    Image.new("RGB", (2048, 1536)).save(photo)
    images = [Image.new("RGB", (1024, 1024)), Image.new("RGB", (2048, 1536))]
    args = ["tokens", str(square), str(photo), "--model", str(qwen3_dir)]
    assert cli_main([*args, "--image-max-tokens", "16384", "--json"]) == 0
    unbudgeted = json.loads(capsys.readouterr().out)
    expected = [int(g.prod()) // 4 for g in reference_pixels(qwen3_dir, images)["image_grid_thw"]]
    assert [r["num_tokens"] for r in unbudgeted["images"]] == expected == [1024, 3072]  # Qwen2-VL: 1369, 4015
    assert cli_main([*args, "--json"]) == 0  # the server's default budget: 1280 visual tokens per image
    budgeted = json.loads(capsys.readouterr().out)
    # transformers at the largest max_pixels within the budget (1280 x 32^2) makes the same sizes
    expected = [int(g.prod()) // 4 for g in reference_pixels(qwen3_dir, images, 1280 * 32 * 32)["image_grid_thw"]]
    assert [r["num_tokens"] for r in budgeted["images"]] == expected == [1024, 1230]
    assert [r["resized_size"] for r in budgeted["images"]] == [[1024, 1024], [1312, 960]]


def test_short_question_is_answered_while_a_split_encode_runs_in_the_long_lane(qwen3_dir: Path):
    # 64 tokens of long-lane work per step; a 1024 x 1024 image costs 1024 tokens per vision block, so its
    # encode takes one block per step, and its ~1,100-token prefill dozens of steps
    server, uvicorn_server, thread = start_server(qwen3_dir, max_batched_tokens=256, long_step_tokens=64,
                                                  long_prompt_threshold=512)
    try:
        assert_short_answered_first(server, image_message("Describe every detail.", make_image(1024, 1024, seed=12)))
    finally:
        stop_server(uvicorn_server, thread, server.engine)
