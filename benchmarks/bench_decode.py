"""Decode speed in-process: ms per decode step at batch 1 and tokens/s at batch 8, with where the step's time goes.

Drives ``LLMEngine`` directly (no HTTP, no engine thread): each batch size runs requests of ~20 prompt tokens,
greedy, ``ignore_eos``, ``--max-tokens`` output tokens each, ``step_time_target="off"``, float32 (``--dtype``).
A step's time is split into the scheduler (``schedule`` + ``update``), the model's forward, the lm_head, the
sampler, the rest of the runner (inputs, metadata, bookkeeping) and the engine's own update (detokenizer, stop
checks, outputs) plus what is left (cost model, stats). Decode steps run on ``--num-threads`` too
(``decode_threads`` = it: the server's default of one fewer is for its own threads, absent here). The phases are
timed by wrapping the instance's methods here, in the benchmark only. Medians over the decode steps after the
first ``--warmup-steps``.

    PYTHONPATH=$PWD python benchmarks/bench_decode.py --num-threads 2
    # before/after side by side: rounds alternate between this checkout and another one's firsttoken package
    PYTHONPATH=$PWD python benchmarks/bench_decode.py --baseline /path/to/other/checkout --rounds 3
    # two configurations of this checkout: float32 weights vs --quantization fp16, rounds alternating
    PYTHONPATH=$PWD python benchmarks/bench_decode.py --baseline . --this-args "--quantization fp16" --rounds 3
    # decode after a ~3,900-token prompt (attention's share grows with the context)
    PYTHONPATH=$PWD python benchmarks/bench_decode.py --context-words 1300 --batch-sizes 1,4
    # MKL's products vs the few-rows kernels (firsttoken/kernels/cpu_linear.py) on one checkout
    PYTHONPATH=$PWD python benchmarks/bench_decode.py --baseline . --cpu-kernels off --this-args "--cpu-kernels auto"

The breakdown's wrappers cost about a microsecond each; ``--no-breakdown`` times whole steps only. On a machine
others load, ``--num-threads 1 --clock thread`` counts this thread's CPU time only (steadier, though a busy
neighbour still slows memory and caches), and ``--count-ops`` counts tensor ops per step, which load cannot move.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = "Tell me a long story about a lighthouse keeper and a storm at sea, please."  # 28 tokens (small's tokenizer)

PHASES = ("schedule", "forward", "logits", "sample", "runner_other", "sched_update", "engine_update", "other")


class PhaseTimer:
    """Accumulates seconds per phase for the current step; ``wrap`` times one bound method on its instance."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(obj, name)
        current, clock = self.current, self.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                current[phase] += clock() - t0

        setattr(obj, name, timed)


def build_engine(model_dir: str, num_threads: int, quantization: str = "none", cpu_kernels: str = "auto",
                 dtype: str = "float32"):
    from dataclasses import fields

    import torch
    from transformers import AutoTokenizer

    from firsttoken.config import (
        CacheConfig,
        EngineConfig,
        GenerationDefaults,
        SchedulerConfig,
    )
    from firsttoken.engine.engine import LLMEngine
    from firsttoken.inputs.processor import InputProcessor

    torch.set_num_threads(num_threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    extra = {"quantization": quantization} if quantization != "none" else {}
    names = {f.name for f in fields(EngineConfig)}
    if "decode_threads" in names:  # decode on --num-threads, as before it existed
        extra["decode_threads"] = num_threads
    if "cpu_kernels" in names:  # a checkout from before the few-rows kernels has no such field (and no kernels)
        extra["cpu_kernels"] = cpu_kernels
    cfg = EngineConfig(dtype=dtype, num_threads=num_threads, cache=CacheConfig(kv_cache_memory_bytes=256 * 2**20),
                       scheduler=SchedulerConfig(step_time_target="off"), **extra)
    engine = LLMEngine(model_dir, cfg, tok.backend_tokenizer)
    proc = InputProcessor(tok, engine.model_config, GenerationDefaults.from_pretrained(model_dir),
                          max_model_len=engine.max_model_len)
    return engine, proc


def context_text(words: int) -> str:
    """``words`` filler words (~3 tokens each with the small checkpoint's tokenizer) put before the prompt."""
    return " ".join(["lighthouse", "keeper", "storm", "sea"] * (words // 4)) + " " if words else ""


def run_batch(engine, proc, batch: int, max_tokens: int, tag: str, timer: PhaseTimer | None,
              clock: Callable[[], float] = time.perf_counter, context_words: int = 0) -> dict[str, Any]:
    """One batch of identical-length requests to completion; per decode step its wall time and phases."""
    from firsttoken.inputs.prompt import SamplingRequest, TextPrompt

    sampling = SamplingRequest(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    filler = context_text(context_words)
    reqs = [proc.process(TextPrompt(f"{i} {filler}{PROMPT}"), sampling, f"{tag}-{i}", time.monotonic())
            for i in range(batch)]
    for r in reqs:
        engine.add_request(r)
    steps: list[dict[str, float]] = []
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished():
        if timer is not None:
            timer.current.clear()
        t0 = clock()
        outs = engine.step()
        wall = clock() - t0
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
        n_out = sum(len(o.new_token_ids) for o in outs)
        # a decode step: every request past its prompt, one token each (prefill steps are left out)
        if all(len(t) > 1 for t in tokens.values()) and n_out == batch:
            row = {"wall": wall}
            if timer is not None:
                row.update(timer.current)
            steps.append(row)
    return {"steps": steps, "prompt_len": reqs[0].num_prompt_tokens, "tokens": tokens}


def summarize(steps: list[dict[str, float]], batch: int, breakdown: bool) -> dict[str, float]:
    med = {"ms_per_step": 1e3 * statistics.median(s["wall"] for s in steps)}
    med["tok_per_s"] = batch * 1e3 / med["ms_per_step"]
    if breakdown:
        rows = []
        for s in steps:
            r = {p: s.get(p, 0.0) for p in PHASES[:4] + ("sched_update", "engine_update")}
            r["runner_other"] = s.get("runner_total", 0.0) - r["forward"] - r["logits"] - r["sample"]
            r["other"] = s["wall"] - r["schedule"] - s.get("runner_total", 0.0) - r["sched_update"] - r["engine_update"]
            rows.append(r)
        for phase in PHASES:
            med[phase] = 1e3 * statistics.median(r[phase] for r in rows)
    return med


def time_prefill(engine, proc, num_words: int, repeats: int, clock: Callable[[], float]) -> dict[str, float]:
    """Milliseconds of the step that prefills one text prompt of ``num_words`` words (a check that decode work did
    not slow prefill); a different first word each time, so the prefix cache never hits."""
    from firsttoken.inputs.prompt import SamplingRequest, TextPrompt

    times = []
    for rep in range(repeats + 1):
        text = f"{rep} " + " ".join(["lighthouse", "keeper", "storm", "sea"] * (num_words // 4))
        req = proc.process(TextPrompt(text), SamplingRequest(max_tokens=1, temperature=0.0), f"pf{rep}",
                           time.monotonic())
        engine.add_request(req)
        t0 = clock()
        engine.step()
        times.append(clock() - t0)
        while engine.has_unfinished():
            engine.step()
    return {"prompt_len": req.num_prompt_tokens, "ms": 1e3 * statistics.median(times[1:])}


def count_ops(engine, proc, batch: int, num_steps: int = 10) -> float:
    """Tensor ops (aten calls, nested ones included) per decode step, by torch's profiler: a count that does not
    depend on how loaded the machine is."""
    from torch.profiler import ProfilerActivity, profile

    from firsttoken.inputs.prompt import SamplingRequest, TextPrompt

    sampling = SamplingRequest(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(proc.process(TextPrompt(f"{i} {PROMPT}"), sampling, f"ops{batch}-{i}", time.monotonic()))
    for _ in range(4):  # prefill and the first decodes
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / num_steps


def instrument(engine, timer: PhaseTimer) -> None:
    runner = engine.executor.runner
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "update", "sched_update")
    if hasattr(engine.scheduler, "learn_step"):  # the cost model's lesson, once part of update
        timer.wrap(engine.scheduler, "learn_step", "sched_update")
    if hasattr(engine, "outputs"):  # the output processor (a checkout from before it: the engine's _update)
        timer.wrap(engine.outputs, "step", "engine_update")
    else:
        timer.wrap(engine, "_update", "engine_update")
    # forward_step: the runner's entry (its decode method may compute the logits inside, then "logits" reads 0)
    timer.wrap(runner.model, "forward_step" if hasattr(runner.model, "forward_step") else "forward", "forward")
    timer.wrap(runner.model, "compute_logits", "logits")
    timer.wrap(runner.sampler, "sample", "sample")
    timer.wrap(engine.executor, "execute", "runner_total")


def compare(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this script ``--rounds`` times against each checkout, alternating, and print both medians and the ratio."""
    import os
    import subprocess
    import tempfile

    own = _without(argv, ("--baseline", "--rounds", "--json", "--this-args"))
    here = str(Path(__file__).resolve().parent.parent)
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for side, root in (("baseline", args.baseline), ("this", here)):
                out = Path(tmp) / f"{side}-{rnd}.json"
                env = {**os.environ, "PYTHONPATH": root}
                extra = args.this_args.split() if side == "this" and args.this_args else []
                subprocess.run([sys.executable, __file__, *own, *extra, "--json", str(out)], env=env, check=True)
                runs[side].append(json.loads(out.read_text()))
    summary: dict[str, Any] = {}
    for key in [k for k in runs["this"][0] if k.startswith("batch")] + ["prefill"] * ("prefill" in runs["this"][0]):
        metric = "ms" if key == "prefill" else "ms_per_step"
        base = statistics.median(r[key][metric] for r in runs["baseline"])
        this = statistics.median(r[key][metric] for r in runs["this"])
        summary[key] = {"baseline_ms": base, "this_ms": this, "ratio": this / base}
        extra = "" if key == "prefill" else (
            f"  ({int(key[5:]) * 1e3 / base:.1f} -> {int(key[5:]) * 1e3 / this:.1f} tok/s)")
        print(f"{key}: baseline {base:.2f} ms, this {this:.2f} ms, this/baseline {this / base:.3f}{extra}"
              f"  [medians of {args.rounds} rounds each, alternating]")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": runs, "summary": summary}, indent=1))
    return 0


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv minus each of ``flags`` and its value (``--flag value`` or ``--flag=value``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the `small` one, built once)")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="runs per batch size; medians over all their steps")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: the engine thread's CPU time (time.thread_time), steady on a loaded machine; "
                         "meaningful with --num-threads 1 only (other torch threads' work is not counted)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--count-ops", action="store_true", help="also count tensor ops per decode step")
    ap.add_argument("--baseline", default=None, help="a checkout root to compare with, rounds alternating")
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline: runs of each side")
    ap.add_argument("--this-args", default=None,
                    help="with --baseline: flags only this side gets, e.g. \"--quantization fp16\" with --baseline . "
                         "to compare two configurations of one checkout")
    ap.add_argument("--quantization", default="none", help="serve --quantization (none, fp16)")
    ap.add_argument("--cpu-kernels", default="auto", help="serve --cpu-kernels (auto, off)")
    ap.add_argument("--dtype", default="float32", help="serve --dtype (float32, bfloat16, auto)")
    ap.add_argument("--context-words", type=int, default=0,
                    help="decode after a prompt this many words longer (~3 tokens each): decode attention's cost "
                         "grows with the context")
    ap.add_argument("--prefill-words", type=int, default=0,
                    help="also time the prefill step of a text prompt of this many words (0: no; the small "
                         "checkpoint's tokenizer makes ~3 tokens of each)")
    args = ap.parse_args(argv)
    if args.baseline:
        return compare(args, sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import small_model

    import firsttoken

    engine, proc = build_engine(small_model(args.model), args.num_threads, args.quantization, args.cpu_kernels,
                                dtype=args.dtype)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    timer = None if args.no_breakdown else PhaseTimer(clock)
    if timer is not None:
        instrument(engine, timer)
    run_batch(engine, proc, 1, 16, "warm", timer, clock)  # first-call costs (allocator, kernels) out of the way
    results: dict[str, Any] = {"firsttoken": str(Path(firsttoken.__file__).parent), "num_threads": args.num_threads,
                               "clock": args.clock}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        steps: list[dict[str, float]] = []
        for rep in range(args.repeats):
            out = run_batch(engine, proc, batch, args.max_tokens, f"b{batch}r{rep}", timer, clock,
                            args.context_words)
            steps.extend(out["steps"][args.warmup_steps:])
        med = summarize(steps, batch, timer is not None)
        if args.count_ops:
            med["ops_per_step"] = count_ops(engine, proc, batch)
        results[f"batch{batch}"] = med | {"prompt_len": out["prompt_len"], "num_steps": len(steps)}
        print(f"batch {batch} (prompt {out['prompt_len']} tokens, {len(steps)} decode steps): "
              f"{med['ms_per_step']:.2f} ms/step, {med['tok_per_s']:.1f} tok/s"
              + (f", {med['ops_per_step']:.0f} tensor ops/step" if args.count_ops else ""))
        if timer is not None:
            print("   " + "  ".join(f"{p} {med[p]:.2f}" for p in PHASES) + "  (ms, medians)")
    if args.prefill_words:
        results["prefill"] = time_prefill(engine, proc, args.prefill_words, 3, clock)
        print(f"prefill of {results['prefill']['prompt_len']} tokens: {results['prefill']['ms']:.1f} ms (median of 3)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
