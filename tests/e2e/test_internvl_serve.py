"""A tiny InternVL3.5 checkpoint served end to end: `firsttoken serve --model DIR` (a real subprocess) answers the
README's image example through the official openai client as transformers' greedy generate does; budgets buy tiles
(256 tokens each, a thumbnail beside more than one) in /tokenize, the usage block and `firsttoken tokens --model`,
as many as transformers' own processor cuts at the budget's max_patches; a budget under one tile and a video are
refused before any work; the long lane splits a big tiling's encode across steps while a short question is answered
first."""

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
from firsttoken.models.internvl_checkpoint import IMAGE_TOKEN_IDS
from firsttoken.tools.regress import data_url
from tests.e2e.conftest import (
    LiveServer,
    image_message,
    internvl_prompt_ids,
    make_image,
    start_server,
    stop_server,
    transformers_answer,
)
from tests.e2e.test_lanes_e2e import assert_short_answered_first
from tests.e2e.test_qwen3_vl_serve import readme_example
from tests.e2e.test_shutdown import _serve

IMAGE_PAD = IMAGE_TOKEN_IDS["image_token_id"]  # <IMG_CONTEXT>
FAMILY_DEFAULT = 13 * 256  # 12 tiles and the thumbnail


@pytest.fixture(scope="module")
def internvl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("internvl-tiny"), size="tiny", seed=0, family="internvl3.5")


@pytest.fixture(scope="module")
def live(internvl_dir: Path) -> Iterator[LiveServer]:
    # the family's own default rung (the operator's cap above it)
    server, uvicorn_server, thread = start_server(internvl_dir, max_batched_tokens=4096, image_max_tokens=4096,
                                                  kv_cache_memory=64 * 2**20)
    yield server
    stop_server(uvicorn_server, thread, server.engine)


def reference_tiles(model_dir: Path, images: list[Image.Image], max_patches: int) -> list[int]:
    """Tiles per image as transformers' processor cuts them (its PIL backend, cropping as InternVLProcessor asks)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil", crop_to_patches=True,
                                                   max_patches=max_patches)
    return [int(n) for n in processor(images=images, return_tensors="pt")["num_patches"]]


def test_serve_subprocess_answers_the_readme_image_example_as_transformers_does(internvl_dir: Path):
    image, messages = readme_example()
    proc, base = _serve(internvl_dir, "--max-batched-tokens", "512")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=32, temperature=0.0)
        tokens = httpx.post(f"{base}/tokenize", json={"model": "tiny", "messages": messages}).json()
    finally:
        proc.terminate()
        proc.wait(30)
    assert tokens["images"][0]["num_tokens"] == 256  # a 448 x 448 square is one tile, no thumbnail
    assert tokens["tokens"].count(IMAGE_PAD) == 256 and out.usage.prompt_tokens == tokens["count"]
    assert out.choices[0].message.content
    # serve's default cap (1280 tokens) allows 4 tiles; transformers' InternVLProcessor writes <img>, </img> itself
    reference_ids = internvl_prompt_ids(internvl_dir, messages, [image], 4)
    assert tokens["tokens"] == reference_ids
    assert out.choices[0].message.content == transformers_answer(internvl_dir, reference_ids, [image], 32, 4)[0]


def test_budgets_buy_tiles_as_transformers_cuts_them(live: LiveServer, internvl_dir: Path):
    square, photo = make_image(1024, 1024, seed=1), make_image(600, 400, seed=2)
    messages = image_message("Compare.", square, photo)
    tokens = httpx.post(f"{live.base_url}/tokenize", json={"model": "tiny", "messages": messages}).json()
    tiles = reference_tiles(internvl_dir, [square, photo], 12)
    assert tiles == [10, 7]  # 3 x 3 and 3 x 2, each with its thumbnail
    assert [im["num_tokens"] for im in tokens["images"]] == [256 * n for n in tiles]
    text_only = httpx.post(f"{live.base_url}/tokenize", json={"model": "tiny", "messages": image_message("Compare.")})
    # + <img>, </img> and the template's newline after each image
    assert tokens["count"] == text_only.json()["count"] + 256 * sum(tiles) + 3 * 2
    out = live.client().chat.completions.create(model=live.model, messages=messages, max_tokens=2, temperature=0.0)
    assert out.usage.prompt_tokens == tokens["count"]
    # a request asks for less: 1,280 tokens allow 4 tiles (2 x 2 and the thumbnail for the square), 767 one
    for budget, max_patches in ((1280, 4), (767, 1)):
        parts = [{"type": "image_url", "image_url": {"url": m["image_url"]["url"], "max_visual_tokens": budget}}
                 for m in messages[0]["content"][:2]]
        asked = [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare."}]}]
        got = httpx.post(f"{live.base_url}/tokenize", json={"model": "tiny", "messages": asked}).json()
        expected = reference_tiles(internvl_dir, [square, photo], max_patches)
        assert [im["num_tokens"] for im in got["images"]] == [256 * n for n in expected]
    assert expected == [1, 1]
    live.wait_idle()


def test_under_one_tile_and_videos_are_refused_naming_the_part(live: LiveServer):
    client = live.client()
    image = image_message("What?", make_image(640, 480, seed=3))
    image[0]["content"][0]["image_url"]["max_visual_tokens"] = 255
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=live.model, messages=image, max_tokens=2)
    assert "256" in err.value.message and err.value.body["param"] == "messages[0].content[0].image_url"
    clip = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                                         {"type": "text", "text": "What happens?"}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=live.model, messages=clip, max_tokens=2)
    assert "video" in err.value.message and err.value.body["param"] == "messages[0].content[0].video_url"
    out = client.chat.completions.create(model=live.model, messages=image_message("Still here?"), max_tokens=2)
    assert out.choices[0].finish_reason == "length"  # the server kept serving


def test_regress_and_tokenize_report_tiles_per_budget(live: LiveServer, tmp_path: Path) -> None:
    """What an operator reads when choosing a rung: /tokenize's tile grid, and regress's tiles per image beside the
    tokens (a 3:1 photo: 1x3 crops and the thumbnail at 1,024 tokens, one tile at 256)."""
    from firsttoken.tools.regress import ChatServer, format_report, run_regress

    wide = tmp_path / "wide.png"
    Image.new("RGB", (1344, 448), (90, 20, 200)).save(wide)
    server = ChatServer(live.base_url, max_tokens=2)
    try:
        report = run_regress(server, [wide], ["Describe."], [1024, 256])
        counted = server._post("/tokenize", {"model": server.model, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(wide), "max_visual_tokens": 1024}}]}]})
    finally:
        server.close()
    assert [(b.budget, b.mean_visual_tokens, b.mean_tiles) for b in report.budgets] == [(1024, 1024, 4), (256, 256, 1)]
    assert "tiles/img" in format_report(report).splitlines()[0]
    assert counted["images"][0]["tile_grid"] == [1, 3] and counted["images"][0]["num_tiles"] == 4


def test_tokens_cli_counts_tiles(internvl_dir: Path, tmp_path: Path, capsys) -> None:
    square, photo = tmp_path / "square.png", tmp_path / "photo.jpg"
    Image.new("RGB", (1024, 1024)).save(square)
    Image.new("RGB", (2048, 1536)).save(photo)
    images = [Image.new("RGB", (1024, 1024)), Image.new("RGB", (2048, 1536))]
    args = ["tokens", str(square), str(photo), "--model", str(internvl_dir)]
    assert cli_main([*args, "--image-max-tokens", str(FAMILY_DEFAULT), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["images"]
    expected = reference_tiles(internvl_dir, images, 12)
    assert expected == [10, 13]  # 3 x 3 + 1 and 4 x 3 + 1
    assert [r["num_tokens"] for r in rows] == [256 * n for n in expected]
    assert [r["resized_size"] for r in rows] == [[1344, 1344], [1792, 1344]]
    assert cli_main([*args, "--json"]) == 0  # serve's default cap, 1280 tokens: at most 4 tiles
    rows = json.loads(capsys.readouterr().out)["images"]
    assert [r["num_tokens"] for r in rows] == [256 * n for n in reference_tiles(internvl_dir, images, 4)]


def test_short_question_is_answered_while_a_split_encode_runs_in_the_long_lane(internvl_dir: Path):
    # 64 tokens of long-lane work per step; a tile through the tower costs 256 tokens, so the square's 10 tiles are
    # encoded a unit per step, and its ~2,600-token prefill takes dozens of steps
    server, uvicorn_server, thread = start_server(internvl_dir, max_batched_tokens=256, long_step_tokens=64,
                                                  long_prompt_threshold=512, image_max_tokens=FAMILY_DEFAULT,
                                                  kv_cache_memory=64 * 2**20)
    try:
        assert_short_answered_first(server, image_message("Describe every detail.", make_image(1024, 1024, seed=12)))
    finally:
        stop_server(uvicorn_server, thread, server.engine)


def test_serve_refuses_a_cap_under_one_tile_before_loading(internvl_dir: Path) -> None:
    from tests.unit.test_cli_errors import error_line, firsttoken

    assert error_line(firsttoken("serve", "--model", str(internvl_dir), "--image-max-tokens", "200")) == (
        "firsttoken serve: --image-max-tokens 200: under one tile: this model's images cost at least 256 tokens")


def test_tools_and_structured_outputs_over_an_image_as_for_qwen(live: LiveServer) -> None:
    """The family's tool calls are Hermes-style <tool_call> JSON in its Qwen-based template, parsed as Qwen's: a named
    tool choice over a photo gives that call, valid for its schema by construction; a JSON schema response too."""
    from tests.e2e.test_tools import TOOLS, check_calls

    image, _ = readme_example()
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    ask = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "What's the weather where this was taken?"}]}]
    client = live.client()
    out = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, max_tokens=60, temperature=1.0,
                                         seed=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]
    check_calls(out.choices[0].message.tool_calls)
    schema = {"type": "object", "properties": {"tiles": {"type": "integer"}}, "required": ["tiles"],
              "additionalProperties": False}
    out = client.chat.completions.create(model="tiny", messages=ask, max_tokens=40, temperature=1.0, seed=1,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "t", "schema": schema}})
    assert out.choices[0].finish_reason == "stop"
    assert set(json.loads(out.choices[0].message.content)) == {"tiles"}
