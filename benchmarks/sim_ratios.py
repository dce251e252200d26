"""The simulator's prediction of a loaded run's ratios (issue 52), beside what the run measured.

    python benchmarks/sim_ratios.py RUN.json [--json OUT.json] [--model DIR]

RUN.json: a `bench_slo.py` run with `fcfs` and `default` configurations. For each load in it, the simulator replays
the run's own arrivals, classes and token counts (the fcfs records; both configurations got the same arrivals)
through one replica priced by the `default` server's step-cost model as it stood after its run (in sample) with each
class's measured mean preprocess seconds, once with default flags and once with `--scheduling fcfs`, and prints
each ratio the benchmark judges: each image class's P50 and P99 default / fcfs, and text P99 / unloaded (the
simulated unloaded text TTFT: one text request alone). The simulator's validated error on a TTFT percentile is
4-27% (optimistic; docs/scaling.md "Validation on this machine"): a ratio is predicted "within" when the simulated
ratio is within 27% of the measured one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import small_model  # noqa: E402
from bench_slo import nearest_rank  # noqa: E402

from firsttoken.config import SchedulerConfig  # noqa: E402
from firsttoken.models.registry import load_model_config  # noqa: E402
from firsttoken.tools import simulate as sim  # noqa: E402

VALIDATED_ERROR = 0.27  # docs/scaling.md: the simulator's largest error on a TTFT percentile, one replica
SERVER_CLASS = {"text": "0", "1img": "1", "3img": "2+"}  # bench_slo's classes -> the server's image classes


def profile(records: list[dict], server: dict, scheduler: SchedulerConfig) -> sim.Profile:
    """The run's server as a simulator profile: its fitted coefficients, each class's measured preprocess mean."""
    pre: dict[str, list[float]] = {}
    for r in records:
        seconds = (r.get("server_timings") or {}).get("preprocess_s")
        if seconds is not None:
            pre.setdefault(SERVER_CLASS.get(r["cls"], "0"), []).append(float(seconds))
    return sim.Profile(dict(server["cost_model"]["coefficients"]), scheduler,
                       preprocess_s={c: sum(v) / len(v) for c, v in pre.items()})


def ttfts(result: sim.SimResult) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for o in result.outcomes:
        if o.ttft_s is not None:
            out.setdefault(o.request.cls, []).append(o.ttft_s)
    return out


def measured_ttfts(records: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in records:
        if r.get("ttft_s") is not None and not r.get("warmup"):
            out.setdefault(r["cls"], []).append(float(r["ttft_s"]))
    return out


def ratios(default: dict[str, list[float]], fcfs: dict[str, list[float]], unloaded_text_s: float) -> dict[str, float]:
    out = {"text P99 / unloaded": nearest_rank(default["text"], 99) / unloaded_text_s}
    for cls in ("1img", "3img"):
        for q in (50, 99):
            out[f"{cls} P{q} default / fcfs"] = nearest_rank(default[cls], q) / nearest_rank(fcfs[cls], q)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--model", default=None, help="the checkpoint the run served (default: the `small` one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    run = json.loads(Path(args.run).read_text())
    model = load_model_config(small_model(args.model))
    out: dict[str, dict] = {"run": args.run, "machine": run.get("machine"), "loads": {}}
    print(f"{args.run}: machine {run.get('machine')}")
    for key, load in run.items():
        if not key.startswith("U=") or "fcfs" not in load or "default" not in load:
            continue
        records = load["fcfs"]["records"]
        trace = sim.from_trace(records, model)
        lanes = profile(load["default"]["records"], load["default"]["server"], SchedulerConfig())
        fcfs = sim.replace_scheduler(lanes, scheduling="fcfs")
        router = sim.Router("round-robin")
        text = next(r for r in trace if r.cls == "text")
        alone = sim.simulate([sim.SimRequest("alone", 0.0, "text", text.text_tokens, (), text.output_tokens)],
                             [lanes], router).outcomes[0].ttft_s
        simulated = ratios(ttfts(sim.simulate(trace, [lanes], router)), ttfts(sim.simulate(trace, [fcfs], router)),
                           alone)
        unloaded = run["calibration"]["unloaded_ttft_s"]["text"]
        measured = ratios(measured_ttfts(load["default"]["records"]), measured_ttfts(records), unloaded)
        rows = {}
        print(f"\n{key}: ratio                     measured  simulated  error")
        for name, m in measured.items():
            s = simulated[name]
            err = s / m - 1
            rows[name] = {"measured": m, "simulated": s, "error": err, "within": abs(err) <= VALIDATED_ERROR}
            print(f"  {name:26s} {m:8.2f}x {s:9.2f}x {err:+6.0%}  "
                  f"{'within' if abs(err) <= VALIDATED_ERROR else 'OUTSIDE'} {VALIDATED_ERROR:.0%}")
        out["loads"][key] = {"ratios": rows, "profile": lanes.to_dict(), "simulated_unloaded_text_s": alone}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
