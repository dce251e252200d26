"""Capture `firsttoken doctor`'s test fixtures from real misconfigured runs on the `tiny` checkpoint.

For each case: start `firsttoken serve` with the misconfiguration, drive a short bench workload sized to expose
it, then save GET /metrics and GET /stats into tests/fixtures/doctor/<case>/ (metrics.txt, stats.json) with
case.json (flags, workload, the bench's per-class TTFT). tests/unit/test_doctor.py checks that doctor names
each case's cause first.

    python benchmarks/capture_doctor_fixtures.py [--cases budget,fcfs,kv,caches,healthy] [--out DIR]

Cases: budget (--image-max-tokens 16384, 2048x1536 photos), fcfs (--scheduling fcfs, the seed mix), kv
(--kv-admission optimistic, a pool planned to hold ~1.2 of the seed's 3-image requests), caches
(--no-prefix-cache --no-encoder-cache, a follow-up workload), healthy (defaults, the seed mix).
A run takes ~1 min per case; the server gets --num-threads 1 so it shares a small machine politely.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import start_server, stop_server  # noqa: E402

from firsttoken.tools.bench import BenchConfig, run_bench
from firsttoken.tools.plan import PlanInputs, load_config, make_plan

ROOT = Path(__file__).resolve().parent.parent
WORDS_FOR_800_TOKENS = 512  # bench's words are ~1.56 tokens each with our tokenizer
SEED_MIX = (("text", 0.5), ("1img", 0.3), ("3img", 0.2))


def tiny_model() -> Path:
    from firsttoken.models.checkpoint import make_model

    path = Path(os.environ.get("FIRSTTOKEN_CACHE", "/tmp")) / "doctor-tiny"
    if not (path / "config.json").exists():
        make_model(path, size="tiny")
    return path


def kv_memory_too_small(model: Path) -> int:
    """A KV pool that admits ~1.2 of the seed's 3-image requests (1280-token budget): the peak does not fit."""
    plan = make_plan(load_config(model / "config.json"),
                     PlanInputs(kv_cache_memory_bytes=2**30, peak_concurrency=4, text_tokens=60, images_per_request=3,
                                image_tokens=1280, output_tokens=16, dtype="float32"))  # fmt: skip
    return int(plan.admission_kv_bytes_per_request * 1.2)


def cases(model: Path) -> dict[str, tuple[list[str], dict]]:
    """case -> (serve flags, BenchConfig fields)."""
    mix = {
        "workload": "seed-mix",
        "mix": SEED_MIX,
        "text_tokens": WORDS_FOR_800_TOKENS,
        "output_tokens": 16,
    }
    return {
        "budget": (["--image-max-tokens", "16384"],
                   dict(mix, image_size=(2048, 1536), rate=1.0, num_requests=14)),
        "fcfs": (["--scheduling", "fcfs"], dict(mix, rate=4.0, num_requests=30)),
        "kv": (["--kv-admission", "optimistic", "--kv-cache-memory", str(kv_memory_too_small(model))],
               dict(mix, concurrency=6, num_requests=18)),
        "caches": (["--no-prefix-cache", "--no-encoder-cache"],
                   {"workload": "multiturn", "turns": 3, "multiturn_images": 2, "text_tokens": WORDS_FOR_800_TOKENS,
                        "output_tokens": 16, "concurrency": 2, "num_requests": 5}),
        "healthy": ([], dict(mix, rate=4.0, num_requests=30)),
    }  # fmt: skip


def capture(name: str, model: Path, flags: list[str], bench_kw: dict, out: Path) -> None:
    proc, base = start_server(model, ["--num-threads", "1", *flags])
    try:
        warm = {**bench_kw, "num_requests": 1, "rate": None, "concurrency": 1}
        run_bench(BenchConfig(url=base, model="m", progress=False, seed=1, **warm))  # warm-up, its own seed
        report = run_bench(BenchConfig(url=base, model="m", progress=False, seed=0, **bench_kw))
        metrics = httpx.get(f"{base}/metrics").text
        stats = httpx.get(f"{base}/stats").json()
    finally:
        stop_server(proc)
    case_dir = out / name
    case_dir.mkdir(parents=True, exist_ok=True)
    (case_dir / "metrics.txt").write_text(metrics)
    (case_dir / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    ttft = {k: {"p50": c.ttft.p50, "p95": c.ttft.p95, "p99": c.ttft.p99, "n": c.ttft.count}
            for k, c in report.summary.classes.items()}  # fmt: skip
    meta = {
        "serve_flags": ["--num-threads", "1", *flags],
        "checkpoint": "tiny",
        "bench": {k: v for k, v in bench_kw.items()},
        "ttft_s": ttft,
        "errors": report.summary.errors,
    }
    (case_dir / "case.json").write_text(json.dumps(meta, indent=1, default=list) + "\n")
    print(f"{name}: {' '.join(flags) or '(defaults)'}; {report.summary.num_ok} ok, errors {report.summary.errors}; "
          + ", ".join(f"{k} P50 {v['p50']:.3f}s" for k, v in ttft.items() if v["p50"] == v["p50"]))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="budget,fcfs,kv,caches,healthy")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "doctor")
    args = ap.parse_args()
    model = tiny_model()
    table = cases(model)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copy(model / "config.json", args.out / "config.json")  # KV bytes per token for doctor --model
    for name in args.cases.split(","):
        flags, bench_kw = table[name]
        capture(name, model, flags, bench_kw, args.out)


if __name__ == "__main__":
    main()
