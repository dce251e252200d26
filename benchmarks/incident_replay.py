"""The seed's incident, replayed: TTFT per class under the configuration the review started from, then with each
of its fixes added in turn, like the review's before/after table.

Workload: the seed's mix (50% text ~800 tokens, 30% one photo, 20% three photos; 2048x1536, ~4,000 visual tokens
each at Qwen2-VL's processor defaults), seeded Poisson arrivals at --rate for --duration seconds per step, the
same requests in every step. Steps (each a fresh `firsttoken serve`, float32):

    0 seed start   --image-max-tokens 16384 --scheduling fcfs --kv-admission optimistic
                   --kv-cache-memory <1.5 unbudgeted 3-photo requests: the peak does not fit>
                   --no-prefix-cache --no-encoder-cache
    1 + budget     --image-max-tokens 1280
    2 + KV plan    --kv-admission whole-prompt --kv-cache-memory <firsttoken plan for --peak-concurrency>
    3 + lanes      --scheduling lanes
    4 + caches     prefix and encoder caches back on

After each step: TTFT P50/P95/P99 per class, errors, preemptions, short requests delayed by long work, and
doctor's first finding on that server's /metrics + /stats.

    python benchmarks/incident_replay.py [--model DIR | --size small|tiny] [--duration 150] [--rate 0.2]
                                         [--request-timeout 120] [--peak-concurrency 8] [--json out.json]

Each step takes at most ~start-up + duration + request-timeout (requests still unanswered then count as
timeouts), so the defaults replay in under ~30 minutes on the `small` checkpoint.

--rate 0.2 is the incident's rate on the project's machine; a slower machine is overloaded by it even after every
fix. `--utilization U` instead starts the fixed configuration (step 4's flags) once, measures each class's
unloaded service time there (firsttoken bench's calibration: capacity = 1 / sum(share x service)), and replays
every step at U x that capacity: one rate for all steps, relative to what this machine can serve. The JSON's
"arrivals" records the rate, U and the measured times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import start_server, stop_server  # noqa: E402

from firsttoken.tools.bench import (
    BenchConfig,
    Calibration,
    measure_calibration,
    run_bench,
)
from firsttoken.tools.doctor import doctor_from_texts
from firsttoken.tools.doctor.rules import KVSizing
from firsttoken.tools.plan import (
    DTYPE_BYTES,
    ModelShape,
    PlanInputs,
    load_config,
    make_plan,
)

CLASSES = ("text", "1img", "3img")
SEED_MIX = (("text", 0.5), ("1img", 0.3), ("3img", 0.2))
WORDS_FOR_800_TOKENS = 512  # bench's words are ~1.56 tokens each with our tokenizer
PHOTO = (2048, 1536)
UNBUDGETED_TOKENS = (2048 // 28) * (1536 // 28)  # ~4,000 visual tokens per photo at the processor's defaults
BUDGET = 1280
DTYPE = "float32"


def model_dir(model: str | None, size: str) -> Path:
    if model is not None:
        return Path(model)
    from firsttoken.models.checkpoint import make_model

    path = Path(os.environ.get("FIRSTTOKEN_CACHE", "/tmp")) / f"incident-{size}"
    if not (path / "config.json").exists():
        make_model(path, size=size)
    return path


def kv_pools(config: dict, peak: int, output_tokens: int) -> tuple[int, int]:
    """(too small, planned) --kv-cache-memory bytes. Too small: 1.5 unbudgeted 3-photo requests, so one always
    fits (never a 400) but the peak does not. Planned: the pool for the peak at the budget to finish without
    preemption (firsttoken plan's pool_bytes_for_peak_without_preemption), rounded up to MiB."""

    def plan(image_tokens: int):
        inputs = PlanInputs(kv_cache_memory_bytes=2**30, peak_concurrency=peak, text_tokens=800,
                            images_per_request=3, image_tokens=image_tokens, output_tokens=output_tokens,
                            dtype=DTYPE)  # fmt: skip
        return make_plan(config, inputs)

    too_small = int(plan(UNBUDGETED_TOKENS).admission_kv_bytes_per_request * 1.5)
    planned = plan(BUDGET).pool_bytes_for_peak_without_preemption
    return too_small, -(-planned // 2**20) * 2**20


def steps(too_small: int, planned: int) -> list[tuple[str, list[str]]]:
    budget = ["--image-max-tokens", "16384"]
    kv = ["--kv-admission", "optimistic", "--kv-cache-memory", str(too_small)]
    sched = ["--scheduling", "fcfs"]
    caches = ["--no-prefix-cache", "--no-encoder-cache"]
    out = [("0 seed start", budget + kv + sched + caches)]
    budget = ["--image-max-tokens", str(BUDGET)]
    out.append(("1 + budget", budget + kv + sched + caches))
    kv = ["--kv-admission", "whole-prompt", "--kv-cache-memory", str(planned)]
    out.append(("2 + KV plan", budget + kv + sched + caches))
    sched = ["--scheduling", "lanes"]
    out.append(("3 + lanes", budget + kv + sched + caches))
    out.append(("4 + caches", budget + kv + sched))
    return out


def serve_flags(flags: list[str], args: argparse.Namespace) -> list[str]:
    threads = ["--num-threads", str(args.num_threads)] if args.num_threads else []
    return ["--dtype", DTYPE, *threads, *flags]


def bench_common(base: str, args: argparse.Namespace) -> dict:
    """The BenchConfig fields every run against one step's server shares: the seed's mix of photos and text."""
    return {"url": base, "model": "m", "workload": "seed-mix", "mix": SEED_MIX, "image_size": PHOTO,
            "text_tokens": WORDS_FOR_800_TOKENS, "output_tokens": args.output_tokens, "progress": False}


def calibrate_on(model: Path, flags: list[str], args: argparse.Namespace) -> Calibration:
    """The rate for --utilization, measured once on a server with `flags` (the fixed configuration)."""
    proc, base = start_server(model, serve_flags(flags, args))
    try:
        return measure_calibration(BenchConfig(**bench_common(base, args), utilization=args.utilization,
                                               timeout_s=args.request_timeout, seed=args.seed))
    finally:
        stop_server(proc)


def run_step(model: Path, flags: list[str], args: argparse.Namespace, kv: KVSizing) -> dict:
    proc, base = start_server(model, serve_flags(flags, args))
    try:
        common = bench_common(base, args)
        warmup = {**common, "mix": (("text", 1.0),)}
        run_bench(BenchConfig(**warmup, num_requests=1, seed=args.seed + 1))  # warm-up: one text request
        report = run_bench(BenchConfig(**common, rate=args.rate, duration_s=args.duration, num_requests=None,
                                       timeout_s=args.request_timeout, seed=args.seed))  # fmt: skip
        metrics = httpx.get(f"{base}/metrics").text
        stats = httpx.get(f"{base}/stats").json()
        engine = httpx.get(f"{base}/v1/engine/stats").json()
    finally:
        stop_server(proc)
    doctor = doctor_from_texts(metrics, stats, kv=kv)
    first = doctor.findings[0] if doctor.findings else None
    return {
        "flags": flags,
        "ttft_s": {k: {"p50": c.ttft.p50, "p95": c.ttft.p95, "p99": c.ttft.p99, "n": c.ttft.count}
                   for k, c in report.summary.classes.items()},
        "num_requests": report.summary.num_requests,
        "num_ok": report.summary.num_ok,
        "errors": report.summary.errors,
        "preemptions": engine.get("num_preemptions"),
        "short_delayed_by_long": engine.get("num_short_delayed_by_long"),
        "doctor_first": None if first is None else {"title": first.title, "change": first.change,
                                                    "share": first.share, "severity": first.severity},
    }


def _cell(x: float | None) -> str:
    return "     -" if x is None or math.isnan(x) else f"{x:6.1f}" if x >= 10 else f"{x:6.2f}"


def format_table(results: dict[str, dict], args: argparse.Namespace) -> str:
    load = f"{args.rate:.4g}/s" + ("" if args.utilization is None else f" (utilization {args.utilization:g})")
    lines = [(f"seed mix (text ~800 tokens 50% / 1 photo 30% / 3 photos 20%, {PHOTO[0]}x{PHOTO[1]}), Poisson "
             f"{load} for {args.duration:.0f} s per step, {args.size_label}; TTFT seconds; n = requests measured"),
             f"{'step':14s} | " + " | ".join(f"{c:^24s}" for c in CLASSES) + " | errors  preempt  delayed",
             f"{'':14s} | " + " | ".join(f"{'P50':>6s} {'P95':>6s} {'P99':>6s} {'n':>3s}" for _ in CLASSES) + " |"]  # fmt: skip
    for name, r in results.items():
        cells = []
        for c in CLASSES:
            t = r["ttft_s"].get(c, {})
            cells.append(f"{_cell(t.get('p50'))} {_cell(t.get('p95'))} {_cell(t.get('p99'))} {t.get('n', 0):3d}")
        errors = sum(r["errors"].values())
        lines.append(f"{name:14s} | " + " | ".join(cells) + f" | {errors:6d}  {r['preemptions'] or 0:7d}  "
                     f"{r['short_delayed_by_long'] or 0:7d}")  # fmt: skip
    lines.append("")
    for name, r in results.items():
        d = r["doctor_first"]
        err = ", ".join(f"{k} {v}" for k, v in r["errors"].items())
        lines.append(f"{name:14s} {r['num_ok']}/{r['num_requests']} ok{' (' + err + ')' if err else ''}; doctor: "
                     + (f"[{d['severity']}] {d['title']} -> {d['change']}" if d else "no findings"))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a random --size checkpoint)")
    ap.add_argument("--size", default="small", choices=("small", "tiny"))
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of arrivals per step")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=0.2, help="requests/s (Poisson; default 0.2)")
    load.add_argument("--utilization", type=float, default=None,
                      help="instead of --rate: U x the capacity measured on the fixed configuration (step 4)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="client timeout per request, seconds")
    ap.add_argument("--peak-concurrency", type=int, default=8, help="the peak the KV plan is sized for")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--num-threads", type=int, default=None, help="server torch threads (default: all cores)")
    ap.add_argument("--steps", default="0,1,2,3,4", help="which steps to run (comma-separated indices)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = model_dir(args.model, args.size)
    args.size_label = f"checkpoint {model.name}" if args.model else f"{args.size} checkpoint"
    config = load_config(model / "config.json")
    too_small, planned = kv_pools(config, args.peak_concurrency, args.output_tokens)
    kv = KVSizing(ModelShape.from_config(config).kv_bytes_per_token(DTYPE_BYTES[DTYPE]), args.peak_concurrency)
    wanted = {int(i) for i in args.steps.split(",")}
    all_steps = steps(too_small, planned)
    calibration = None
    if args.utilization is not None:
        calibration = calibrate_on(model, all_steps[-1][1], args)
        args.rate = calibration.rate
        print(calibration.describe(), file=sys.stderr, flush=True)
    results: dict[str, dict] = {}
    for i, (name, flags) in enumerate(all_steps):
        if i not in wanted:
            continue
        t0 = time.monotonic()
        results[name] = run_step(model, flags, args, kv)
        results[name]["wall_s"] = time.monotonic() - t0
        print(f"{name}: {' '.join(flags)} ({results[name]['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    print(
        f"KV pools: too small {too_small / 2**20:.1f} MiB (1.5 unbudgeted 3-photo requests), planned "
        f"{planned / 2**20:.0f} MiB (peak {args.peak_concurrency} at {BUDGET} tokens/image, firsttoken plan)"
    )
    print(format_table(results, args))
    if args.json:
        arrivals = {"rate": args.rate, "utilization": args.utilization,
                    "calibration": None if calibration is None else calibration.to_dict()}
        Path(args.json).write_text(json.dumps({"too_small_kv_bytes": too_small, "planned_kv_bytes": planned,
                                               "arrivals": arrivals, "steps": results}, indent=1, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
