"""firsttoken serve vs the naive server a user would otherwise write (transformers generate, one at a time).

Same checkpoint (`small` by default), same prompts, same dtype on both sides (what `--dtype auto` picks here).
For concurrency N in (1, 4, 16), N requests
arrive together; we report mean / max TTFT and output tokens per second over the burst, text-only and 1-image
(1024x1024), and the ratios naive / firsttoken. Our server runs as a separate process (a real deployment); the naive
baseline runs in this process after the server has stopped, so the two never share the CPU.

    python benchmarks/bench_serve_vs_naive.py [--model DIR] [--max-tokens 32] [--concurrency 1,4,16]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from PIL import Image, ImageDraw

TEXT = ("Please describe the scene in detail, mention every object, its colour and position, and say what "
        "might happen next. ") * 4


def picture(size: int, seed: int) -> Image.Image:
    img = Image.new("RGB", (size, size), (seed * 40 % 256, 120, 200))
    d = ImageDraw.Draw(img)
    for i in range(0, size, 16):
        d.line([(i, 0), (size - i, size)], fill=((i + seed * 13) % 256, i % 200, 90), width=3)
    d.text((20, 20), f"sample {seed}", fill=(255, 255, 255))
    return img


def messages(kind: str, i: int) -> list[dict]:
    text = f"[{i}] " + TEXT
    if kind == "text":
        return [{"role": "user", "content": text}]
    buf = io.BytesIO()
    picture(1024, i).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


# ---- firsttoken ------------------------------------------------------------------------------------------
async def one_stream(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> tuple[float, int]:
    ttft, n = None, 0
    async with client.stream("POST", url, json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = ttft or time.perf_counter() - t0
    return ttft, n


async def burst_ours(base: str, kind: str, n: int, max_tokens: int, warm: int) -> dict:
    bodies = [{"model": "m", "messages": messages(kind, warm + i), "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}} for i in range(n)]
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*[one_stream(client, f"{base}/v1/chat/completions", b, t0) for b in bodies])
        wall = time.perf_counter() - t0
    return summarize([r[0] for r in res], sum(r[1] for r in res), wall)


def run_ours(model: str, kinds, levels, max_tokens: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "firsttoken.cli.main", "serve", "--model", model, "--port",
                             str(port), "--served-model-name", "m", "--log-level", "warning"])
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        asyncio.run(burst_ours(base, "image", 1, 4, 10_000))  # warm-up (distinct image: no cache reuse later)
        out = {}
        for kind in kinds:
            for n in levels:
                out[f"{kind}/{n}"] = asyncio.run(burst_ours(base, kind, n, max_tokens, 1000 * n))
                print(f"firsttoken {kind:5s} x{n:<3d} {fmt(out[f'{kind}/{n}'])}", flush=True)
        return out
    finally:
        proc.terminate()
        proc.wait(30)


# ---- the naive server --------------------------------------------------------------------------------------
class FirstTokenTimer:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first put is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_naive(model_dir: str, kinds, levels, max_tokens: int) -> dict:
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    from firsttoken.config import EngineConfig
    from firsttoken.engine.resolve import activation_dtype
    from firsttoken.loading.plan_values import TORCH_DTYPES

    dtype = TORCH_DTYPES[activation_dtype(EngineConfig())]  # what `firsttoken serve --dtype auto` picks: same math
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
    pad = model.config.image_token_id

    def serve_one(kind: str, i: int) -> tuple[float | None, int]:
        msgs = messages(kind, i)
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        kw = {}
        if kind == "image":
            px = proc(images=[picture(1024, i)], return_tensors="pt")
            n_img = int(px["image_grid_thw"][0].prod()) // 4
            text = text.replace("<|image_pad|>", "<|image_pad|>" * n_img)
            kw = {"pixel_values": px["pixel_values"].to(dtype), "image_grid_thw": px["image_grid_thw"]}
        ids = tok(text, return_tensors="pt")["input_ids"]
        timer = FirstTokenTimer()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, mm_token_type_ids=(ids == pad).long(), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, streamer=timer, **kw)
        return timer.first, out.shape[1] - ids.shape[1]

    serve_one("image", 10_000)  # warm-up
    out = {}
    for kind in kinds:
        for n in levels:
            t0 = time.perf_counter()
            ttfts, total = [], 0
            for i in range(n):  # one at a time, in arrival order: the rest wait
                first, count = serve_one(kind, 1000 * n + i)
                ttfts.append(first - t0)
                total += count
            out[f"{kind}/{n}"] = summarize(ttfts, total, time.perf_counter() - t0)
            print(f"naive      {kind:5s} x{n:<3d} {fmt(out[f'{kind}/{n}'])}", flush=True)
    return out


def summarize(ttfts, tokens: int, wall: float) -> dict:
    return {"ttft_mean_s": statistics.mean(ttfts), "ttft_max_s": max(ttfts), "output_tok_per_s": tokens / wall,
            "tokens": tokens, "wall_s": wall}


def fmt(r: dict) -> str:
    return (f"TTFT mean {r['ttft_mean_s']:.3f}s max {r['ttft_max_s']:.3f}s  out {r['output_tok_per_s']:.1f} tok/s "
            f"({r['tokens']} tok in {r['wall_s']:.1f}s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--kinds", default="text,image")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from firsttoken.models.checkpoint import make_model

        model = str(Path(os.environ.get("FIRSTTOKEN_CACHE", "/tmp")) / "bench-small")
        if not Path(model, "config.json").exists():
            make_model(model, size="small")
    levels = [int(x) for x in args.concurrency.split(",")]
    kinds = args.kinds.split(",")
    ours = run_ours(model, kinds, levels, args.max_tokens)
    naive = run_naive(model, kinds, levels, args.max_tokens)
    print("\nkind   conc | TTFT mean naive/ours | TTFT max naive/ours | out tok/s ours/naive")
    for key in ours:
        o, n = ours[key], naive[key]
        kind, conc = key.split("/")
        print(f"{kind:6s} {conc:>4s} | {n['ttft_mean_s'] / o['ttft_mean_s']:8.2f}x ({n['ttft_mean_s']:.2f}/"
              f"{o['ttft_mean_s']:.2f}s) | {n['ttft_max_s'] / o['ttft_max_s']:6.2f}x | "
              f"{o['output_tok_per_s'] / n['output_tok_per_s']:6.2f}x ({o['output_tok_per_s']:.0f}/"
              f"{n['output_tok_per_s']:.0f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"ours": ours, "naive": naive}, indent=2))


if __name__ == "__main__":
    main()
