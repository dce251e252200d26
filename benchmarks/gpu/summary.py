"""The GPU table's summary, computed from the steps' JSON alone: each target's figure beside its threshold, met /
missed / not run (and why), the figures without a target, and each step's exit. Prints it and writes
RESULTS_DIR/summary.json (run.sh calls this on every exit, a timeout or an interrupt included).

    python benchmarks/gpu/summary.py RESULTS_DIR [--steps STEPS_TSV --start UNIX_S --status N]

``--steps``: run.sh's record of each command it ran (name, exit status, seconds, note; tab-separated); a step that
left no JSON is explained from it (timed out at its bound, or its exit status and log).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from manifest import BACKENDS, FIGURES, STEP_NAMES, TARGETS, Figure, Target, backend_verdict  # noqa: E402

TIMED_OUT = (124, 137)  # `timeout`'s exit status, and a KILL after its grace period


def read_steps(path: Path | None) -> list[dict[str, Any]]:
    """run.sh's steps.tsv as dicts; the last line of a step wins (a resumed run appends)."""
    if path is None or not path.exists():
        return []
    rows: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        name, rc, seconds, note = line.split("\t", 3)
        rows[name] = {"step": name, "rc": int(rc), "seconds": float(seconds), "timed_out": int(rc) in TIMED_OUT,
                      "note": note}  # fmt: skip
    return list(rows.values())


def load(results: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for name in STEP_NAMES:
        path = results / f"{name}.json"
        if path.exists():
            out[name] = json.loads(path.read_text())
    return out


def why_missing(step: str, steps: list[dict[str, Any]]) -> str:
    row = next((r for r in steps if r["step"] == step), None)
    if row is None:
        return f"the {step} step did not run"
    if row["timed_out"]:
        return f"the {step} step was stopped at its bound ({row['seconds']:.0f} s) before writing anything"
    return f"the {step} step exited {row['rc']} without a result (its log: {step}.log)"


def inputs(step: str, keys: tuple[str, ...], data: dict[str, dict[str, Any]],
           steps: list[dict[str, Any]]) -> tuple[list[Any] | None, str]:  # fmt: skip
    """The values of ``keys`` in ``step``'s JSON, or None and why they are not there."""
    result = data.get(step)
    if result is None:
        return None, why_missing(step, steps)
    for key in keys:
        if result["values"].get(key) is not None:
            continue
        if key in result["why"]:
            return None, result["why"][key]
        ended = f"ended {result['status']}" + (f": {result['error']}" if result.get("error") else "")
        return None, f"the {step} step {ended} before {key}"
    return [result["values"][k] for k in keys], ""


def fmt(value: float, unit: str) -> str:
    return f"{value:.0%}" if unit == "%" else f"{value:.2f}x" if unit == "x" else f"{value:,.1f} {unit}"


def judge(target: Target, data: dict[str, dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, Any]:
    values, why = inputs(target.step, target.keys, data, steps)
    row: dict[str, Any] = {"label": target.label, "op": target.op, "threshold": target.threshold,
                           "unit": target.unit, "how": target.how, "figure": None, "verdict": "not run", "why": why,
                           "inputs": None}  # fmt: skip
    if values is None:
        return row
    figure = target.figure(*values)
    met = figure <= target.threshold if target.op == "<=" else figure >= target.threshold
    return row | {"figure": figure, "verdict": "met" if met and math.isfinite(figure) else "missed", "why": "",
                  "inputs": dict(zip(target.keys, values))}


def figure_row(figure: Figure, data: dict[str, dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, Any]:
    values, why = inputs(figure.step, (figure.key,), data, steps)
    return {"label": figure.label, "value": values[0] if values else None, "unit": figure.unit, "why": why}


def gate_lines(data: dict[str, dict[str, Any]], steps: list[dict[str, Any]]) -> list[str]:
    gate = data.get("gate")
    if gate is None:
        return [f"gate: not run ({why_missing('gate', steps)}): every timing step skips"]
    values = gate["values"]
    verdicts = {b: backend_verdict(values, b) for b in BACKENDS}
    if gate["status"] == "done":
        head = "passed" if all(ok for ok, _ in verdicts.values()) else "FAILED"
    else:
        head = f"ended {gate['status']} ({gate.get('error') or 'stopped at its bound'})"
    per = ", ".join(f"{b} passed" if ok else f"{b} not cleared: {why}" for b, (ok, why) in verdicts.items())
    lines = [f"gate: {head} ({per}); timing runs only what it cleared; rule: {values.get('rule')}"]
    for key, case in values.items():
        if isinstance(case, dict):
            lines.append(f"  {key}: {case['verdict']}, {case['steps_argmax_equal']}/{case['steps']} tokens "
                         f"transformers' argmax, worst {case['max_deficit_over_sigma']:.3g} sigma (tolerance "
                         f"{case['tolerance_sigma']} sigma); generate equal: {case['generate_equal']}")  # fmt: skip
    return lines


def target_line(row: dict[str, Any]) -> str:
    target = f"target {row['op']} {fmt(row['threshold'], row['unit'])}"
    if row["verdict"] == "not run":
        return f"{row['label']}: -  {target}: not run ({row['why']})"
    given = ", ".join(f"{k} {v:.4g}" for k, v in row["inputs"].items())
    return f"{row['label']}: {fmt(row['figure'], row['unit'])} ({given})  {target}: {row['verdict']}"


def summarize(results: Path, steps: list[dict[str, Any]]) -> dict[str, Any]:
    data = load(results)
    settings = {d["setting"] for d in data.values()}
    stand_ins = next((d["stand_ins"] for d in data.values() if d.get("stand_ins")), {})
    return {"setting": "smoke" if "smoke" in settings else "device" if settings else None, "stand_ins": stand_ins,
            "gate": gate_lines(data, steps), "targets": [judge(t, data, steps) for t in TARGETS],
            "figures": [figure_row(f, data, steps) for f in FIGURES],
            "results": {name: {"status": d["status"], "seconds": d["seconds"], "error": d.get("error")}
                        for name, d in data.items()}}  # fmt: skip


def render(summary: dict[str, Any], steps: list[dict[str, Any]]) -> str:
    if summary["setting"] == "smoke":
        head = ("GPU table, SMOKE RUN: the CPU stands in for the device with tiny shapes; no figure here is a GPU's ("
                + "; ".join(f"{k}: {v}" for k, v in summary["stand_ins"].items()) + ")")
    else:
        head = "GPU table"
    lines = [head, *summary["gate"], ""]
    lines += [target_line(row) for row in summary["targets"]]
    lines.append("")
    for row in summary["figures"]:
        value = "-" if row["value"] is None else fmt(row["value"], row["unit"])
        lines.append(f"{row['label']}: {value}  (no target){'; not run: ' + row['why'] if row['why'] else ''}")
    counts = {v: sum(r["verdict"] == v for r in summary["targets"]) for v in ("met", "missed", "not run")}
    lines.append(f"\ntargets: {counts['met']} met, {counts['missed']} missed, {counts['not run']} not run")
    for row in steps:
        end = "timed out" if row["timed_out"] else f"exit {row['rc']}"
        lines.append(f"step {row['step']}: {end} after {row['seconds']:.1f} s ({row['note']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--steps", type=Path, default=None, help="run.sh's steps.tsv")
    parser.add_argument("--start", type=float, default=None, help="when the run began (unix seconds)")
    parser.add_argument("--status", type=int, default=None, help="run.sh's exit status")
    args = parser.parse_args(argv)
    steps = read_steps(args.steps)
    summary = summarize(args.results, steps)
    text = render(summary, steps)
    print(text)
    out = {"exit_status": args.status, "ok": args.status == 0,
           "total_seconds": round(time.time() - args.start, 1) if args.start else None, "steps": steps, **summary}
    (args.results / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    (args.results / "summary.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
