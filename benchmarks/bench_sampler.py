"""The sampler's time per decode step, this checkout vs a baseline checkout, side by side: ``Sampler.sample`` on
random logits of a vocabulary's size for the sampling settings chat services send (greedy; Qwen2-VL's
generation_config: top-k 1 with a repetition penalty; Qwen3-VL's: temperature 0.7, top-k 20, top-p 0.8; a client's
temperature 0.7 + top-p 0.9; plain temperature 1), at 1 and 8 rows, each row with a 140-token history. One process
per side and round, rounds alternating; one torch thread (the server's decode thread); medians over rounds.

    python benchmarks/bench_sampler.py --baseline /path/to/old/checkout --rounds 3 --json out.json
    python benchmarks/bench_sampler.py --baseline /path/to/old/checkout --vocab 151936   # Qwen2-VL's real vocabulary
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import machine_info  # noqa: E402

CASES = {
    "greedy": {"temperature": 0.0},
    "qwen2-vl default (top-k 1, repetition 1.05)": {"temperature": 0.01, "top_p": 0.001, "top_k": 1,
                                                    "repetition_penalty": 1.05},
    "qwen3-vl default (t 0.7, top-k 20, top-p 0.8)": {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
    "t 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "t 1.0": {"temperature": 1.0},
}

ONE_RUN = r"""
import json, sys, time, torch
from firsttoken.sampling.penalties import TokenHistory
from firsttoken.sampling.sampler import Sampler, SampleRow
from firsttoken.types import SamplingParams
torch.set_num_threads(1)
cases, vocab, repeats = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
gen = torch.Generator().manual_seed(0)
prompt, output = list(range(100, 140)), list(range(500, 600))
out = {}
for label, params in cases.items():
    for rows in (1, 8):
        p = SamplingParams(max_tokens=16, **params)
        batch = [SampleRow(p, None, prompt, output, TokenHistory(prompt, output)) for _ in range(rows)]
        logits = torch.randn(rows, vocab, generator=gen) * 3
        sampler = Sampler(0)
        for _ in range(5):
            sampler.sample(logits, batch)
        start = time.perf_counter()
        for _ in range(repeats):
            sampler.sample(logits, batch)
        out[f"{label} | {rows}"] = (time.perf_counter() - start) / repeats
print(json.dumps(out))
"""


def run_once(checkout: Path, vocab: int, repeats: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, "-c", ONE_RUN, json.dumps(CASES), str(vocab), str(repeats)], env=env,
                          capture_output=True, text=True, check=True, cwd=checkout)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="another checkout of firsttoken")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=16064, help="logits per row (the `small` checkpoint's vocabulary)")
    ap.add_argument("--repeats", type=int, default=50, help="sample() calls per case and round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sides = {"baseline": Path(args.baseline).resolve(), "this": Path(__file__).resolve().parents[1]}
    machine = machine_info()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, checkout in sides.items():
            runs[name].append(run_once(checkout, args.vocab, args.repeats))
    print(f"CPU {machine['cpu']}, flags {' '.join(machine['cpu_flags'])}; vocabulary {args.vocab}; one thread; "
          f"medians of {args.rounds} rounds, alternating")
    summary = {}
    for key in runs["this"][0]:
        before = statistics.median(r[key] for r in runs["baseline"])
        after = statistics.median(r[key] for r in runs["this"])
        summary[key] = {"baseline_us": before * 1e6, "this_us": after * 1e6, "ratio": after / before}
        label, rows = key.split(" | ")
        print(f"{label:48s} {rows:>2s} rows: baseline {before * 1e6:8.0f} us  this {after * 1e6:8.0f} us  "
              f"this/baseline {after / before:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "machine": machine, "runs": runs,
                                               "summary": summary}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
