"""Decode speed of the real server by torch thread count: one `firsttoken serve` per `--num-threads` value, all
up at once, requests alternating between them round by round (so load on the machine hits every side alike).

    python benchmarks/bench_server_threads.py [--model DIR] [--threads 1,2] [--rounds 4] [--json out.json]

Per round and server: one streamed 128-token answer (`ignore_eos`), its time per token from the first content chunk
to the last (batch 1); then 8 such requests at once, non-streamed, output tokens / wall time (batch 8, prefill of
the 8 short prompts included). Prints the median of the rounds and every round. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import small_model, start_server, stop_server  # noqa: E402
from machine import machine_info  # noqa: E402

OUTPUT_TOKENS = 128
BATCH = 8


def _body(stream: bool) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Tell me a story about the sea."}],
            "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "stream": stream, "temperature": 0}


def batch1_ms_per_token(base: str) -> float:
    times = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=_body(True), timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                times.append(time.perf_counter())
    return (times[-1] - times[0]) / (len(times) - 1) * 1000


def batch8_tokens_per_s(base: str) -> float:
    def one() -> None:
        httpx.post(f"{base}/v1/chat/completions", json=_body(False), timeout=600).raise_for_status()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(BATCH)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return BATCH * OUTPUT_TOKENS / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", default="1,2", help="--num-threads values, one server each")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = small_model(args.model)
    counts = [int(t) for t in args.threads.split(",")]
    servers = {}
    try:
        for n in counts:
            servers[n] = start_server(model, ["--num-threads", str(n)])
        for _, base in servers.values():  # warm-up
            batch1_ms_per_token(base)
        rounds: dict[int, dict[str, list[float]]] = {n: {"batch1_ms_per_token": [], "batch8_tokens_per_s": []}
                                                     for n in counts}
        for _ in range(args.rounds):
            for n, (_, base) in servers.items():
                rounds[n]["batch1_ms_per_token"].append(batch1_ms_per_token(base))
            for n, (_, base) in servers.items():
                rounds[n]["batch8_tokens_per_s"].append(batch8_tokens_per_s(base))
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    out = {"machine": machine_info(), "args": vars(args), "rounds": rounds}
    print(f"machine: {out['machine']}")
    print("threads | batch 1 ms/token (median; rounds)          | batch 8 tokens/s (median; rounds)")
    for n, r in rounds.items():
        b1, b8 = r["batch1_ms_per_token"], r["batch8_tokens_per_s"]
        print(f"{n:7d} | {statistics.median(b1):6.2f}; {', '.join(f'{x:.2f}' for x in b1):32s} | "
              f"{statistics.median(b8):6.1f}; {', '.join(f'{x:.1f}' for x in b8)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
