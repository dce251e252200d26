"""The seed's mix under load, `--scheduling fcfs` vs lanes, side by side on the `small` checkpoint.

50% text-only (~800 tokens), 30% one image, 20% three images (1024x1024, each beside the same ~800-token text),
seeded Poisson arrivals at 0.4 requests/s (U >= 0.86 on the project's machine, by its unloaded TTFTs; see
docs/performance.md), 200 requests per configuration. Prints TTFT P50/P95/P99 per class for each configuration,
each class's unloaded TTFT (one request at a time), n (successful requests behind each percentile), and the
targets: text P99 under load within 3x its unloaded TTFT with lanes; 3-image P99 with lanes <= 1.2x FCFS's.

0.4/s was chosen on the project's machine; on another machine the same rate is another load. `--utilization U`
instead measures each class's unloaded service time on the first configuration's server (firsttoken bench's
calibration: capacity = 1 / sum(share x service)), and both configurations then run at U x that capacity, so
they see the same offered load. The JSON records each half's rate, utilization and calibration.

    python benchmarks/bench_lanes.py [--model DIR] [--num-requests 200] [--rate 0.4 | --utilization 0.6]
                                     [--json out.json]
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

from firsttoken.tools.bench import BenchConfig, BenchReport, run_bench  # noqa: E402

CLASSES = ("text", "1img", "3img")


# bench's text is English words; the checkpoint's tokenizer (trained on Python's stdlib) spends ~1.56 tokens
# per word, so 512 words make the seed's ~800-token text.
WORDS_FOR_800_TOKENS = 512


def bench(base: str, args: argparse.Namespace, seed: int, **kw) -> BenchReport:
    cfg = BenchConfig(url=base, model="m", workload="seed-mix", text_tokens=WORDS_FOR_800_TOKENS,
                      image_text_tokens=WORDS_FOR_800_TOKENS, output_tokens=args.output_tokens, seed=seed,
                      progress=False, **kw)
    return run_bench(cfg)


def ttft_table(report: BenchReport) -> dict:
    out: dict = {}
    for name, cls in report.summary.classes.items():
        out[name] = {"p50": cls.ttft.p50, "p95": cls.ttft.p95, "p99": cls.ttft.p99, "n": cls.ttft.count}
    out["_errors"] = report.summary.errors
    return out


def run_config(model: str, flags: list[str], args: argparse.Namespace, arrivals: dict) -> dict:
    """One configuration's half. `arrivals` is {"rate": R} or {"utilization": U} (then calibrated here)."""
    proc, base = start_server(model, flags)
    try:
        # distinct seeds: the warm-up and unloaded runs never share images or text with the loaded run
        bench(base, args, args.seed + 2, mix=(("3img", 1.0),), concurrency=1, num_requests=1)
        unloaded = {}
        for cls in CLASSES:
            r = bench(base, args, args.seed + 1, mix=((cls, 1.0),), concurrency=1,
                      num_requests=args.unloaded_requests)
            unloaded[cls] = ttft_table(r)[cls]["p50"]
        report = bench(base, args, args.seed, num_requests=args.num_requests, warmup=args.warmup, **arrivals)
        stats = httpx.get(f"{base}/v1/engine/stats").json()
        if args.capture_dir:
            capture(base, Path(args.capture_dir) / flags[1])
        calibration = None if report.calibration is None else report.calibration.to_dict()
        return {"unloaded": unloaded, "loaded": ttft_table(report), "engine": stats,
                "arrivals": {"rate": report.rate, "utilization": arrivals.get("utilization"),
                             "calibration": calibration}}
    finally:
        stop_server(proc)


def lanes_arrivals(fcfs: dict, args: argparse.Namespace) -> dict:
    """The lanes half runs at the rate the fcfs half ran at, so both see one offered load."""
    recorded = fcfs.get("arrivals")
    if recorded is not None:
        return {"rate": recorded["rate"]}
    if args.utilization is not None:  # an --fcfs-json from before rates were recorded
        raise SystemExit("--utilization with --fcfs-json needs an fcfs half that recorded its rate; rerun both")
    return {"rate": args.rate}


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
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=0.4, help="Poisson requests/s (default 0.4)")
    load.add_argument("--utilization", type=float, default=None,
                      help="instead of --rate: U x the capacity measured on the first configuration's server")
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
        first = {"utilization": args.utilization} if args.utilization is not None else {"rate": args.rate}
        fcfs = run_config(model, ["--scheduling", "fcfs"], args, first)
    lanes = run_config(model, ["--scheduling", "lanes", *args.extra_lanes_flags.split()], args,
                       lanes_arrivals(fcfs, args))
    if fcfs.get("arrivals", {}).get("calibration") is not None:  # the lanes half ran at the fcfs half's rate
        lanes["arrivals"] |= {"utilization": fcfs["arrivals"]["utilization"],
                              "calibration": fcfs["arrivals"]["calibration"], "calibrated_on": "fcfs"}
    results = {"fcfs": fcfs, "lanes": lanes}
    rate = lanes["arrivals"]["rate"]
    load = f"Poisson {rate:.4g}/s"
    if lanes["arrivals"]["utilization"] is not None:
        cal = lanes["arrivals"]["calibration"]
        load += (f" = utilization {cal['utilization']:g} x capacity {cal['capacity_rps']:.4g}/s (unloaded service "
                 + ", ".join(f"{c} {t:.3f} s" for c, t in cal["service_s"].items()) + ")")
    print(f"\nseed mix, {args.num_requests} requests, {load}, checkpoint {Path(model).name}; TTFT seconds")
    print("config  class    n  unloaded |   P50    P95    P99 | P99/unloaded")
    for sched, r in results.items():
        for cls in CLASSES:
            u, l = r["unloaded"][cls], r["loaded"].get(cls)
            if l is None:
                continue
            print(f"{sched:6s}  {cls:5s} {l['n']:4d}  {u:8.3f} | {l['p50']:6.3f} {l['p95']:6.3f} {l['p99']:6.3f} | "
                  f"{l['p99'] / u:6.2f}x")
        print(f"{sched:6s}  errors {r['loaded']['_errors']}  short requests delayed by long work: "
              f"{r['engine'].get('num_short_delayed_by_long')}  preemptions {r['engine'].get('num_preemptions')}")
    lanes, fcfs = results["lanes"], results["fcfs"]
    text_ratio = lanes["loaded"]["text"]["p99"] / lanes["unloaded"]["text"]
    img_ratio = lanes["loaded"]["3img"]["p99"] / fcfs["loaded"]["3img"]["p99"]
    fcfs_text_ratio = fcfs["loaded"]["text"]["p99"] / fcfs["unloaded"]["text"]
    print(f"target 1: text P99 / unloaded with lanes = {text_ratio:.2f}x (target <= 3x: "
          f"{'met' if text_ratio <= 3 else 'MISSED'}; fcfs: {fcfs_text_ratio:.2f}x)")
    print(f"target 2: 3-image P99 lanes / fcfs = {img_ratio:.2f}x (target <= 1.2x: "
          f"{'met' if img_ratio <= 1.2 else 'MISSED'})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
