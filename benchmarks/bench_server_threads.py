"""Decode speed of the real server by torch thread count: one `firsttoken serve` per configuration, all up at
once, requests alternating between them round by round (so load on the machine hits every side alike).

    python benchmarks/bench_server_threads.py [--model DIR] [--threads 1,2] [--rounds 4] [--json out.json]
    python benchmarks/bench_server_threads.py --configs "all=--num-threads 2 --decode-threads 2;auto=--num-threads 2"

`--threads 1,2` is short for `--configs "1=--num-threads 1;2=--num-threads 2"`.

Per round and server: one streamed 128-token answer (`ignore_eos`), its time per token from the first content chunk
to the last (batch 1); then 8 such requests at once, non-streamed, output tokens / wall time (batch 8, prefill of
the 8 short prompts included); and the time to first token of an ~800-token text prompt sent alone (prefill; a
one-token answer). Prints the median of the rounds and every round. A benchmark, not a test.
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


_NONCE = iter(range(10**9))


def text_ttft_s(base: str) -> float:
    """Wall time of a one-token answer (not streamed: the stream's first chunk is the role, sent before any token)."""
    # ~800 tokens with the chat template; a new first word each call, so no prefix of it is cached
    words = f"{next(_NONCE)} " + " ".join(f"word{i % 97}" for i in range(270))
    body = {"model": "m", "messages": [{"role": "user", "content": words}], "max_tokens": 1}
    t0 = time.perf_counter()
    resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    resp.raise_for_status()
    elapsed = time.perf_counter() - t0
    _PROMPT_TOKENS.add(resp.json()["usage"]["prompt_tokens"])
    return elapsed


_PROMPT_TOKENS: set[int] = set()


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
    ap.add_argument("--configs", default=None,
                    help="label=server flags, separated by ';' (instead of --threads)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = small_model(args.model)
    if args.configs:
        configs = {label.strip(): flags.split() for label, _, flags in
                   (c.partition("=") for c in args.configs.split(";") if c.strip())}
    else:
        configs = {t: ["--num-threads", t] for t in args.threads.split(",")}
    metrics = ("batch1_ms_per_token", "batch8_tokens_per_s", "text_ttft_s")
    servers = {}
    try:
        for label, flags in configs.items():
            servers[label] = start_server(model, flags)
        for _, base in servers.values():  # warm-up
            batch1_ms_per_token(base)
            text_ttft_s(base)
        rounds: dict[str, dict[str, list[float]]] = {label: {m: [] for m in metrics} for label in configs}
        for _ in range(args.rounds):
            for label, (_, base) in servers.items():
                rounds[label]["batch1_ms_per_token"].append(batch1_ms_per_token(base))
            for label, (_, base) in servers.items():
                rounds[label]["batch8_tokens_per_s"].append(batch8_tokens_per_s(base))
            for label, (_, base) in servers.items():
                rounds[label]["text_ttft_s"].append(text_ttft_s(base))
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    out = {"machine": machine_info(), "args": vars(args), "rounds": rounds}
    print(f"machine: {out['machine']}")
    print("config | batch 1 ms/token (median; rounds) | batch 8 tokens/s (median; rounds) | "
          "text TTFT s (median; rounds)")
    for label, r in rounds.items():
        cells = [f"{statistics.median(r[m]):.3f}; " + ", ".join(f"{x:.3f}" for x in r[m]) for m in metrics]
        print(f"{label} ({' '.join(configs[label])}) | " + " | ".join(cells))
    first = next(iter(rounds))
    for label in list(rounds)[1:]:
        ratios = [statistics.median(rounds[label][m]) / statistics.median(rounds[first][m]) for m in metrics]
        print(f"{label} / {first}: batch 1 ms/token {ratios[0]:.3f}x, batch 8 tokens/s {ratios[1]:.3f}x, "
              f"text TTFT {ratios[2]:.3f}x")
    out["configs"] = configs
    out["text_prompt_tokens"] = sorted(_PROMPT_TOKENS)
    print(f"text prompt tokens: {out['text_prompt_tokens']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
