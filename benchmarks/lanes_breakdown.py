"""Where an image request's time goes under load: the lanes against fcfs on the same arrivals, from the accounting
``usage.firsttoken`` carries on every answer (issue 52's breakdown).

    python benchmarks/lanes_breakdown.py RUN.json [RUN.json ...] [--json OUT]

RUN.json: a ``benchmarks/bench_slo.py --json`` file. For each load and configuration, per class (n beside every
figure): TTFT P50 / P99, and the medians of the phases from the end of preprocessing to the first token, each
request's every second accounted for: handoff (until the engine thread took it), its images' encoder compute, the
forwards that carried its chunks, the rest of its own steps (scheduling, other rows' encoder work in them), other
requests' steps, the engine idle; the steps it took (its prefill steps, all steps to its first token), its
preemptions. Then each configuration's whole run: the engine's busy seconds each class's own steps cost (sum of
encoder + forward + own-step overhead, which counts a shared step once per request that rode it: an upper bound on
the class's work), the encoder interrupts and preemptions, and the work per second of arrivals served.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_slo import nearest_rank

PHASES = ("handoff_s", "encoder_compute_s", "forward_s", "step_overhead_s", "other_steps_s", "engine_idle_s")
COUNTS = ("prefill_steps", "steps_to_first_token", "preemptions")


def breakdown(run: dict) -> dict:
    """Per class: n, TTFT P50/P99, the median of each phase and count, and the class's own-step seconds summed."""
    records = [r for r in run["records"] if not r["warmup"] and r["error"] is None and r["server_timings"]]
    out: dict = {}
    for cls in sorted({r["cls"] for r in records}):
        rs = [r for r in records if r["cls"] == cls]
        t = [r["server_timings"] for r in rs]
        row = {"n": len(rs), "ttft_p50": nearest_rank([r["ttft_s"] for r in rs], 50),
               "ttft_p99": nearest_rank([r["ttft_s"] for r in rs], 99)}
        for key in PHASES + COUNTS:
            values = [x[key] for x in t if x.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        row["own_steps_s_sum"] = sum((x.get("encoder_compute_s") or 0) + (x.get("forward_s") or 0)
                                     + (x.get("step_overhead_s") or 0) for x in t)
        out[cls] = row
    totals = (run.get("server") or {}).get("totals") or {}
    out["_run"] = {"encoder_interrupts": totals.get("encoder_interrupts"), "preemptions": totals.get("preemptions"),
                   "step_time_target_s": ((run.get("server") or {}).get("cost_model") or {}).get("step_time_target_s")}
    return out


def render(name: str, b: dict) -> list[str]:
    lines = [f"  {name}: encoder interrupts {b['_run']['encoder_interrupts']}, preemptions "
             f"{b['_run']['preemptions']}, step bound {b['_run']['step_time_target_s']}"]
    head = "    class   n  TTFT P50   P99 | " + " ".join(f"{k[:-2] if k.endswith('_s') else k:>13s}" for k in
                                                       PHASES) + " | steps(prefill, to 1st) | own steps s (sum)"
    lines.append(head)
    for cls, row in b.items():
        if cls == "_run":
            continue
        phases = " ".join(f"{row[k]:13.3f}" if row[k] is not None else f"{'-':>13s}" for k in PHASES)
        steps = f"{row['prefill_steps'] or 0:5.0f} {row['steps_to_first_token'] or 0:5.0f}"
        lines.append(f"    {cls:5s} {row['n']:3d} {row['ttft_p50']:8.2f} {row['ttft_p99']:6.2f} | {phases} | "
                     f"{steps:>22s} | {row['own_steps_s_sum']:8.1f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out: dict = {}
    for path in args.runs:
        data = json.loads(path.read_text())
        print(f"{path.name}: machine {data.get('machine')}")
        for load, results in data.items():
            if not load.startswith("U="):
                continue
            print(f" {load}")
            for name, run in results.items():
                b = breakdown(run)
                out.setdefault(path.name, {}).setdefault(load, {})[name] = b
                print("\n".join(render(name, b)))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
