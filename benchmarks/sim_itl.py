"""Reading speed under load, side by side in the fleet simulator: the gaps between a streaming answer's tokens (ITL)
and every class's TTFT, with and without ``--itl-target``, for the seed's mix at U x the simulated capacity
(firsttoken's own scheduler on a virtual clock, steps priced by the `small` checkpoint's AVX2 cost model).
Deterministic; seconds of CPU per run.

    python benchmarks/sim_itl.py --json out.json
    python benchmarks/sim_itl.py --utilizations 0.6,0.8 --seeds 1,2,3 --configs 'off=;p0.1={"itl_target":"0.1"}'

Why: with time-bounded steps the long lane fills each step up to ``--step-time-target`` (auto: a typical short
prompt's prefill, ~0.35 s here), and every running decode gets one token per step, so under image load a text
answer streams at one token per such step. ``--itl-target`` holds each answer's average gap from its first decode
step by bounding the steps that carry decodes once an answer falls behind. What it costs: more steps for the same
long-lane work, each
paying the per-step constant. ITL percentiles pool every gap between
consecutive tokens of the class's requests (31 per request: 32 output tokens each).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sim_long_order import (
    PREPROCESS_S,
    SMALL_AVX2,
    class_stats,
    load_coefficients,
    parse_configs,
    seed_mix_loads,
    simulate_with,
    small_model,
    unloaded_ttft,
)

import firsttoken.tools.simulate as sim
from firsttoken.config import SchedulerConfig

DEFAULT_CONFIGS = 'off=;auto={"itl_target":"auto"}'
CLASSES = ("text", "1img", "3img")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--utilizations", default="0.6,0.8,1.0")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--step-noise", type=float, default=0.1, help="lognormal sigma of step times around the model")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="name=JSON scheduler options;... (fcfs is added)")
    ap.add_argument("--coefficients", default=None, help="as sim_long_order.py's (default: small on AVX2)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = small_model()
    coefficients = load_coefficients(args.coefficients) if args.coefficients else SMALL_AVX2
    base = sim.Profile(coefficients, SchedulerConfig(), num_kv_blocks=8192, preprocess_s=PREPROCESS_S)
    configs = {"fcfs": {"scheduling": "fcfs"}, **parse_configs(args.configs)}
    unloaded = unloaded_ttft(base, model)
    out: dict = {"args": vars(args), "coefficients": coefficients, "unloaded_ttft_s": unloaded, "runs": []}
    print("unloaded TTFT: " + ", ".join(f"{c} {t:.2f} s" for c, t in sorted(unloaded.items())))
    print(f"{'U':>4s} {'seed':>4s} {'config':10s} | ITL mean / P90 / P99 s: text, 1img, 3img | text P99/unl | "
          f"1img P99/fcfs | 3img P99/fcfs | 3img mean | steps")
    for u, seed, capacity, workload in seed_mix_loads(base, model, args.utilizations, args.seeds,
                                                      args.num_requests):
        results = {}
        for name, options in configs.items():
            result = simulate_with(base, workload, options, args.step_noise, seed)
            summary = result.summary()["classes"]
            itl_keys = ("itl_n", "itl_p50", "itl_p90", "itl_p99", "itl_mean")
            results[name] = {c: {**class_stats(outs), **{k: summary[c][k] for k in itl_keys}}
                             for c, outs in result.by_class().items()}
            results[name]["steps"] = result.replica_steps[0]
        out["runs"].append({"utilization": u, "seed": seed, "capacity_rps": capacity, "results": results})
        fcfs = results["fcfs"]
        for name, r in results.items():
            itl = ", ".join(f"{r[c]['itl_mean']:.3f}/{r[c]['itl_p90']:.3f}/{r[c]['itl_p99']:.3f}" for c in CLASSES)
            one, three = (r[c]["p99"] / fcfs[c]["p99"] for c in ("1img", "3img"))
            print(f"{u:4.2f} {seed:4d} {name:10s} | {itl} | {r['text']['p99'] / unloaded['text']:12.2f} | "
                  f"{one:13.2f} | {three:13.2f} | {r['3img']['mean']:9.2f} | {r['steps']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
