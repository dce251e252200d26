"""The long lane's order, side by side in the fleet simulator (firsttoken's own scheduler on a virtual clock, steps
priced by a cost model fitted on an AVX2 machine for the `small` checkpoint): P99 TTFT per class against
--scheduling fcfs on the same arrivals, and the admission prediction's error, for the seed's mix at a rate
calibrated to U x the simulated capacity. Deterministic (seeded arrivals, seeded step noise); seconds of CPU per run.

    python benchmarks/sim_long_order.py --json out.json
    python benchmarks/sim_long_order.py --configs 'deadline=;least-work={"long_order":"least-work"}'
    # priced by another machine's fitted model: a server's /stats, a bench_slo.py JSON, or a JSON of coefficients
    python benchmarks/sim_long_order.py --coefficients docs/runs/slo/bench_slo-epyc-bf16-U0.8-n120-b.json

Why a simulator: a server run of 160 requests takes ~15 minutes per configuration and its P99 of 27 three-image
requests is their maximum; here every configuration sees 600 requests, three seeds, in a world whose steps cost
what the cost model says (what it cannot show: image decoding and HTTP contending for the engine's cores).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import firsttoken.tools.simulate as sim
from firsttoken.config import SchedulerConfig
from firsttoken.models.qwen2_vl_checkpoint import SIZES, build_hf_config
from firsttoken.models.registry import model_config_from_dict

# the `small` checkpoint on an AVX2 machine, as its start-up calibration fitted it (tests/unit/test_simulate.py)
SMALL_AVX2 = {"step": 0.01745, "sequences": 0.0, "sampled": 0.0, "prefill_tokens": 3.827e-4,
              "prefill_attention": 1.551e-7, "decode_tokens": 0.0, "decode_context": 1.373e-8,
              "encoder_patches": 6.62e-6, "encoder_attention": 1.01e-10}
PREPROCESS_S = {"0": 0.01, "1": 0.12, "2+": 0.4}
DEFAULT_CONFIGS = ('deadline=;least-work={"long_order":"least-work"};fifo-in-lane={"long_slack":0};'
                   'deadline-slack-2={"long_slack":2}')


def parse_configs(text: str) -> dict[str, dict]:
    configs = {}
    for part in text.split(";"):
        name, _, options = part.partition("=")
        configs[name.strip()] = json.loads(options) if options.strip() else {}
    return configs


def load_coefficients(text: str) -> dict[str, float]:
    """A JSON object of coefficients, or a file holding one, a server's /stats, or a bench_slo.py JSON."""
    path = Path(text)
    data = json.loads(path.read_text() if path.exists() else text)
    if "machine" in data:  # a bench_slo.py JSON: the server of its last load's `default` run
        data = [v["default"]["server"] for k, v in data.items() if k.startswith("U=") and "server" in v["default"]][-1]
    if "cost_model" in data:  # a server's /stats (or the part of it a bench_slo.py run keeps)
        return sim.Profile.from_stats(data).coefficients
    return {k: float(v) for k, v in data.items()}


def small_model():
    """The `small` checkpoint's model config (no weights: the simulator prices its steps)."""
    return model_config_from_dict(build_hf_config(SIZES["small"]).to_dict())


def seed_mix_loads(base: sim.Profile, model, utilizations: str, seeds: str, num_requests: int):
    """(U, seed, capacity, workload) for each load and seed ("0.6,0.8", "1,2,3"): the seed's mix of num_requests at
    U x the capacity the profile has for that seed's mix."""
    for u in [float(x) for x in utilizations.split(",")]:
        for seed in [int(x) for x in seeds.split(",")]:
            capacity = sim.capacity_rps(base, sim.seed_mix(model, rate=1.0, num_requests=300, seed=seed))
            yield u, seed, capacity, sim.seed_mix(model, rate=u * capacity, num_requests=num_requests, seed=seed)


def simulate_with(base: sim.Profile, workload, options: dict, step_noise: float, seed: int) -> sim.SimResult:
    """One replica of ``base`` with scheduler ``options`` (SchedulerConfig fields) on ``workload``."""
    return sim.simulate(workload, [sim.replace_scheduler(base, **options)], sim.Router("round-robin"), step_noise, seed)


def unloaded_ttft(base: sim.Profile, model) -> dict[str, float]:
    """Each class's median TTFT with requests arriving far apart (30 of the seed's mix, one at a time)."""
    alone = sim.simulate(sim.seed_mix(model, rate=0.001, num_requests=30, seed=1), [base], sim.Router("round-robin"))
    return {c: sorted(o.ttft_s for o in outs)[len(outs) // 2] for c, outs in alone.by_class().items()}


def class_stats(outcomes) -> dict[str, float | int | None]:
    ttft = sorted(o.ttft_s for o in outcomes if o.ttft_s is not None)
    err = sorted(abs(o.predicted_ttft_s - o.ttft_s) / o.ttft_s for o in outcomes
                 if o.ttft_s and o.predicted_ttft_s is not None)
    return {"n": len(ttft), "p50": sim.nearest_rank(ttft, 50), "p99": sim.nearest_rank(ttft, 99),
            "mean": sum(ttft) / len(ttft) if ttft else None,
            "pred_err_p50": sim.nearest_rank(err, 50), "pred_err_p90": sim.nearest_rank(err, 90)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--utilizations", default="0.6,0.8,0.95")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--step-noise", type=float, default=0.1, help="lognormal sigma of step times around the model")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="name=JSON scheduler options;...")
    ap.add_argument("--zero-step-constant", action="store_true",
                    help="price steps without the per-step constant (what the time bound's extra steps cost)")
    ap.add_argument("--coefficients", default=None,
                    help="the step-cost model to price steps with: a JSON object of coefficients, or a file holding "
                         "one, a server's /stats, or a bench_slo.py JSON (its last `default` run's server); default: "
                         "the small checkpoint's on an AVX2 machine")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = small_model()
    coefficients = load_coefficients(args.coefficients) if args.coefficients else SMALL_AVX2
    coefficients = {**coefficients, "step": 0.0} if args.zero_step_constant else coefficients
    base = sim.Profile(coefficients, SchedulerConfig(), num_kv_blocks=8192, preprocess_s=PREPROCESS_S)
    configs = {"fcfs": {"scheduling": "fcfs"}, **parse_configs(args.configs)}
    unloaded = unloaded_ttft(base, model)
    out: dict = {"args": vars(args), "coefficients": coefficients, "unloaded_ttft_s": unloaded, "runs": []}
    print("unloaded TTFT: " + ", ".join(f"{c} {t:.2f} s" for c, t in sorted(unloaded.items())))
    print(f"{'U':>4s} {'seed':>4s} {'config':16s} | text P99/unloaded | 1img P99/fcfs | 3img P99/fcfs | "
          f"pred err P50/P90: text, 1img, 3img")
    for u, seed, capacity, workload in seed_mix_loads(base, model, args.utilizations, args.seeds,
                                                      args.num_requests):
        results = {}
        for name, options in configs.items():
            result = simulate_with(base, workload, options, args.step_noise, seed)
            by_class = result.by_class()
            results[name] = {c: class_stats(outs) for c, outs in by_class.items()}
        out["runs"].append({"utilization": u, "seed": seed, "capacity_rps": capacity, "results": results})
        fcfs = results["fcfs"]
        for name, r in results.items():
            errs = ", ".join(f"{r[c]['pred_err_p50']:.0%}/{r[c]['pred_err_p90']:.0%}"
                             for c in ("text", "1img", "3img"))
            one, three = (r[c]["p99"] / fcfs[c]["p99"] for c in ("1img", "3img"))
            print(f"{u:4.2f} {seed:4d} {name:16s} | {r['text']['p99'] / unloaded['text']:17.2f} | "
                  f"{one:13.2f} | {three:13.2f} | {errs}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
