"""The scheduler's own CPU per engine step (the Python between two forwards), this checkout vs a baseline checkout,
side by side: the fleet simulator drives firsttoken's Scheduler through the seed's mix at U = 0.8 (600 requests;
steps cost nothing real, so the process's CPU time is the scheduler's: schedule, update, backlog, admission
checks), alternating the two checkouts round by round, one process each.

    python benchmarks/bench_scheduler_step.py --baseline /path/to/old/checkout --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ONE_RUN = r"""
import json, time
import firsttoken.tools.simulate as sim
from firsttoken.config import SchedulerConfig
from firsttoken.models.qwen2_vl_checkpoint import SIZES, build_hf_config
from firsttoken.models.registry import model_config_from_dict
coefficients = {"step": 0.01745, "sequences": 0.0, "sampled": 0.0, "prefill_tokens": 3.827e-4,
                "prefill_attention": 1.551e-7, "decode_tokens": 0.0, "decode_context": 1.373e-8,
                "encoder_patches": 6.62e-6, "encoder_attention": 1.01e-10}
model = model_config_from_dict(build_hf_config(SIZES["small"]).to_dict())
preprocess_s = {"0": 0.01, "1": 0.12, "2+": 0.4}
profile = sim.Profile(coefficients, SchedulerConfig(), num_kv_blocks=8192, preprocess_s=preprocess_s)
capacity = sim.capacity_rps(profile, sim.seed_mix(model, rate=1.0, num_requests=300, seed=1))
workload = sim.seed_mix(model, rate=0.8 * capacity, num_requests=600, seed=1)
start = time.process_time()
result = sim.simulate(workload, [profile], sim.Router("round-robin"))
cpu = time.process_time() - start
print(json.dumps({"cpu_s": cpu, "steps": sum(result.replica_steps)}))
"""


def run_once(checkout: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    # cwd: `python -c` puts it first on sys.path, ahead of PYTHONPATH (run from another checkout, it ran that one)
    out = subprocess.run([sys.executable, "-c", ONE_RUN], env=env, cwd=checkout, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="another checkout of firsttoken")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sides = {"baseline": Path(args.baseline).resolve(), "this": Path(__file__).resolve().parents[1]}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, checkout in sides.items():
            runs[name].append(run_once(checkout))
    out = {"args": vars(args), "runs": runs, "summary": {}}
    for name, rs in runs.items():
        per_step = [r["cpu_s"] / r["steps"] * 1e6 for r in rs]
        out["summary"][name] = {"steps": rs[0]["steps"], "us_per_step_median": statistics.median(per_step),
                                "us_per_step": per_step}
        print(f"{name:9s} steps {rs[0]['steps']:6d}  scheduler CPU per step: median "
              f"{statistics.median(per_step):7.1f} us  (rounds {', '.join(f'{x:.1f}' for x in per_step)})")
    b, t = (out["summary"][n]["us_per_step_median"] for n in ("baseline", "this"))
    print(f"this / baseline: {t / b:.2f}x per step")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
