"""Issue 42's loaded check in the fleet simulator: --scheduling fcfs, the default, and the default without throughput
steps for a lone request, on the same seeded arrivals of the seed's mix (or a bench_slo.py run's own arrivals).
Prints, per load and size, each target ratio's median, range and how many seeds met it: text P99 / unloaded (<= 2.5x),
one- and three-image P99 / fcfs's (<= 1.05x). Deterministic; ~5 s of CPU per seed and load at n = 80.

    python benchmarks/sim_throughput_steps.py --coefficients docs/runs/slo/bench_slo-idle-U0.6-0.8-n80-avx2.json
    python benchmarks/sim_throughput_steps.py --trace docs/runs/slo/bench_slo-idle-U0.6-0.8-n80-avx2.json

"no-throughput" turns off the pacing policy's throughput steps on each simulated replica (there is no flag: under
--step-time-target auto a lone request always gets them). What the simulator cannot show: image decoding and HTTP
contending for the engine's cores, and a machine whose speed drifts between runs.

Each load's line also prints the text lane's price, 1 / (1 - U x text's share of the work): under fcfs a
three-image prompt waits for the text that arrived before it; with a text lane (text P99 within 2.5x of unloaded,
~1 s) it also waits for all text arriving while it waits or runs, so its sojourn stretches by about that factor
(a heuristic from work conservation, not a bound per request: the image classes also reorder among themselves).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import firsttoken.tools.simulate as sim
from firsttoken.config import SchedulerConfig
from sim_long_order import SMALL_AVX2, load_coefficients, small_model, unloaded_ttft

PREPROCESS_S = {"0": 0.005, "1": 0.15, "2+": 0.4}  # the AVX2 EPYC's bench_slo runs: medians per class
CONFIGS = ("fcfs", "default", "no-throughput")
TARGETS = {"text": 2.5, "1img": 1.05, "3img": 1.05}


class NoThroughputReplica(sim.SimReplica):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler.pacing.throughput_steps = False


def p99_by_class(base: sim.Profile, workload, config: str, noise: float, seed: int) -> dict[str, float]:
    profile = sim.replace_scheduler(base, scheduling="fcfs") if config == "fcfs" else base
    replica = sim.SimReplica
    sim.SimReplica = NoThroughputReplica if config == "no-throughput" else replica
    try:
        result = sim.simulate(workload, [profile], sim.Router("round-robin"), noise, seed)
    finally:
        sim.SimReplica = replica
    return {c: sim.nearest_rank(sorted(o.ttft_s for o in outs), 99) for c, outs in result.by_class().items()}


def text_lane_price(base: sim.Profile, model, u: float, seed: int) -> float:
    """1 / (1 - U x text's share of the seed mix's work), each class's work its end-to-end time alone."""
    work = sim.class_work_s(base, sim.seed_mix(model, rate=1.0, num_requests=300, seed=seed))
    return 1.0 / (1.0 - u * work["text"] / sum(work.values()))


def ratios(p99: dict[str, dict[str, float]], unloaded: dict[str, float]) -> dict[str, dict[str, float]]:
    return {config: {c: p99[config][c] / (unloaded["text"] if c == "text" else p99["fcfs"][c]) for c in TARGETS}
            for config in CONFIGS if config != "fcfs"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--coefficients", default=None, help="as sim_long_order.py's (default: small on AVX2)")
    ap.add_argument("--trace", default=None, help="a bench_slo.py JSON: replay each load's arrivals (its own cost "
                                                  "model unless --coefficients), seeds vary the step noise only")
    ap.add_argument("--utilizations", default="0.6,0.8")
    ap.add_argument("--num-requests", default="80,160")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--step-noise", type=float, default=0.1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = small_model()
    coefficients = load_coefficients(args.coefficients or args.trace) if args.coefficients or args.trace else SMALL_AVX2
    base = sim.Profile(coefficients, SchedulerConfig(), num_kv_blocks=8192, preprocess_s=PREPROCESS_S)
    unloaded = unloaded_ttft(base, model)
    loads = []  # (label, seed, workload)
    prices = {}  # label -> the text lane's price (seed 1's mix)
    if args.trace:
        data = json.loads(Path(args.trace).read_text())
        for key in (k for k in data if k.startswith("U=")):
            workload = sim.from_trace(data[key]["fcfs"]["records"], model)
            loads += [(f"{key} trace", seed, workload) for seed in range(1, args.seeds + 1)]
    else:
        for n in (int(x) for x in args.num_requests.split(",")):
            for u in (float(x) for x in args.utilizations.split(",")):
                prices[f"U={u} n={n}"] = text_lane_price(base, model, u, seed=1)
                for seed in range(1, args.seeds + 1):
                    capacity = sim.capacity_rps(base, sim.seed_mix(model, rate=1.0, num_requests=300, seed=seed))
                    loads.append((f"U={u} n={n}", seed, sim.seed_mix(model, rate=u * capacity, num_requests=n,
                                                                        seed=seed)))
    runs = []
    for label, seed, workload in loads:
        p99 = {config: p99_by_class(base, workload, config, args.step_noise, seed) for config in CONFIGS}
        runs.append({"load": label, "seed": seed, "p99_s": p99, "ratios": ratios(p99, unloaded)})
    print("unloaded TTFT: " + ", ".join(f"{c} {t:.2f} s" for c, t in sorted(unloaded.items())))
    print(f"{'load':16s} {'config':14s} | " + " | ".join(f"{c} (<= {t}x): median [range] met" for c, t in
                                                         TARGETS.items()))
    for label in dict.fromkeys(r["load"] for r in runs):
        for config in CONFIGS[1:]:
            cells = []
            for c, target in TARGETS.items():
                v = sorted(r["ratios"][config][c] for r in runs if r["load"] == label)
                cells.append(f"{statistics.median(v):.2f} [{v[0]:.2f}-{v[-1]:.2f}] {sum(x <= target for x in v)}/{len(v)}")
            price = f" | text lane's price {prices[label]:.2f}x" if label in prices else ""
            print(f"{label:16s} {config:14s} | " + " | ".join(cells) + price)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "coefficients": coefficients,
                                               "unloaded_ttft_s": unloaded, "runs": runs,
                                               "text_lane_price": prices}, indent=1))


if __name__ == "__main__":
    main()
