"""What output grammars cost a decode step: decode steps of the `small` checkpoint at batch 1 and 16 (``--batch-sizes``)
with 0, 1 and all rows constrained (a regex that cannot end within the answer, so every row decodes all its tokens), rounds alternating
between the three in one process, so load from elsewhere falls on all alike. Each constrained row's next mask is
filled on the grammar threads from the moment its token is sampled (structured/masks.py); what is left on the step
is collecting the masks (waiting only where one is not done) and applying them.

    PYTHONPATH=$PWD python benchmarks/bench_structured_step.py [--model DIR] [--rounds 5] [--batch-sizes 1,16]
        [--parts steps,ttft,beside] [--json OUT]

Prints ms per decode step (median over a round's steps, then the median of rounds) and each against 0 constrained;
then the TTFT of one ~800-token chat prompt alone without a schema, with a schema never seen (its compile on the
path) and with the same schema again (a cache hit), rounds alternating; then the seconds a 30-token unconstrained
answer takes alone and beside two requests under an ambiguous grammar (``AMBIGUOUS``, whose work per token grows
until its masks come later than every step), rounds alternating, with the steps it took and how many of them
waited for a mask. The script drives the engine through its public calls only, so the same script measures another
checkout's package (``PYTHONPATH=<checkout>``) side by side.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import small_model  # noqa: E402
from machine import machine_info  # noqa: E402

REGEX = "[a-z ]{400}"  # longer than any answer here: a constrained row never ends early
AMBIGUOUS = 'start: x\nx: "a" | x x | x x x'  # every string of a's, in exponentially many parses


def build(model: str, threads: int):
    from transformers import AutoTokenizer

    from firsttoken.config import EngineConfig, GenerationDefaults, SchedulerConfig
    from firsttoken.engine.engine import LLMEngine
    from firsttoken.inputs.processor import InputProcessor

    from firsttoken.runner.executor import InProcessExecutor

    class Recording(InProcessExecutor):
        """Keeps the runner's output of the last step (what it waited for, which rows were pending)."""

        last = None

        def execute(self, batch):
            self.last = super().execute(batch)
            return self.last

    tok = AutoTokenizer.from_pretrained(model)
    engine = LLMEngine(model, EngineConfig(dtype="float32", num_threads=threads,
                                           scheduler=SchedulerConfig(step_time_target="off")), tok.backend_tokenizer,
                       executor_factory=Recording)
    proc = InputProcessor(tok, engine.model_config, GenerationDefaults.from_pretrained(model),
                          max_model_len=engine.max_model_len)
    proc.warm_grammars()
    return engine, proc


def round_ms(engine, proc, batch: int, num_constrained: int, max_tokens: int, tag: str) -> float:
    from firsttoken.api.protocol import CompletionRequest

    for i in range(batch):
        body = {"model": "m", "prompt": f"Story {tag} {i}: once upon a time", "max_tokens": max_tokens,
                "temperature": 1.0, "seed": i, "ignore_eos": True}
        if i < num_constrained:
            body["structured_outputs"] = {"regex": REGEX}
        req = CompletionRequest.model_validate(body)
        engine.add_request(proc.process(req.prompts()[0], req.to_sampling(), f"{tag}-{i}", time.monotonic()))
    steps = []
    while engine.has_unfinished():
        decoding = engine.stats().num_running == batch and engine.stats().num_waiting == 0
        start = time.perf_counter()
        engine.step()
        if decoding:
            steps.append((time.perf_counter() - start) * 1e3)
    return statistics.median(steps[4:])  # past the prefill and the first decodes


def ttft_ms(engine, proc, schema: dict | None, tag: str) -> tuple[float, float]:
    """(ms from the request reaching the processor to its first token, of which compiling its grammar), alone."""
    from firsttoken.api.protocol import ChatCompletionRequest

    body = {"model": "m", "max_tokens": 4, "temperature": 0.0,
            "messages": [{"role": "user", "content": f"{tag}: " + "Read this receipt for me please. " * 100}]}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    req = ChatCompletionRequest.model_validate(body)
    start = time.perf_counter()
    er = proc.process(req.to_prompt(), req.to_sampling(), tag, time.monotonic())
    engine.add_request(er)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.new_token_ids:
                first = time.perf_counter()
    return (first - start) * 1e3, er.grammar_compile_s * 1e3


def beside_ambiguous(engine, proc, ambiguous: bool, tag: str, max_tokens: int = 30) -> dict:
    """A ``max_tokens`` unconstrained completion from its arrival to its last token, alone or beside two requests
    whose grammar is ``AMBIGUOUS`` (EOS biased away, so they write a's until aborted or refused), added once their
    answers are long enough for a mask to be late (the first step with a pending row): seconds, steps, the steps in
    which a constrained row was pending (its mask late), and those whose runner output says they waited for a mask
    with the seconds they waited (None where the runner does not report it)."""
    from dataclasses import replace

    from firsttoken.api.protocol import CompletionRequest

    def request(body: dict, rid: str):
        req = CompletionRequest.model_validate({"model": "m", "temperature": 1.0, **body})
        return proc.process(req.prompts()[0], req.to_sampling(), rid, time.monotonic())

    slow = []
    if ambiguous:
        for i in range(2):
            er = request({"prompt": f"Write a's {tag} {i}", "max_tokens": 2000, "seed": i,
                          "structured_outputs": {"grammar": AMBIGUOUS}}, f"{tag}-a{i}")
            bias = tuple((t, -100.0) for t in er.sampling.eos_token_ids)
            slow.append(replace(er, sampling=replace(er.sampling, logit_bias=bias)))
        for er in slow:
            engine.add_request(er)
        for _ in range(2000):  # until their answers are long enough that a mask comes later than a step
            engine.step()
            if engine.executor.last is not None and engine.executor.last.mask_pending_request_ids:
                break
    free = request({"prompt": f"Story {tag}: once upon a time", "max_tokens": max_tokens, "seed": 7,
                    "ignore_eos": True}, f"{tag}-free")
    start = time.perf_counter()
    engine.add_request(free)
    steps = pending = waited = 0
    waited_s = 0.0
    reports_wait = True
    done = False
    while not done:
        outputs = engine.step()
        out = engine.executor.last
        steps += 1
        pending += bool(out.mask_pending_request_ids)
        wait_s = getattr(out, "mask_wait_s", None)
        reports_wait = reports_wait and wait_s is not None
        waited += bool(wait_s)
        waited_s += wait_s or 0.0
        done = any(o.request_id == free.request_id and o.finished for o in outputs)
    seconds = time.perf_counter() - start
    for er in slow:
        engine.abort(er.request_id)
    while engine.has_unfinished():
        engine.step()
    return {"s": seconds, "steps": steps, "steps_pending": pending, "steps_waited": waited if reports_wait else None,
            "waited_s": waited_s if reports_wait else None}


def receipt(variant: int) -> dict:
    """A receipt schema; each variant a distinct spec (a new compile), the same variant a cache hit."""
    return {"type": "object", "properties": {
        f"total_{variant}": {"type": "number"}, "currency": {"type": "string", "enum": ["EUR", "USD"]},
        "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}}, "required": ["name"]}}},
        "required": [f"total_{variant}", "currency"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--parts", default="steps,ttft,beside", help="what to measure: decode steps with 0, 1 and all rows "
                    "constrained; TTFT with a new and a cached schema; a free answer beside an ambiguous grammar")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    engine, proc = build(small_model(args.model), args.num_threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    round_ms(engine, proc, max(batches), max(batches), 8, "warmup")
    import firsttoken

    out = {"machine": machine_info(), "package": str(Path(firsttoken.__file__).parent), "parts": args.parts, "rounds": args.rounds, "max_tokens": args.max_tokens, "regex": REGEX,
           "ms_per_step": {}, "summary": {}}
    print(f"machine: {out['machine']}")
    parts = set(args.parts.split(","))
    for batch in batches if "steps" in parts else ():
        configs = {"0 constrained": 0, **({"1 constrained": 1} if batch > 1 else {}), f"{batch} constrained": batch}
        runs: dict[str, list[float]] = {name: [] for name in configs}
        for r in range(args.rounds):
            for name, n in configs.items():
                runs[name].append(round_ms(engine, proc, batch, n, args.max_tokens, f"{batch}-{r}-{n}"))
        base = statistics.median(runs["0 constrained"])
        out["ms_per_step"][f"batch{batch}"] = runs
        for name, values in runs.items():
            median = statistics.median(values)
            out["summary"][f"batch{batch} {name}"] = {"ms": median, "vs_unconstrained": median / base}
            print(f"batch {batch:2d} {name:15s} {median:7.2f} ms/step  {median / base:5.3f}x  (rounds: "
                  f"{', '.join(f'{v:.2f}' for v in values)})")
    ttft: dict[str, list[list[float]]] = {"no schema": [], "new schema": [], "cached schema": []}
    for r in range(args.rounds if "ttft" in parts else 0):
        ttft["no schema"].append(list(ttft_ms(engine, proc, None, f"t{r}a")))
        ttft["new schema"].append(list(ttft_ms(engine, proc, receipt(r), f"t{r}b")))
        ttft["cached schema"].append(list(ttft_ms(engine, proc, receipt(r), f"t{r}c")))
    out["ttft_ms"] = ttft
    for name, values in ttft.items() if "ttft" in parts else ():
        base = statistics.median(v[0] for v in ttft["no schema"])
        median = statistics.median(v[0] for v in values)
        compile_ms = statistics.median(v[1] for v in values)
        out["summary"][f"ttft {name}"] = {"ms": median, "vs_no_schema": median / base, "compile_ms": compile_ms}
        print(f"TTFT {name:14s} {median:8.1f} ms  {median / base:5.3f}x  (of which compiling {compile_ms:.2f} ms; "
              f"rounds: {', '.join(f'{v[0]:.0f}' for v in values)})")
    beside: dict[str, list[dict]] = {"alone": [], "beside ambiguous": []}
    for r in range(args.rounds if "beside" in parts else 0):
        beside["alone"].append(beside_ambiguous(engine, proc, False, f"b{r}a"))
        beside["beside ambiguous"].append(beside_ambiguous(engine, proc, True, f"b{r}b"))
    out["beside_ambiguous"] = beside
    for name, values in beside.items() if "beside" in parts else ():
        base = statistics.median(v["s"] for v in beside["alone"])
        median = statistics.median(v["s"] for v in values)
        out["summary"][f"30 tokens {name}"] = {"s": median, "vs_alone": median / base}
        rounds = ", ".join(f"{v['s']:.3f}" for v in values)
        print(f"30 tokens {name:16s} {median:6.3f} s  {median / base:5.2f}x  (rounds: {rounds}; steps "
              f"{[v['steps'] for v in values]}, of which a mask pending {[v['steps_pending'] for v in values]}, "
              f"waited {[v['steps_waited'] for v in values]}, for "
              f"{[None if v['waited_s'] is None else round(v['waited_s'], 3) for v in values]} s)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
