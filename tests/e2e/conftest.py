"""A real firsttoken server (uvicorn on a loopback port, engine thread, tiny checkpoint, float32) per session."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from PIL import Image, ImageDraw

from firsttoken.api.http_protocol import LingerBounds, header_timeout_protocol
from firsttoken.cli.serve import build_server, serve_config


class HoldEngine:
    """A fault hook that holds the engine thread inside the first request's encode stage until released: a
    prefill in progress, for tests that check what happens meanwhile (by order of events, not by timing)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, stage: str, request_id: str) -> None:
        if stage == "encode" and not self.release.is_set():
            self.entered.set()
            assert self.release.wait(60)


@dataclass
class LiveServer:
    base_url: str
    model: str
    engine: object  # AsyncEngine, for the fault-injection tests only

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kw)

    def stats(self) -> dict:
        return httpx.get(f"{self.base_url}/v1/engine/stats").json()

    def wait_idle(self, timeout_s: float = 20.0) -> dict:
        """Poll until nothing runs or waits and no KV block is referenced (by order, not by timing)."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.stats()
            if s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"engine did not return to idle: {s}")
            time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model_dir: Path, fault_hook=None, media_network=None, linger: LingerBounds = LingerBounds(), **overrides
) -> tuple[LiveServer, uvicorn.Server, threading.Thread]:
    """A server on a free loopback port, run as `serve` runs it; `linger` replaces the bounds of its lingering
    close (`serve` uses LingerBounds' defaults), so a test can pass the byte bound with a few MiB."""
    port = _free_port()
    # step_time_target off: steps budgeted in tokens, so the tests that assert the order of events do not depend on
    # this machine's speed (time-bounded steps are tested with a fixed cost model in tests/unit/test_time_bound.py,
    # and through the server in test_slo.py)
    options = dict(model=str(model_dir), dtype="float32", port=port, kv_cache_memory=16 * 2**20,
                   max_batched_tokens=256, served_model_name="tiny", step_time_target="off")
    config = serve_config(**{**options, **overrides})
    app, engine = build_server(config, fault_hook=fault_hook, media_network=media_network)
    engine.start()
    protocol = header_timeout_protocol(config.server.request_header_timeout_s, linger)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",  # as serve runs it:
                                           http=protocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    return LiveServer(base, "tiny", engine), server, thread


def stop_server(server: uvicorn.Server, thread: threading.Thread, engine) -> None:
    server.should_exit = True
    thread.join(10)
    engine.shutdown()


@pytest.fixture(scope="session")
def live_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    live, server, thread = start_server(tiny_model_dir)
    yield live
    stop_server(server, thread, live.engine)


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic picture with real structure (gradient, shapes, text)."""
    img = Image.new("RGB", (width, height), (seed * 37 % 256, 90, 160))
    draw = ImageDraw.Draw(img)
    for i in range(0, max(width, height), 12):
        draw.line([(i, 0), (0, i)], fill=((i * 5 + seed * 11) % 256, (i * 3) % 256, 200 - i % 200), width=3)
    draw.rectangle([width // 5, height // 5, width // 2, height // 2], outline=(255, 255, 0), width=4)
    draw.text((4, 4), f"firsttoken {seed}", fill=(255, 255, 255))
    return img


def image_data_url(img: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    mime = "png" if fmt == "PNG" else "jpeg"
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def transformers_answer(model_dir: Path, prompt_ids: list[int], images: list[Image.Image], max_new_tokens: int,
                        max_patches: int | None = None) -> tuple[str, int]:
    """(decoded text, number of tokens) that transformers' generate answers: the checkpoint's family's reference
    class (its recipe's), its image processor as the checkpoint configures it, greedy with the sampling settings of
    generation_config.json (repetition_penalty among them), as the server applies them. The processor is its PIL
    backend, the pixels the server computes bit for bit; the torchvision backend, transformers' default where
    torchvision is installed (the GPU machine), resizes differently. ``max_patches``: a tiling family's, as the
    server planned its images."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    from firsttoken.models.registry import family_of

    model = family_of(model_dir).checkpoint.hf_model_class().from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = torch.tensor([prompt_ids])
    if max_patches is not None:  # a tiling family: its tiles alone, cut as InternVLProcessor cuts them
        tiles = AutoImageProcessor.from_pretrained(model_dir, backend="pil", crop_to_patches=True,
                                                   max_patches=max_patches)(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=tiles["pixel_values"])
    else:
        pixels = AutoImageProcessor.from_pretrained(model_dir, backend="pil")(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                      mm_token_type_ids=(input_ids == model.config.image_token_id).long())
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, **kwargs, max_new_tokens=max_new_tokens,
                             do_sample=False)[0, input_ids.shape[1]:]
    return AutoTokenizer.from_pretrained(model_dir).decode(out, skip_special_tokens=True), len(out)


def internvl_prompt_ids(model_dir: Path, messages: list[dict], images: list[Image.Image], max_patches: int) -> list[int]:
    """The prompt transformers' InternVLProcessor makes of an OpenAI conversation (image_url parts as the chat
    template's image parts): the checkpoint's chat template, then its own <img> + pads + </img> in place of each
    <IMG_CONTEXT>, tiles cut by the image processor's PIL backend at ``max_patches`` (the server's pixels)."""
    from transformers import AutoImageProcessor, AutoTokenizer, InternVLProcessor

    class ImagesOnly(InternVLProcessor):
        """Without a video processor: transformers' video processors need torchvision, which not every machine
        running the tests has; images never touch it."""

        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tiles = AutoImageProcessor.from_pretrained(model_dir, backend="pil", crop_to_patches=True, max_patches=max_patches)
    tokens_per_tile = json.loads((Path(model_dir) / "config.json").read_text())["image_seq_length"]
    processor = ImagesOnly(image_processor=tiles, tokenizer=tokenizer, video_processor=None,
                           image_seq_length=tokens_per_tile)
    conversation = [{**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
                    if isinstance(m["content"], list) else m for m in messages]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return processor(images=images, text=[text], return_tensors="pt")["input_ids"][0].tolist()


def image_message(text: str, *images: Image.Image) -> list[dict]:
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": image_data_url(im)}} for im in images]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]
