"""The seed's mix under load, `--scheduling fcfs` vs lanes, side by side on the `small` checkpoint.

50% text-only (~800 tokens), 30% one image, 20% three images (1024x1024, each beside the same ~800-token text),
seeded Poisson arrivals at 0.4 requests/s (about 60% load here), 200 requests per configuration. Prints TTFT
P50/P95/P99 per class for each configuration, each class's unloaded TTFT (one request at a time), and the
targets: text P99 under load within 3x its unloaded TTFT with lanes; 3-image P99 with lanes <= 1.2x FCFS's.

    python benchmarks/bench_lanes.py [--model DIR] [--num-requests 200] [--rate 0.4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import small_model, start_server, stop_server  # noqa: E402

from firsttoken.tools.bench import BenchConfig, run_bench  # noqa: E402

CLASSES = ("text", "1img", "3img")


# bench's text is English words; the checkpoint's tokenizer (trained on Python's stdlib) spends ~1.56 tokens
# per word, so 512 words make the seed's ~800-token text.
WORDS_FOR_800_TOKENS = 512


def bench(base: str, args: argparse.Namespace, seed: int, **kw) -> dict:
    cfg = BenchConfig(url=base, model="m", workload="seed-mix", text_tokens=WORDS_FOR_800_TOKENS,
                      image_text_tokens=WORDS_FOR_800_TOKENS, output_tokens=args.output_tokens, seed=seed,
                      progress=False, **kw)
    report = run_bench(cfg)
    out = {}
    for name, cls in report.summary.classes.items():
        out[name] = {"p50": cls.ttft.p50, "p95": cls.ttft.p95, "p99": cls.ttft.p99, "n": cls.ttft.count}
    out["_errors"] = report.summary.errors
    return out


def run_config(model: str, flags: list[str], args: argparse.Namespace) -> dict:
    proc, base = start_server(model, flags)
    try:
        # distinct seeds: the warm-up and unloaded runs never share images or text with the loaded run
        bench(base, args, args.seed + 2, mix=(("3img", 1.0),), concurrency=1, num_requests=1)
        unloaded = {}
        for cls in CLASSES:
            r = bench(base, args, args.seed + 1, mix=((cls, 1.0),), concurrency=1,
                      num_requests=args.unloaded_requests)
            unloaded[cls] = r[cls]["p50"]
        loaded = bench(base, args, args.seed, rate=args.rate, num_requests=args.num_requests, warmup=args.warmup)
        stats = httpx.get(f"{base}/v1/engine/stats").json()
        if args.capture_dir:
            capture(base, Path(args.capture_dir) / flags[1])
        return {"unloaded": unloaded, "loaded": loaded, "engine": stats}
    finally:
        stop_server(proc)


def capture(base: str, out: Path) -> None:
    """What an operator would look at after the run: /stats as JSON and a headless-Chromium dashboard screenshot."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "stats.json").write_text(json.dumps(httpx.get(f"{base}/stats").json(), indent=1))
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=4000",
                        f"--screenshot={out / 'dashboard.png'}", "--window-size=1400,1500", "--hide-scrollbars",
                        f"{base}/dashboard"], capture_output=True, timeout=120, check=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=0.4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--unloaded-requests", type=int, default=3)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--extra-lanes-flags", default="", help="more serve flags for the lanes run, e.g. "
                    "'--long-step-tokens 1024'")
    ap.add_argument("--capture-dir", default=None, help="save /stats and a dashboard screenshot per config here")
    ap.add_argument("--fcfs-json", default=None, help="reuse the fcfs half of an earlier --json instead of rerunning")
    args = ap.parse_args()
    model = small_model(args.model)
    if args.fcfs_json:
        fcfs = json.loads(Path(args.fcfs_json).read_text())["fcfs"]
    else:
        fcfs = run_config(model, ["--scheduling", "fcfs"], args)
    lanes = run_config(model, ["--scheduling", "lanes", *args.extra_lanes_flags.split()], args)
    results = {"fcfs": fcfs, "lanes": lanes}
    print(f"\nseed mix, {args.num_requests} requests, Poisson {args.rate}/s, small checkpoint; TTFT seconds")
    print("config  class  unloaded |   P50    P95    P99 | P99/unloaded")
    for sched, r in results.items():
        for cls in CLASSES:
            u, l = r["unloaded"][cls], r["loaded"].get(cls)
            if l is None:
                continue
            print(f"{sched:6s}  {cls:5s}  {u:8.3f} | {l['p50']:6.3f} {l['p95']:6.3f} {l['p99']:6.3f} | "
                  f"{l['p99'] / u:6.1f}x")
        print(f"{sched:6s}  errors {r['loaded']['_errors']}  short requests delayed by long work: "
              f"{r['engine'].get('num_short_delayed_by_long')}  preemptions {r['engine'].get('num_preemptions')}")
    lanes, fcfs = results["lanes"], results["fcfs"]
    text_ratio = lanes["loaded"]["text"]["p99"] / lanes["unloaded"]["text"]
    img_ratio = lanes["loaded"]["3img"]["p99"] / fcfs["loaded"]["3img"]["p99"]
    print(f"target 1: text P99 / unloaded with lanes = {text_ratio:.2f}x (target <= 3x; fcfs: "
          f"{fcfs['loaded']['text']['p99'] / fcfs['unloaded']['text']:.2f}x)")
    print(f"target 2: 3-image P99 lanes / fcfs = {img_ratio:.2f}x (target <= 1.2x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
