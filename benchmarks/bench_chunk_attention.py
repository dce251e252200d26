"""A later prefill chunk's attention, the two ways the SDPA backend can run it, side by side: SDPA with the causal
mask shifted by the context (the masked path: every query-key pair scored) and the split the backend uses (the
context unmasked, the chunk itself causal, merged by log-sum-exp). Calls alternate; one layer's attention each, at
the small checkpoint's heads (8 query heads, 2 KV heads, head_dim 64) unless told otherwise. A benchmark, not a test.

    python benchmarks/bench_chunk_attention.py [--shapes 1402@18,1371@1389,1395@2760,2048@2048,512@4096]
                                               [--rounds 20] [--threads 2] [--dtype float32] [--json OUT]

Shapes are NEW@CONTEXT (new tokens of the chunk @ tokens already cached); the defaults are a three-image prompt's
chunks under throughput steps, a 2,048-token chunk halfway through a long prompt, and a small chunk late in one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from firsttoken.attention.sdpa import _attend, _attend_split


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1402@18,1371@1389,1395@2760,2048@2048,512@4096")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    before = machine_info()
    rows = []
    print(f"{before['cpu']} {before['cpu_flags']}, {args.threads} threads, {args.dtype}, {args.rounds} rounds "
          f"alternating, medians in ms")
    print(f"{'new@context':>14s}{'masked':>9s}{'split':>9s}{'masked/split':>14s}")
    for shape in args.shapes.split(","):
        new, ctx = (int(x) for x in shape.split("@"))
        gen = torch.Generator().manual_seed(new + ctx)
        q = torch.randn(new, args.heads, args.head_dim, generator=gen).to(dtype)
        k = torch.randn(ctx + new, args.kv_heads, args.head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx + new, args.kv_heads, args.head_dim, generator=gen).to(dtype)
        mask = torch.arange(ctx + new)[None, :] <= torch.arange(ctx, ctx + new)[:, None]
        scale = args.head_dim**-0.5
        runs = {"masked": [], "split": []}
        calls = {"masked": lambda: _attend(q, k, v, mask, scale, causal=False),
                 "split": lambda: _attend_split(q, k, v, ctx, scale)}
        for fn in calls.values():
            fn()
        for r in range(args.rounds):
            for name in (("masked", "split") if r % 2 == 0 else ("split", "masked")):
                t0 = time.perf_counter()
                calls[name]()
                runs[name].append(time.perf_counter() - t0)
        med = {n: statistics.median(v) for n, v in runs.items()}
        rows.append({"new": new, "context": ctx, "runs_s": runs, "median_s": med,
                     "masked_over_split": med["masked"] / med["split"]})
        print(f"{shape:>14s}{med['masked'] * 1e3:9.1f}{med['split'] * 1e3:9.1f}{med['masked'] / med['split']:14.2f}")
    after = machine_info()
    print(f"load {before['loadavg']} -> {after['loadavg']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine_before": before, "machine_after": after, "dtype": args.dtype,
                                               "threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
