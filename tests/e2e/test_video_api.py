"""Video through the real server, per family: the official openai client's answer to a text + video and a video + image
prompt equals transformers' greedy generate on the same weights (fp32), with prefill steps that cut inside the video;
/tokenize counts the video from its header exactly as the engine sees it; a follow-up question on the same clip
encodes nothing and reuses the prompt's KV; the metrics carry a "video" class.

The oracle's inputs: the prompt ids /tokenize returns, and pixel values from firsttoken's decode + video_pixel_values
(bit-identical to transformers' video processors given the same frames: tests/unit/test_video_pixels.py, against
fixtures recorded with them), so transformers computes its own positions (get_rope_index) and its own vision tower.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from firsttoken.config import VideoConfig
from firsttoken.inputs.video import load_video
from firsttoken.inputs.video_pixels import video_pixel_values
from firsttoken.inputs.video_synth import make_clip
from firsttoken.models.checkpoint import make_model
from firsttoken.models.registry import load_model_config
from tests.e2e.conftest import LiveServer, image_data_url, make_image, start_server, stop_server

FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")
MAX_NEW_TOKENS = 6


def clip(seconds: float = 2.0) -> bytes:
    return make_clip(seconds, 96, 64, fps=10, gop=5)


def video_part(data: bytes, **extra) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return {"type": "video_url", "video_url": {"url": url, **extra}}


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp(request.param), size="tiny", seed=0, family=request.param)


@pytest.fixture(scope="module")
def live(family_dir: Path) -> Iterator[LiveServer]:
    # 48-token steps: the prefill of every prompt here is cut inside its video's tokens
    server, uvicorn_server, thread = start_server(family_dir, max_batched_tokens=48)
    yield server
    stop_server(uvicorn_server, thread, server.engine)


def post(live: LiveServer, path: str, body: dict) -> dict:
    r = httpx.post(f"{live.base_url}{path}", json={"model": live.model, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def transformers_video_answer(model_dir: Path, prompt_ids: list[int], video: bytes, images=()) -> tuple[str, int]:
    """transformers' greedy generate (its own positions, its own towers) on the server's prompt ids and pixels."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    from firsttoken.models.registry import family_of

    config = load_model_config(model_dir)
    proc = config.image_processor
    loaded = load_video(video, VideoConfig(), proc)
    pixels, grid = video_pixel_values(loaded.video.frames, proc)
    model = family_of(model_dir).checkpoint.hf_model_class().from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    kwargs: dict = dict(pixel_values_videos=pixels, video_grid_thw=torch.tensor([grid]))
    if "qwen2_5" in type(model).__module__:
        kwargs["second_per_grid_ts"] = torch.tensor([loaded.plan.seconds_per_grid])
    if images:
        image_inputs = AutoImageProcessor.from_pretrained(model_dir, backend="pil")(images=list(images),
                                                                                   return_tensors="pt")
        kwargs.update(pixel_values=image_inputs["pixel_values"], image_grid_thw=image_inputs["image_grid_thw"])
    types = (ids == config.image_token_id).long() + 2 * (ids == config.video_token_id).long()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, mm_token_type_ids=types, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             **kwargs)
    new = out[0, ids.shape[1]:]
    return AutoTokenizer.from_pretrained(model_dir).decode(new, skip_special_tokens=True), len(new)


def answer(live: LiveServer, messages: list[dict]) -> tuple[tuple[str, int], dict]:
    """((text, completion tokens), usage) of a greedy answer through the official openai client."""
    out = live.client().chat.completions.create(model=live.model, messages=messages, max_tokens=MAX_NEW_TOKENS,
                                                temperature=0)
    usage = out.usage.model_dump()
    return (out.choices[0].message.content, out.usage.completion_tokens), usage


@pytest.mark.parametrize("with_image", [False, True], ids=["text+video", "video+image"])
def test_video_answers_as_transformers_does(live: LiveServer, family_dir: Path, with_image: bool) -> None:
    data = clip()
    image = make_image(320, 256)  # above every family processor's default minimum size (Qwen3-VL's: 65,536 pixels)
    parts = [video_part(data)] + ([{"type": "image_url", "image_url": {"url": image_data_url(image)}}]
                                  if with_image else [])
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens in this clip?"}]}]
    counted = post(live, "/tokenize", {"messages": messages})
    (video,) = counted["videos"]
    assert video["source_frames"] == 20 and video["num_frames"] == 4  # 2 s at 10 fps, sampled at 2 fps
    assert counted["num_text_tokens"] + video["num_tokens"] + sum(i["num_tokens"] for i in counted["images"]) \
        == counted["count"]
    got, usage = answer(live, messages)
    assert usage["prompt_tokens"] == counted["count"]
    assert got == transformers_video_answer(family_dir, counted["tokens"], data, [image] if with_image else [])


def test_a_follow_up_on_the_same_clip_encodes_nothing_and_reuses_the_prompt(live: LiveServer) -> None:
    data = clip(3.0)
    first = [{"role": "user", "content": [video_part(data), {"type": "text", "text": "Describe it."}]}]
    answer(live, first)
    before = httpx.get(f"{live.base_url}/v1/engine/stats").json()
    _, usage = answer(live, first)
    after = httpx.get(f"{live.base_url}/v1/engine/stats").json()
    assert after["num_images_encoded"] == before["num_images_encoded"]  # every grid from the encoder cache
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0.8 * usage["prompt_tokens"]


def test_a_request_may_ask_for_less_video_never_more(live: LiveServer) -> None:
    data = clip(4.0)
    full = post(live, "/tokenize", {"messages": [{"role": "user", "content": [video_part(data)]}]})["videos"][0]
    fewer = post(live, "/tokenize", {"messages": [{"role": "user", "content": [
        video_part(data, fps=1.0)]}]})["videos"][0]
    assert (full["num_frames"], fewer["num_frames"]) == (8, 4)
    assert fewer["num_tokens"] == full["num_tokens"] // 2
    r = httpx.post(f"{live.base_url}/v1/chat/completions", json={"model": live.model, "messages": [
        {"role": "user", "content": [video_part(data, fps=30.0)]}]}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].content[0].video_url.fps"


def test_a_video_given_as_frames_is_served(live: LiveServer) -> None:
    frames = [image_data_url(make_image(64, 48, seed=k)) for k in range(3)]
    messages = [{"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "Go"}]}]
    (video,) = post(live, "/tokenize", {"messages": messages})["videos"]
    assert (video["source_frames"], video["num_frames"]) == (3, 4)  # an odd list is padded with its last frame
    (_, num_tokens), usage = answer(live, messages)
    assert num_tokens >= 1 and usage["prompt_tokens"] > video["num_tokens"]


def test_metrics_carry_a_video_class(live: LiveServer) -> None:
    answer(live, [{"role": "user", "content": [video_part(clip()), {"type": "text", "text": "Hi"}]}])
    text = httpx.get(f"{live.base_url}/metrics").text
    assert 'images="video"' in text
