"""The fleet simulator against measured runs on this machine: 1 replica, and 2 replicas with round-robin routing.

    python benchmarks/validate_simulator.py [--model DIR] [--utilization 0.6] [--num-requests 60] [--json out.json]

1. Start one `firsttoken serve` (default flags) on the `small` checkpoint; send each seed-mix class alone
   (--unloaded-requests each, after one warm-up) and read its /stats: the **profile** (step-cost coefficients the
   server fitted from its own steps, preprocess seconds per class). Capacity = 1 / sum(share x mean e2e).
2. Measured, 1 replica: the seed mix at U x capacity (seeded Poisson), every request streamed, TTFT per request.
3. Measured, 2 replicas: two servers with --num-threads 1 each (one core each), the same arrivals sent round-robin;
   each server's profile is read the same way (step 1) before its load.
4. Simulated: the same arrivals, classes and prompt/output token counts (the measured records), replayed through
   `firsttoken.tools.simulate` with the profiles of step 1/3 (taken before the load: out of sample), and again with
   each server's profile read after its run (in sample: what the fit learnt under load).
Prints measured vs simulated TTFT P50/P99 per class with n, and the relative error of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import small_model, start_server, stop_server  # noqa: E402
from machine import machine_info  # noqa: E402

from firsttoken.models.registry import load_model_config  # noqa: E402
from firsttoken.tools import simulate as sim  # noqa: E402
from firsttoken.tools.bench import BenchConfig  # noqa: E402
from firsttoken.tools.bench.client import RequestRecord, send_chat  # noqa: E402
from firsttoken.tools.bench.workload import Workload  # noqa: E402

CLASSES = ("text", "1img", "3img")
WORDS_FOR_800_TOKENS = 512
SHARES = {"text": 0.5, "1img": 0.3, "3img": 0.2}


def bench_config(args: argparse.Namespace, seed: int, mix=None) -> BenchConfig:
    kw = {"mix": mix} if mix else {}
    return BenchConfig(url="http://unused", model="m", workload="seed-mix", text_tokens=WORDS_FOR_800_TOKENS,
                       image_text_tokens=WORDS_FOR_800_TOKENS, output_tokens=args.output_tokens, seed=seed,
                       progress=False, **kw)


async def replay(bases: list[str], bodies: list[tuple[str, int, dict]], arrivals: list[float]) -> list[dict]:
    """Send body i at arrivals[i] (seconds from now) to bases[i % len(bases)]; every record, in sending order."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=30), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        records = []
        for i, ((cls, num_images, body), at) in enumerate(zip(bodies, arrivals)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            b = dict(body, model="m", stream=True, stream_options={"include_usage": True})
            record = RequestRecord(i, i, 0, cls, num_images, False, 0.0)
            records.append(record)
            tasks.append(asyncio.create_task(send_chat(client, f"{bases[i % len(bases)]}/v1/chat/completions",
                                                       b, record, t0)))
        await asyncio.gather(*tasks)
    return [r.to_dict() for r in records]


def unloaded(base: str, args: argparse.Namespace) -> dict[str, float]:
    """Each class alone (one warm-up, then --unloaded-requests): mean e2e seconds per class."""
    service = {}
    for k, cls in enumerate(CLASSES):
        w = Workload(bench_config(args, seed=10_000 + k, mix=((cls, 1.0),)))
        num_images = {"text": 0, "1img": 1, "3img": 3}[cls]
        bodies = [(cls, num_images, w.session(i).requests[0].body) for i in range(args.unloaded_requests + 1)]
        times = []
        for i, body in enumerate(bodies):
            rec = asyncio.run(replay([base], [body], [0.0]))[0]
            if rec["error"] is not None:
                raise SystemExit(f"unloaded {cls} request failed: {rec['error']} {rec['error_message']}")
            if i:
                times.append(rec["e2e_s"])
        service[cls] = sum(times) / len(times)
    return service


def workload(args: argparse.Namespace, rate: float) -> tuple[list[tuple[str, int, dict]], list[float]]:
    w = Workload(bench_config(args, seed=args.seed))
    bodies = []
    for i in range(args.num_requests):
        req = w.session(i).requests[0]
        bodies.append((req.cls, req.num_images, req.body))
    rng = np.random.default_rng(args.seed)
    arrivals = list(np.cumsum(rng.exponential(1.0 / rate, size=args.num_requests)))
    return bodies, [float(a) for a in arrivals]


def stats(base: str) -> dict:
    return httpx.get(f"{base}/stats").json()


def nearest_rank(values: list[float], q: float) -> float | None:
    v = sorted(values)
    return v[max(1, math.ceil(q / 100 * len(v))) - 1] if v else None


def compare(records: list[dict], profiles: list[sim.Profile], model) -> dict:
    trace = sim.from_trace(records, model)
    result = sim.simulate(trace, profiles, sim.Router("round-robin"))
    simulated = {}
    for o in result.outcomes:
        simulated.setdefault(o.request.cls, []).append(o.ttft_s)
    out = {}
    for cls in CLASSES:
        measured = [r["ttft_s"] for r in records if r["cls"] == cls and r["ttft_s"] is not None]
        simd = [t for t in simulated.get(cls, []) if t is not None]
        row = {"n": len(measured)}
        for q in (50, 99):
            m, s = nearest_rank(measured, q), nearest_rank(simd, q)
            row[f"measured_p{q}"], row[f"simulated_p{q}"] = m, s
            row[f"error_p{q}"] = (s - m) / m if m and s is not None else None
        out[cls] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--utilization", type=float, default=0.6)
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--unloaded-requests", type=int, default=3)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--replicas", default="1,2", help="which measured runs: 1,2 (default), 1 or 2; two replicas "
                    "take one core each, so run them only when both cores are free")
    args = ap.parse_args()
    runs = set(args.replicas.split(","))
    model_dir = small_model(args.model)
    model = load_model_config(model_dir)
    out: dict = {"machine": machine_info(), "args": vars(args)}

    # the unloaded service times and the rate: measured on one default server (as bench_slo calibrates)
    proc, base = start_server(model_dir, [])
    try:
        service = unloaded(base, args)
        before = sim.Profile.from_stats(stats(base))
        capacity = 1.0 / sum(SHARES[c] * service[c] for c in CLASSES)
        rate = args.utilization * capacity
        bodies, arrivals = workload(args, rate)
        if "1" in runs:  # 1 replica: the same server, loaded
            records = asyncio.run(replay([base], bodies, arrivals))
            after = sim.Profile.from_stats(stats(base))
    finally:
        stop_server(proc)
    out["calibration"] = {"service_s": service, "capacity_rps": capacity, "rate": rate}
    if "1" in runs:
        out["one"] = {"service_s": service, "capacity_rps": capacity, "rate": rate, "records": records,
                      "profile_before": before.to_dict(), "profile_after": after.to_dict(),
                      "out_of_sample": compare(records, [before], model),
                      "in_sample": compare(records, [after], model)}

    if "2" in runs:  # 2 replicas, one core each, round-robin
        procs, bases = [], []
        try:
            for _ in range(2):
                p, b = start_server(model_dir, ["--num-threads", "1"])
                procs.append(p)
                bases.append(b)
            befores = []
            for b in bases:
                unloaded(b, args)
                befores.append(sim.Profile.from_stats(stats(b)))
            records2 = asyncio.run(replay(bases, bodies, arrivals))
            afters = [sim.Profile.from_stats(stats(b)) for b in bases]
        finally:
            for p in procs:
                stop_server(p)
        out["two"] = {"rate": rate, "records": records2, "profiles_before": [p.to_dict() for p in befores],
                      "out_of_sample": compare(records2, befores, model),
                      "in_sample": compare(records2, afters, model)}

    print(f"machine: {out['machine']}")
    print(f"seed mix, {args.num_requests} requests, Poisson {rate:.4f}/s = U {args.utilization:g} x capacity "
          f"{capacity:.4f}/s (unloaded e2e " + ", ".join(f"{c} {s:.2f} s" for c, s in service.items()) + ")")
    print("replicas profile        class    n | measured P50    P99 | simulated P50    P99 | error P50    P99")
    for key, label in (("one", "1"), ("two", "2 (rr)")):
        if key not in out:
            continue
        for which in ("out_of_sample", "in_sample"):
            for cls in CLASSES:
                r = out[key][which][cls]
                if not r["n"]:
                    continue
                print(f"{label:8s} {which:13s}  {cls:5s} {r['n']:4d} | {r['measured_p50']:12.2f} "
                      f"{r['measured_p99']:6.2f} | {r['simulated_p50']:13.2f} {r['simulated_p99']:6.2f} | "
                      f"{r['error_p50']:+9.0%} {r['error_p99']:+6.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
