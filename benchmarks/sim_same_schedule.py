"""Does a refactor change what the scheduler decides? The fleet simulator (deterministic: a virtual clock and the
cost model's seconds) runs the same seeded workload through this checkout's scheduler and another's
(``--before DIR``), under each scheduling configuration, and compares every request's outcome: TTFT, end-to-end
time, refusal, predicted TTFT and lowered image budget, and each replica's step count.

    python benchmarks/sim_same_schedule.py --before /path/to/other/checkout [--json OUT]

Prints, per configuration, the steps of each and how many of the outcomes differ (0 means the same schedule).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {"default": {}, "fcfs": {"scheduling": "fcfs"}, "off": {"step_time_target": "off"},
           "least-work": {"long_order": "least-work"}, "itl": {"itl_target": "auto"},
           "slo": {"ttft_slo": "text=1.5,image=9"}, "optimistic": {"kv_admission": "optimistic"},
           "fixed": {"step_time_target": "0.25"}, "no-interrupt": {"encoder_interrupt": False}}

# run inside the checkout under test (its firsttoken on sys.path): COEF (a fit of `small`, fp32, on the AVX2 EPYC),
# the seed's mix at 0.3 requests/s, 200 requests
CHILD = r"""
import json, sys
from firsttoken.config import SchedulerConfig
try:
    from firsttoken.models.qwen2_vl_checkpoint import SIZES, build_hf_config
except ImportError:  # a checkout from before the recipes moved onto the families
    from firsttoken.models.checkpoint import SIZES, build_hf_config
from firsttoken.models.registry import model_config_from_dict
from firsttoken.tools import simulate as sim
coef, configs, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), {}
model = model_config_from_dict(build_hf_config(SIZES["small"]).to_dict())
for name, kw in configs.items():
    p = sim.Profile(coef, SchedulerConfig(**kw), num_kv_blocks=2048, preprocess_s={"0": 0.01, "1": 0.12, "2+": 0.4})
    r = sim.simulate(sim.seed_mix(model, rate=0.3, num_requests=200, seed=7), [p], sim.Router("round-robin"))
    out[name] = {"steps": r.replica_steps, "outcomes": [
        [o.ttft_s, o.e2e_s, o.refused, o.predicted_ttft_s, o.image_budget] for o in r.outcomes]}
json.dump(out, open(sys.argv[3], "w"))
"""

COEF = {"step": 0.0086, "sequences": 0.00118, "sampled": 0.00118, "prefill_tokens": 4.73e-4,
        "prefill_attention": 1.551e-7, "decode_tokens": 0.0, "decode_context": 1.373e-8,
        "encoder_patches": 6.62e-6, "encoder_attention": 1.01e-10}


def run(checkout: Path) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        subprocess.run([sys.executable, "-c", CHILD, json.dumps(COEF), json.dumps(CONFIGS), f.name], env=env,
                       cwd=checkout, check=True)
        return json.load(open(f.name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the other checkout's root")
    ap.add_argument("--json", type=Path, help="write the comparison here")
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    before, after = run(args.before.resolve()), run(here)
    report = {}
    for name in CONFIGS:
        a, b = before[name], after[name]
        differ = sum(x != y for x, y in zip(a["outcomes"], b["outcomes"]))
        fields = sorted({i for x, y in zip(a["outcomes"], b["outcomes"]) for i in range(5) if x[i] != y[i]})
        report[name] = {"steps_before": a["steps"], "steps_after": b["steps"], "outcomes": len(b["outcomes"]),
                        "differ": differ, "fields_that_differ": [("ttft", "e2e", "refused", "predicted_ttft",
                                                                  "image_budget")[i] for i in fields]}
        print(f"{name:13s} steps {a['steps']} -> {b['steps']}  outcomes that differ: {differ} of "
              f"{len(b['outcomes'])} {report[name]['fields_that_differ'] or ''}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
