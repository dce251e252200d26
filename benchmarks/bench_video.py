"""Video's first token, measured side by side on one machine (issue 40's benchmarks; docs/video.md):

1. unloaded TTFT of a 10 s and a 60 s clip (synthetic, 640x360 at 30 fps) at the default budget, through a real
   server, against transformers' greedy ``generate`` (one new token) on the same weights, the same prompt ids and the
   same pixel values (firsttoken's decode + video_pixel_values, bit-identical to transformers' video processors; the
   decode+pixels time is added to transformers' side, so both sides pay it);
2. the budget's effect: tokens and TTFT of the 60 s clip at three --video-max-tokens values;
3. a follow-up question on the same clip: TTFT with the encoder and prefix caches on vs off;
4. decode memory: peak RSS of planning and decoding a 60 s 1080p clip in a fresh process, against the bound (one
   full-size RGB frame plus the sampled frames at their planned size).

Rounds alternate between the settings compared; round 0 is a warm-up; medians with n beside them. Run on a quiet
machine (the `small` checkpoint, built once into /tmp/bench-small):

    python benchmarks/bench_video.py --json docs/runs/video-ttft-<cpu>.json [--rounds 3]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import small_model  # noqa: E402

CPU_FLAGS = sorted(set(Path("/proc/cpuinfo").read_text().split()) & {"avx2", "avx512f", "avx512_bf16", "fma", "amx_tile"})
QUESTION = "What happens in this clip?"


def clip(seconds: float, width: int = 640, height: int = 360, fps: int = 30) -> bytes:
    from firsttoken.inputs.video_synth import make_clip

    return make_clip(seconds, width, height, fps=fps, gop=fps)


def messages(data: bytes, question: str = QUESTION) -> list[dict]:
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


class Server:
    def __init__(self, model: str, port: int, *flags: str) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "firsttoken.cli.main", "serve", "--model", model, "--port", str(port),
             "--dtype", "float32", *flags], stdout=subprocess.DEVNULL, stderr=open(f"/tmp/bench-video-{port}.log", "w"))
        for _ in range(600):
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    self.model = httpx.get(f"{self.base}/v1/models", timeout=10).json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"the server on {port} did not start: /tmp/bench-video-{port}.log")

    def ask(self, msgs: list[dict]) -> dict:
        r = httpx.post(f"{self.base}/v1/chat/completions", timeout=900,
                       json={"model": self.model, "messages": msgs, "max_tokens": 1, "temperature": 0})
        body = r.json()
        if r.status_code != 200:
            raise SystemExit(json.dumps(body))
        return body["usage"]

    def tokenize(self, msgs: list[dict]) -> dict:
        return httpx.post(f"{self.base}/tokenize", json={"model": self.model, "messages": msgs}, timeout=300).json()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def transformers_ttft(model_dir: str, prompt_ids: list[int], data: bytes, hf_model) -> dict:
    """Seconds of firsttoken's decode + pixels (both sides need them) and of transformers' generate for one token."""
    import torch

    from firsttoken.config import VideoConfig
    from firsttoken.inputs.video import load_video
    from firsttoken.inputs.video_pixels import video_pixel_values
    from firsttoken.models.registry import load_model_config

    config = load_model_config(model_dir)
    t0 = time.perf_counter()
    loaded = load_video(data, VideoConfig(), config.image_processor)
    pixels, grid = video_pixel_values(loaded.video.frames, config.image_processor)
    t1 = time.perf_counter()
    ids = torch.tensor([prompt_ids])
    types = 2 * (ids == config.video_token_id).long()
    with torch.inference_mode():
        hf_model.generate(input_ids=ids, mm_token_type_ids=types, pixel_values_videos=pixels,
                          video_grid_thw=torch.tensor([grid]), max_new_tokens=1, do_sample=False)
    t2 = time.perf_counter()
    return {"preprocess_s": t1 - t0, "generate_s": t2 - t1, "total_s": t2 - t0}


def med(values: list[float]) -> dict:
    return {"median_s": round(statistics.median(values), 3), "n": len(values), "values_s": [round(v, 3) for v in values]}


def phases(usage: dict) -> dict:
    ft = usage.get("firsttoken") or {}
    keys = ("ttft_s", "preprocess_s", "queue_s", "encode_s", "prefill_s", "encoder_compute_s", "forward_s",
            "prefill_steps", "images_encoded", "encoder_cache_hits", "cached_prompt_tokens")
    return {k: ft.get(k) for k in keys if k in ft}


def unloaded(model: str, rounds: int, port: int) -> dict:
    import torch

    from firsttoken.models.registry import family_of

    torch.set_num_threads(os.cpu_count() or 1)
    hf = family_of(model).checkpoint.hf_model_class().from_pretrained(model, dtype=torch.float32).eval()
    server = Server(model, port, "--no-prefix-cache", "--no-encoder-cache")
    out: dict = {}
    try:
        for seconds in (10, 60):
            data = clip(seconds)
            msgs = messages(data)
            counted = server.tokenize(msgs)
            ours, theirs, parts = [], [], []
            for rnd in range(rounds + 1):
                order = ("ours", "hf") if rnd % 2 else ("hf", "ours")
                for side in order:
                    if side == "ours":
                        usage = server.ask(msgs)
                        if rnd:
                            ours.append(usage["firsttoken"]["ttft_s"])
                            parts.append(phases(usage))
                    else:
                        t = transformers_ttft(model, counted["tokens"], data, hf)
                        if rnd:
                            theirs.append(t["total_s"])
            out[f"{seconds}s"] = {"prompt_tokens": counted["count"], "video": counted["videos"][0],
                                  "firsttoken_ttft": med(ours), "transformers_ttft": med(theirs),
                                  "ratio": round(statistics.median(ours) / statistics.median(theirs), 3),
                                  "firsttoken_phases": parts}
            print(json.dumps({k: v for k, v in out[f"{seconds}s"].items() if k != "firsttoken_phases"}), flush=True)
    finally:
        server.close()
    return out


def budgets(model: str, rounds: int, port: int) -> dict:
    data = clip(60)
    msgs = messages(data)
    out = {}
    for budget in (1024, 2048, 4096):
        server = Server(model, port, "--no-prefix-cache", "--no-encoder-cache", "--video-max-tokens", str(budget))
        try:
            counted = server.tokenize(msgs)
            ttfts = [server.ask(msgs)["firsttoken"]["ttft_s"] for _ in range(rounds + 1)][1:]
        finally:
            server.close()
        out[str(budget)] = {"video_tokens": counted["videos"][0]["num_tokens"],
                            "frames": counted["videos"][0]["num_frames"], "ttft": med(ttfts)}
        print(budget, json.dumps(out[str(budget)]), flush=True)
    return out


def follow_up(model: str, rounds: int, port: int) -> dict:
    data = clip(60)
    out = {}
    for name, flags in (("caches_on", ()), ("caches_off", ("--no-prefix-cache", "--no-encoder-cache"))):
        server = Server(model, port, *flags)
        try:
            server.ask(messages(data, "First question about the clip."))
            ttfts = [server.ask(messages(data, f"Follow-up question number {k}."))["firsttoken"]["ttft_s"]
                     for k in range(rounds)]
        finally:
            server.close()
        out[name] = med(ttfts)
    out["ratio_on_off"] = round(out["caches_on"]["median_s"] / out["caches_off"]["median_s"], 3)
    print("follow-up", json.dumps(out), flush=True)
    return out


DECODE_CHILD = """
import resource, sys, json
from firsttoken.config import VideoConfig
from firsttoken.inputs.video import load_video
from firsttoken.models.registry import load_model_config
data = open(sys.argv[2], "rb").read()
proc = load_model_config(sys.argv[1]).image_processor
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
loaded = load_video(data, VideoConfig(), proc)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
f = loaded.video.frames
print(json.dumps({"clip_bytes": len(data), "rss_before_kib": before, "rss_after_kib": after,
                  "frames": int(f.shape[0]), "frames_bytes": int(f.nbytes), "resized": list(f.shape[1:3])}))
"""


def decode_memory(model: str) -> dict:
    """Peak RSS growth while planning and decoding a 60 s 1080p clip, in a fresh process that first reads the clip's
    bytes (made by this process, written to a file), so the growth is the decode's alone."""
    path = Path("/tmp/bench-video-60s-1080p.mp4")
    path.write_bytes(clip(60, 1920, 1080))
    res = json.loads(subprocess.run([sys.executable, "-c", DECODE_CHILD, model, str(path)], capture_output=True,
                                    text=True, check=True).stdout)
    full_frame = 1920 * 1080 * 3
    res["peak_growth_bytes"] = (res["rss_after_kib"] - res["rss_before_kib"]) * 1024
    res["bound_bytes"] = full_frame + res["frames_bytes"]
    print("decode memory", json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the small one in /tmp/bench-small)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per setting after one warm-up")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--only", default="unloaded,budgets,follow_up,decode_memory")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    model = small_model(args.model)
    out: dict = {"cpu_flags": CPU_FLAGS, "cores": os.cpu_count(), "model": model, "rounds": args.rounds}
    steps = {"unloaded": lambda: unloaded(model, args.rounds, args.port),
             "budgets": lambda: budgets(model, args.rounds, args.port),
             "follow_up": lambda: follow_up(model, args.rounds, args.port),
             "decode_memory": lambda: decode_memory(model)}
    for name in args.only.split(","):
        out[name] = steps[name]()
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
