"""Overload with TTFT objectives, side by side in the fleet simulator: admitted P99 / objective per class, refusals,
goodput and the visual-token budget applied, for the seed's mix at U x the simulated capacity (firsttoken's own
scheduler and admission on a virtual clock, steps priced by the `small` checkpoint's AVX2 cost model; images
re-planned at lower budgets as the server's input processor does). Deterministic; seconds of CPU per run.

    python benchmarks/sim_overload.py --json out.json
    python benchmarks/sim_overload.py --utilizations 1.0,1.3 --seeds 1,2,3,4,5,6 \\
        --configs 'slo=;no-margin={"ttft_slo_wait_margin":0}'

Objectives as bench_slo.py derives them: text 3 x the unloaded text TTFT, images 1.5 x the unloaded three-image
TTFT. Every configuration runs with them except fcfs and lanes (no objectives). A config's JSON holds scheduler
options (SchedulerConfig fields). Goodput: requests whose first token met their class's
objective, per second of the arrivals' span. What it cannot show: image decoding and HTTP on the engine's cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sim_long_order import (
    PREPROCESS_S,
    SMALL_AVX2,
    load_coefficients,
    parse_configs,
    seed_mix_loads,
    simulate_with,
    small_model,
    unloaded_ttft,
)

import firsttoken.tools.simulate as sim
from firsttoken.config import ImageConfig, SchedulerConfig

DEFAULT_CONFIGS = 'slo=;no-margin={"ttft_slo_wait_margin":0}'
CLASSES = ("text", "1img", "3img")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--utilizations", default="1.3")
    ap.add_argument("--seeds", default="1,2,3,4,5,6")
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--step-noise", type=float, default=0.1, help="lognormal sigma of step times around the model")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="name=JSON scheduler options;... (with objectives)")
    ap.add_argument("--coefficients", default=None, help="as sim_long_order.py's (default: small on AVX2)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = small_model()
    coefficients = load_coefficients(args.coefficients) if args.coefficients else SMALL_AVX2
    base = sim.Profile(coefficients, SchedulerConfig(), num_kv_blocks=8192, preprocess_s=PREPROCESS_S, model=model)
    unloaded = unloaded_ttft(base, model)
    objective = {"text": 3 * unloaded["text"], "image": 1.5 * unloaded["3img"]}
    flag = f"text={objective['text']:.3f},image={objective['image']:.3f}"
    configs = {"fcfs": {"scheduling": "fcfs"}, "lanes": {}}
    configs.update({name: {"ttft_slo": flag, **options} for name, options in parse_configs(args.configs).items()})
    out: dict = {"args": vars(args), "coefficients": coefficients, "unloaded_ttft_s": unloaded,
                 "objective_s": objective, "runs": []}
    print(f"unloaded TTFT: {unloaded}; objectives (--ttft-slo {flag})")
    print(f"{'U':>4s} {'seed':>4s} {'config':12s} | goodput/s | admitted P99 / objective (refused, mean budget): "
          "text, 1img, 3img")
    full = ImageConfig().image_max_tokens
    for u, seed, capacity, workload in seed_mix_loads(base, model, args.utilizations, args.seeds,
                                                      args.num_requests):
        span = workload[-1].arrival_s - workload[0].arrival_s
        results = {}
        for name, options in configs.items():
            result = simulate_with(base, workload, options, args.step_noise, seed)
            classes, good = {}, 0
            for cls, outs in result.by_class().items():
                obj = objective["text" if cls == "text" else "image"]
                ttft = sorted(o.ttft_s for o in outs if o.ttft_s is not None)
                good += sum(t <= obj for t in ttft)
                budgets = [o.image_budget or full for o in outs if o.ttft_s is not None]
                classes[cls] = {"n": len(ttft), "refused": sum(o.refused is not None for o in outs),
                                "p99_s": sim.nearest_rank(ttft, 99), "p99_over_objective":
                                sim.nearest_rank(ttft, 99) / obj if ttft else None,
                                "mean_image_budget": sum(budgets) / len(budgets) if cls != "text" and budgets
                                else None}
            results[name] = {"goodput_rps": good / span, "classes": classes}
            cells = ", ".join(
                f"{classes[c]['p99_over_objective']:.2f} ({classes[c]['refused']}"
                + (f", {classes[c]['mean_image_budget']:.0f})" if classes[c]["mean_image_budget"] else ")")
                for c in CLASSES)
            print(f"{u:4.2f} {seed:4d} {name:12s} | {good / span:9.4f} | {cells}", flush=True)
        out["runs"].append({"utilization": u, "seed": seed, "capacity_rps": capacity, "results": results})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
