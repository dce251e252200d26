"""Where a served decode token's time goes beyond the engine's own step: streamed 128-token answers at batch 1 and
batch 8 (bench_llamacpp.py's bodies and client), and for each round

- the client's measure: ms per token (batch 1) or all output tokens / wall time (batch 8);
- the server's own steps over the round: mean ``firsttoken_step_duration_seconds`` from /metrics (sum and count
  read before and after), and the steps' share of the round's wall time;
- the server process's CPU time per output token from /proc (Linux): its main thread (uvicorn's event loop: HTTP,
  SSE framing, the API's per-token work) and every other thread together (the engine thread, the kernels' and
  torch's workers, preprocessing).

With --baseline, a second server from another checkout (its firsttoken package first on PYTHONPATH) runs beside
this one and rounds alternate between them, so load from elsewhere on the machine falls on both alike. Compare the
server's step with ``bench_decode.py`` (the same step in process, no HTTP) to see what serving adds. A benchmark,
not a test.

    python benchmarks/bench_served_overhead.py --model DIR --rounds 4 [--baseline /path/to/checkout] [--json out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_llamacpp as peer  # noqa: E402
from _common import checkout, small_model, start_server, stop_server  # noqa: E402
from machine import machine_info  # noqa: E402

FLAGS = ["--dtype", "float32", "--num-threads", "2", "--no-prefix-cache", "--no-encoder-cache"]


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """(main thread, every other thread) seconds on a CPU so far, from /proc/<pid>/task/*/schedstat."""
    main = other = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                seconds = int(f.read().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        if int(tid) == pid:
            main += seconds
        else:
            other += seconds
    return main, other


def step_totals(base: str) -> tuple[float, float]:
    """(seconds, count) of the server's steps so far: firsttoken_step_duration_seconds' sum and count."""
    text = httpx.get(f"{base}/metrics", timeout=30).text

    def value(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return value("firsttoken_step_duration_seconds_sum"), value("firsttoken_step_duration_seconds_count")


async def _decode(base: str, batch: int, key: str) -> tuple[float, int]:
    """(wall seconds from first send to last token, output tokens) for ``batch`` concurrent answers."""
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        start = time.perf_counter()
        timings = await asyncio.gather(*(peer.stream_chat(client, peer.decode_body(f"{key}:{i}"))
                                         for i in range(batch)))  # fmt: skip
        wall = time.perf_counter() - start
    if batch == 1:  # from the first token: the prefill is not decode
        return timings[0].end_s - timings[0].ttft_s, (timings[0].completion_tokens or 1) - 1
    return wall, sum(t.completion_tokens or 0 for t in timings)


def one_round(base: str, pid: int, batch: int, key: str) -> dict:
    steps0, cpu0, t0 = step_totals(base), thread_cpu_s(pid), time.perf_counter()
    seconds, tokens = asyncio.run(_decode(base, batch, key))
    wall = time.perf_counter() - t0
    steps1, cpu1 = step_totals(base), thread_cpu_s(pid)
    step_s, num_steps = steps1[0] - steps0[0], steps1[1] - steps0[1]
    return {
        "client": seconds / tokens * 1e3 if batch == 1 else tokens / seconds,  # ms/token, or tokens/s
        "tokens": tokens,
        "steps": num_steps,
        "step_ms": step_s / num_steps * 1e3 if num_steps else None,
        "steps_share_of_wall": step_s / wall,
        "main_cpu_ms_per_token": (cpu1[0] - cpu0[0]) / tokens * 1e3,
        "other_cpu_ms_per_token": (cpu1[1] - cpu0[1]) / tokens * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the `small` one, built once)")
    ap.add_argument("--baseline", default=None, help="another checkout's root: its server runs beside this one")
    ap.add_argument("--flags", default=" ".join(FLAGS), help="serve flags of every server")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = str(Path(small_model(args.model)).resolve())
    flags = args.flags.split()
    sides = {"this": None, **({"baseline": str(Path(args.baseline).resolve())} if args.baseline else {})}
    results: dict = {"machine": machine_info(), "flags": flags, "rounds": {name: [] for name in sides}}
    with ExitStack() as stack:
        servers = {}
        for name, root in sides.items():
            with checkout(Path(root) if root else None):
                proc, base = start_server(model, flags)
            stack.callback(stop_server, proc)
            servers[name] = (proc.pid, base)
        for r in range(args.rounds + 1):  # round 0 warms every server up and is dropped
            names = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in names:
                pid, base = servers[name]
                rounds = {f"batch{b}": one_round(base, pid, b, f"{name}:{r}:{b}") for b in (1, 8)}
                if r:
                    results["rounds"][name].append(rounds)
    print(f"machine: {results['machine']}; {args.rounds} rounds, medians")
    summary = {}
    for name, rounds in results["rounds"].items():
        summary[name] = {}
        for b in ("batch1", "batch8"):
            med = {k: statistics.median(x[b][k] for x in rounds) for k in rounds[0][b] if rounds[0][b][k] is not None}
            summary[name][b] = med
            unit = "ms/token" if b == "batch1" else "tokens/s"
            print(f"{name:9s} {b}: client {med['client']:.2f} {unit}, server step {med['step_ms']:.2f} ms, steps "
                  f"{med['steps_share_of_wall']:.0%} of the wall time; CPU per token: main thread (event loop) "
                  f"{med['main_cpu_ms_per_token']:.3f} ms, other threads {med['other_cpu_ms_per_token']:.2f} ms")
    results["summary"] = summary
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
