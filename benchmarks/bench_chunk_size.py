"""Prefill throughput by chunk size: one long prompt prefilled alone in chunks of S tokens, through the engine (its
steps, scheduler and runner), for several S side by side, alternating in every round. Prints seconds and tokens/s
per size, the ratio to the fastest, and what the step-cost model predicts for the same chunking; writes JSON.
A benchmark, not a test.

    python benchmarks/bench_chunk_size.py [--model DIR] [--tokens 4921] [--sizes 256,512,1024,2048,4096,whole]
                                          [--rounds 5] [--threads 2] [--json OUT]

Each size is its own engine (fp32, caches off, --step-time-target off so the long lane's token budget,
--long-step-tokens, is exactly S; "whole": --scheduling fcfs, the prompt in one step). The engines are built
first and calibrated once (the cost model's prediction column); a round prefills a fresh random-token prompt
(no cache can hit) on each engine in turn, the order rotating. Seconds: first step scheduled -> first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import small_model  # noqa: E402
from machine import machine_info  # noqa: E402

from firsttoken.config import CacheConfig, EngineConfig, SchedulerConfig
from firsttoken.engine.engine import LLMEngine
from firsttoken.inputs.processor import load_tokenizer
from firsttoken.models.registry import family_named
from firsttoken.scheduler.cost_model import prefill_chunk
from firsttoken.types import EngineRequest, SamplingParams


def engine_for(model: str, size: str, tokens: int, threads: int) -> LLMEngine:
    if size == "whole":
        sched = SchedulerConfig(scheduling="fcfs", max_batched_tokens=tokens + 64, step_time_target="off")
    else:
        s = int(size)
        sched = SchedulerConfig(max_batched_tokens=max(s, 64), long_step_tokens=s, step_time_target="off",
                                long_prompt_threshold=min(1024, tokens))
    cache = CacheConfig(kv_cache_memory_bytes=512 * 2**20, enable_prefix_caching=False, enable_encoder_cache=False)
    config = EngineConfig(dtype="float32", num_threads=threads, decode_threads=threads, cache=cache, scheduler=sched)
    return LLMEngine(model, config, load_tokenizer(model).backend_tokenizer)


def prompt(engine: LLMEngine, tokens: int, seed: int, rid: str) -> EngineRequest:
    cfg = engine.model_config
    gen = torch.Generator().manual_seed(seed)
    ids = [t if t < cfg.image_token_id - 100 else 7 for t in torch.randint(0, 15000, (tokens,), generator=gen).tolist()]
    positions = family_named(cfg.family).positions(ids, [], cfg)
    now = time.monotonic()
    return EngineRequest(rid, tuple(ids), (), positions.positions, positions.delta,
                         SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), now, now)


def prefill_s(engine: LLMEngine, request: EngineRequest) -> tuple[float, int]:
    engine.add_request(request)
    stats = None
    steps_before = engine.scheduler.num_steps
    while engine.has_unfinished():
        for out in engine.step():
            stats = out.stats
    return stats.first_token_s - stats.first_scheduled_s, engine.scheduler.num_steps - steps_before


def predicted_s(engine: LLMEngine, tokens: int, size: str) -> float:
    """The calibrated cost model's seconds for this chunking (per-step constant included)."""
    s = tokens if size == "whole" else int(size)
    cost, total, done = engine.scheduler.cost_model, 0.0, 0
    while done < tokens:
        n = min(s, tokens - done)
        total += cost.predict(prefill_chunk(n, done, done + n == tokens))
        done += n
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--tokens", type=int, default=4921)
    p.add_argument("--sizes", default="256,512,1024,2048,4096,whole")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = small_model(args.model)
    sizes = args.sizes.split(",")
    engines = {s: engine_for(model, s, args.tokens, args.threads) for s in sizes}
    reference = engines[sizes[0]]
    reference.calibrate()
    before = machine_info()
    times: dict[str, list[float]] = {s: [] for s in sizes}
    steps: dict[str, int] = {}
    for s in sizes:  # warm-up
        prefill_s(engines[s], prompt(engines[s], args.tokens, 999, f"warm-{s}"))
    for r in range(args.rounds):
        order = sizes[r % len(sizes):] + sizes[: r % len(sizes)]
        for s in order:
            t, n = prefill_s(engines[s], prompt(engines[s], args.tokens, r, f"r{r}-{s}"))
            times[s].append(t)
            steps[s] = n
    after = machine_info()
    medians = {s: statistics.median(v) for s, v in times.items()}
    best = min(medians.values())
    rows = []
    print(f"{before['cpu']} {before['cpu_flags']} threads {args.threads}; {args.tokens}-token prompt, "
          f"{args.rounds} rounds alternating; load {before['loadavg']} -> {after['loadavg']}")
    print(f"{'chunk':>6} {'steps':>5} {'median s':>9} {'tok/s':>7} {'vs best':>7} {'predicted s':>11}")
    for s in sizes:
        pred = predicted_s(reference, args.tokens, s)
        rows.append({"chunk": s, "steps": steps[s], "seconds": times[s], "median_s": medians[s],
                     "tokens_per_s": args.tokens / medians[s], "vs_best": medians[s] / best, "predicted_s": pred})
        print(f"{s:>6} {steps[s]:>5} {medians[s]:>9.3f} {args.tokens / medians[s]:>7.0f} {medians[s] / best:>7.2f} "
              f"{pred:>11.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine_before": before, "machine_after": after, "tokens": args.tokens,
                                               "rounds": args.rounds, "threads": args.threads, "rows": rows,
                                               "cost_model": reference.scheduler.cost_model.fit().as_dict()},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
