"""Caches on vs off, side by side, on the `small` checkpoint through the real server.

A. A conversation about three 1024x1024 images: the first turn, then 3 follow-up turns on the same images
   (each resends the history and the images, as chat clients do). Target: follow-ups >= 20x faster to first token.
B. The same image sent by 5 users, each with a different system prompt before it (no shared prefix): users 2-5
   should skip the vision tower.

    python benchmarks/bench_caches.py [--model DIR]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import small_model, start_server, stop_server  # noqa: E402
from bench_serve_vs_naive import picture  # noqa: E402


def data_url(seed: int) -> str:
    buf = io.BytesIO()
    picture(1024, seed).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(base: str, messages: list[dict], max_tokens: int = 16) -> tuple[str, dict]:
    """Streams the answer (TTFT is the first content chunk's arrival, as users see it); returns the text and the
    server's per-request timings from the final usage chunk."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, timing = "", {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                timing = chunk["usage"]["firsttoken"]
            if chunk.get("choices"):
                text += chunk["choices"][0]["delta"].get("content") or ""
    return text, timing


def conversation(base: str, urls: list[str]) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    messages = [{"role": "user", "content": content + [{"type": "text", "text": "Compare these three photos."}]}]
    turns = []
    for q in ["", "Which one is brightest?", "Describe the second one.", "Any text visible?"]:
        if q:
            messages.append({"role": "user", "content": q})
        answer, timing = ask(base, messages)
        messages.append({"role": "assistant", "content": answer})
        turns.append(timing)
    return turns


def five_users(base: str, url: str) -> list[dict]:
    return [ask(base, [{"role": "system", "content": f"You are assistant #{i} for team {i * 7}."},
                       {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                    {"type": "text", "text": "What is in the photo?"}]}])[1]
            for i in range(5)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None, help="write each request's server timings here")
    args = ap.parse_args()
    model = small_model(args.model)
    results = {}
    for name, extra in [("caches on", []), ("caches off", ["--no-prefix-cache", "--no-encoder-cache"])]:
        proc, base = start_server(model, extra)
        try:
            ask(base, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(99)}},
                                                    {"type": "text", "text": "warm up"}]}], 2)
            results[name] = (conversation(base, [data_url(s) for s in (1, 2, 3)]), five_users(base, data_url(4)))
        finally:
            stop_server(proc)
    print("A. three 1024x1024 images, first turn then 3 follow-ups: TTFT (s)")
    for name, (turns, _) in results.items():
        t = [x["ttft_s"] for x in turns]
        cached = [x["cached_prompt_tokens"] for x in turns]
        print(f"  {name:10s} turns {' '.join(f'{v:.3f}' for v in t)}  first/follow-up "
              f"{t[0] / max(t[1:]):.1f}x (worst) {t[0] / min(t[1:]):.1f}x (best)  cached tokens {cached}")
    print("B. same image, 5 users with different system prompts: TTFT (s) and vision-tower seconds")
    for name, (_, users) in results.items():
        ttfts = " ".join("%.3f" % x["ttft_s"] for x in users)
        encoder = " ".join("%.3f" % x["encoder_compute_s"] for x in users)
        hits = [x["encoder_cache_hits"] for x in users]
        print(f"  {name:10s} TTFT {ttfts}  encoder {encoder}  hits {hits}")
    on, off = results["caches on"], results["caches off"]
    follow_on = sum(x["ttft_s"] for x in on[0][1:]) / 3
    follow_off = sum(x["ttft_s"] for x in off[0][1:]) / 3
    users_on = sum(x["ttft_s"] for x in on[1][1:]) / 4
    users_off = sum(x["ttft_s"] for x in off[1][1:]) / 4
    print(f"follow-up TTFT off/on: {follow_off / follow_on:.1f}x; users 2-5 TTFT off/on: {users_off / users_on:.2f}x")
    if args.json:
        from machine import machine_info

        Path(args.json).write_text(json.dumps(
            {"machine": machine_info(), "model": model,
             "results": {name: {"conversation": turns, "five_users": users} for name, (turns, users) in results.items()},
             "follow_up_off_over_on": follow_off / follow_on, "users_2_5_off_over_on": users_off / users_on},
            indent=1))


if __name__ == "__main__":
    main()
