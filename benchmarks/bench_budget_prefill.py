"""Prefill of a 3-image request at the default per-image budget vs no budget, side by side in one process.

    python benchmarks/bench_budget_prefill.py [--size 1024x1024] [--repeats 2]

One server (small random checkpoint, the serve defaults but --image-max-tokens 16384, caches off so every run
encodes); each repeat sends the same-shaped request twice, alternating: images with image_url.max_visual_tokens
= 1280 (the serve default) and without it (16384 = Qwen2-VL's processor default). Prints the visual tokens and
the server's own phases (usage.firsttoken: encode_s, prefill_s, ttft_s) per run and the ratio of medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import httpx

from firsttoken.cli.regress import in_process_server
from firsttoken.models.checkpoint import make_model
from tests.e2e.conftest import image_data_url, make_image


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1024x1024")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget", type=int, default=1280)
    args = ap.parse_args()
    width, height = (int(x) for x in args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "small", size="small", seed=0)
        with in_process_server(str(model_dir), "auto", 16384, no_caches=True) as url:
            http = httpx.Client(base_url=url, timeout=600)
            model = http.get("/v1/models").json()["data"][0]["id"]
            results: dict[str, list[dict]] = {"budget": [], "none": []}
            for run in range(args.repeats + 1):  # run 0 warms up
                for label in ("budget", "none"):
                    extra = {"max_visual_tokens": args.budget} if label == "budget" else {}
                    parts = [
                        {
                            "type": "image_url",
                            "image_url": {"url": image_data_url(make_image(width, height, seed=run * 10 + i)), **extra},
                        }
                        for i in range(3)
                    ]
                    parts.append({"type": "text", "text": "Compare the three pictures."})
                    body = {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 1}
                    visual = sum(im["num_tokens"] for im in http.post("/tokenize", json=body).json()["images"])
                    usage = http.post("/v1/chat/completions", json=body).json()["usage"]
                    t = usage["firsttoken"]
                    row = {
                        "visual": visual,
                        "prompt": usage["prompt_tokens"],
                        **{k: t[k] for k in ("encode_s", "prefill_s", "ttft_s")},
                    }
                    print(
                        f"run {run} {label:>6}: {visual} visual tokens, prompt {row['prompt']}, encode {t['encode_s']:.3f} s, "
                        f"prefill {t['prefill_s']:.3f} s, ttft {t['ttft_s']:.3f} s" + (" (warm-up)" if run == 0 else "")
                    )
                    if run:
                        results[label].append(row)
    for key in ("encode_s", "prefill_s", "ttft_s"):
        b = statistics.median(r[key] for r in results["budget"])
        n = statistics.median(r[key] for r in results["none"])
        print(f"{key:>9}: budget {args.budget} {b:.3f} s, no budget {n:.3f} s, ratio {n / b:.2f}x")


if __name__ == "__main__":
    main()
