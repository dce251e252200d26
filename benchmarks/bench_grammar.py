"""Grammar libraries for constrained decoding, llguidance vs xgrammar, measured on this machine with a Qwen tokenizer:
the one-off tokenizer-info build, grammar compile time for the specs clients send (a receipt-extraction JSON schema
with nested objects, arrays and enums; a tool call {name, arguments}; json_object = any JSON object; a regex; a
choice list), a new matcher from a compiled grammar (a cache hit's cost), the first mask after compiling, and the
mask fill time per generated token at batch 1 and 16 while a matcher is driven through a valid output (fill the
row's bitmask, then consume the output's next token; only the fill is timed). Batch 16 is timed both as a loop over rows and through the library's parallel batch fill. At each
batch-16 step the filled [16, vocab] bitmask is also applied to float32 logits, by the library's torch function and
by firsttoken's ``apply_bitmask`` (firsttoken/structured/bitmask.py).

Each library runs in its own process, one after the other. Medians with n beside them; raw JSON to --json.

    python benchmarks/bench_grammar.py --tokenizer /work/ckpt/small --json docs/runs/grammar-libraries-small.json
    # Qwen2's full 151,643-token vocabulary (the demo checkpoint's tokenizer has 16,000 tokens):
    python benchmarks/qwen_vocab.py --tiktoken .../qwen.tiktoken --template /work/ckpt/small --out /tmp/qwen-vocab
    python benchmarks/bench_grammar.py --tokenizer /work/ckpt/small --tokenizer /tmp/qwen-vocab --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import machine_info  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

RECEIPT_SCHEMA = {
    "type": "object",
    "properties": {
        "merchant": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "address": {"type": "string"},
                           "phone": {"type": "string", "pattern": "^\\+?[0-9 ()-]{6,20}$"}},
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CNY"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number"},
                    "category": {"type": "string", "enum": ["food", "drink", "household", "other"]},
                },
                "required": ["description", "quantity", "unit_price", "category"],
                "additionalProperties": False,
            },
        },
        "subtotal": {"type": "number"},
        "tax": {"type": "number"},
        "total": {"type": "number"},
        "payment": {"type": "string", "enum": ["cash", "card", "other"]},
    },
    "required": ["merchant", "date", "currency", "items", "total", "payment"],
    "additionalProperties": False,
}
RECEIPT_OUTPUT = {
    "merchant": {"name": "Corner Bakery & Café", "address": "12 Market Street, Springfield", "phone": "+1 555-0100"},
    "date": "2026-11-28",
    "currency": "USD",
    "items": [
        {"description": "Sourdough loaf", "quantity": 1, "unit_price": 6.5, "category": "food"},
        {"description": "Flat white", "quantity": 2, "unit_price": 4.25, "category": "drink"},
        {"description": "Almond croissant", "quantity": 3, "unit_price": 3.75, "category": "food"},
        {"description": "Paper bags (pack of 10)", "quantity": 1, "unit_price": 1.2, "category": "household"},
    ],
    "subtotal": 27.45, "tax": 2.2, "total": 29.65, "payment": "card",
}
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search_web"]},
        "arguments": {
            "type": "object",
            "properties": {"location": {"type": "string"},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["location"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_OUTPUT = {"name": "get_weather", "arguments": {"location": "Zürich, Switzerland", "unit": "celsius", "days": 3}}
REGEX = r"[A-Z]{2}-[0-9]{4}-[0-9]{6}( \((priority|standard)\))?"
REGEX_OUTPUT = "KX-2026-004211 (priority)"
CHOICES = ["positive", "negative", "neutral", "mixed"]

# (spec kind, the spec, a valid output's text)
CASES = {
    "receipt json_schema": ("json_schema", RECEIPT_SCHEMA, json.dumps(RECEIPT_OUTPUT, ensure_ascii=False)),
    "tool call json_schema": ("json_schema", TOOL_SCHEMA, json.dumps(TOOL_OUTPUT, ensure_ascii=False)),
    "json_object": ("json_object", None, json.dumps(RECEIPT_OUTPUT, ensure_ascii=False)),
    "regex": ("regex", REGEX, REGEX_OUTPUT),
    "choice": ("choice", CHOICES, "neutral"),
}

ONE_RUN = r"""
import json, statistics, sys, time
import numpy as np, torch
from transformers import AutoTokenizer
library, tokenizer_dir, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
compile_n, passes, threads = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
sys.path.insert(0, sys.argv[7])
from firsttoken.structured.bitmask import apply_bitmask
torch.set_num_threads(1)
hf = AutoTokenizer.from_pretrained(tokenizer_dir)
vocab = len(hf)
eos = hf.convert_tokens_to_ids("<|im_end|>")
BATCH = 16

def timed(fn):
    start = time.perf_counter(); value = fn(); return time.perf_counter() - start, value

if library == "llguidance":
    import llguidance, llguidance.hf, llguidance.numpy as lnp, llguidance.torch as ltorch
    info_s, tok = timed(lambda: llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos))
    executor = llguidance.LLExecutor(num_threads=threads)
    def grammar(kind, spec):
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec))
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    def compile(kind, spec):
        m = llguidance.LLMatcher(tok, grammar(kind, spec), log_level=0)
        assert not m.is_error(), m.get_error()
        return m
    new_matcher = lambda compiled: compiled.deep_copy()
    allocate = lambda rows: lnp.allocate_token_bitmask(rows, vocab)
    fill = lambda m, bitmask, row: lnp.fill_next_token_bitmask(m, bitmask, row)
    fill_par = lambda ms, bitmask: lnp.fill_next_token_bitmask_par(executor, list(zip(ms, range(len(ms)))), bitmask)
    accept = lambda m, t: m.consume_token(t)
    done = lambda m: m.is_stopped() or m.is_accepting()
    apply = lambda logits, bitmask: ltorch.apply_token_bitmask_inplace(logits, torch.from_numpy(bitmask))
    version = llguidance.__version__
else:
    import importlib.metadata, xgrammar as xgr
    info_s, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos]))
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    batch_matcher = xgr.BatchGrammarMatcher(max_threads=threads)
    def compile(kind, spec):
        if kind == "json_schema":
            return compiler.compile_json_schema(json.dumps(spec), strict_mode=True)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(spec)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
    new_matcher = lambda compiled: xgr.GrammarMatcher(compiled)
    allocate = lambda rows: xgr.allocate_token_bitmask(rows, vocab)
    fill = lambda m, bitmask, row: m.fill_next_token_bitmask(bitmask, row)
    fill_par = lambda ms, bitmask: batch_matcher.batch_fill_next_token_bitmask(ms, bitmask)
    accept = lambda m, t: m.accept_token(t)
    done = lambda m: m.is_terminated()
    apply = lambda logits, bitmask: xgr.apply_token_bitmask_inplace(logits, bitmask)
    version = importlib.metadata.version("xgrammar")

out = {"library": library, "version": version, "vocab": vocab, "tokenizer_info_s": info_s, "threads": threads,
       "cases": {}}
for label, (kind, spec, text) in cases.items():
    tokens = hf.encode(text, add_special_tokens=False) + [eos]
    compile_s = []
    for _ in range(compile_n):
        seconds, compiled = timed(lambda: compile(kind, spec))
        compile_s.append(seconds)
    new_matcher_s = [timed(lambda: new_matcher(compiled))[0] for _ in range(20)]  # what a cached grammar costs
    first_mask_s = []
    for _ in range(compile_n):
        bitmask = allocate(1)
        m = new_matcher(compile(kind, spec))
        seconds, _ = timed(lambda: fill(m, bitmask, 0))
        first_mask_s.append(seconds)
    one, loop16, par16, rejected = [], [], [], None
    apply_library, apply_ours, logits = [], [], torch.randn(BATCH, vocab)
    for _ in range(passes):
        m, bitmask = new_matcher(compiled), allocate(1)
        for i, t in enumerate(tokens):
            seconds, _ = timed(lambda: fill(m, bitmask, 0))
            one.append(seconds)
            allowed = (int(bitmask[0, t // 32]) >> (t % 32)) & 1
            if not allowed or not accept(m, t):
                rejected = f"token {i} ({hf.decode([t])!r}) not allowed"
                break
        ms, bitmask = [new_matcher(compiled) for _ in range(BATCH)], allocate(BATCH)
        for t in tokens:
            seconds, _ = timed(lambda: [fill(m, bitmask, row) for row, m in enumerate(ms)])
            loop16.append(seconds)
            mask = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else bitmask
            apply_library.append(timed(lambda: apply(logits, bitmask))[0])
            apply_ours.append(timed(lambda: apply_bitmask(logits, mask, range(BATCH)))[0])
            for m in ms:
                accept(m, t)
        ms, bitmask = [new_matcher(compiled) for _ in range(BATCH)], allocate(BATCH)
        for t in tokens:
            seconds, _ = timed(lambda: fill_par(ms, bitmask))
            par16.append(seconds)
            for m in ms:
                accept(m, t)
    out["cases"][label] = {"output_tokens": len(tokens), "rejected": rejected, "finished": done(m),
                           "compile_s": compile_s, "new_matcher_s": new_matcher_s, "first_mask_s": first_mask_s,
                           "fill_batch1_s": one,
                           "fill_batch16_loop_s": loop16, "fill_batch16_parallel_s": par16,
                           "apply_batch16_library_s": apply_library, "apply_batch16_firsttoken_s": apply_ours}
print(json.dumps(out))
"""


def run_library(python: str, library: str, tokenizer: Path, compile_n: int, passes: int, threads: int) -> dict:
    cases = {label: list(case) for label, case in CASES.items()}
    done = subprocess.run([python, "-c", ONE_RUN, library, str(tokenizer), json.dumps(cases), str(compile_n),
                           str(passes), str(threads), str(REPO)], capture_output=True, text=True)
    if done.returncode != 0:
        return {"library": library, "error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def lscpu_flags() -> list[str]:
    """Every CPU flag lscpu lists (its "Flags:" line), for results read on another machine."""
    done = subprocess.run(["lscpu"], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("Flags:"):
            return line.split(":", 1)[1].split()
    return []


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:9.3f}" if values else "        -"


def print_table(result: dict) -> None:
    if "error" in result:
        print(f"{result['library']}: {result['error']}")
        return
    print(f"\n{result['library']} {result['version']}, vocab {result['vocab']:,}, tokenizer info "
          f"{result['tokenizer_info_s'] * 1e3:.0f} ms; medians in ms (fill and apply per generated token)")
    print(f"{'spec':24} {'tokens':>6} {'compile':>9} {'matcher':>9} {'1st mask':>9} {'b1 fill':>9} {'b16 loop':>9} "
          f"{'b16 par':>9} {'apply lib':>9} {'apply ft':>9}   n(compile, b1, b16)  valid")
    for label, case in result["cases"].items():
        valid = "yes" if case["rejected"] is None and case["finished"] else (case["rejected"] or "not finished")
        print(f"{label:24} {case['output_tokens']:6d} {median_ms(case['compile_s'])} "
              f"{median_ms(case['new_matcher_s'])} {median_ms(case['first_mask_s'])} "
              f"{median_ms(case['fill_batch1_s'])} {median_ms(case['fill_batch16_loop_s'])} "
              f"{median_ms(case['fill_batch16_parallel_s'])} {median_ms(case['apply_batch16_library_s'])} "
              f"{median_ms(case['apply_batch16_firsttoken_s'])}   ({len(case['compile_s'])}, "
              f"{len(case['fill_batch1_s'])}, {len(case['fill_batch16_loop_s'])})  {valid}")


def _summary(samples: list[float]) -> dict[str, object]:
    """Seconds: n, median, p10, p90, mean; the samples themselves where there are few (compiles)."""
    if not samples:
        return {"n": 0}
    ordered = sorted(samples)
    out: dict[str, object] = {"n": len(samples), "median": statistics.median(samples),
                              "p10": ordered[len(ordered) // 10], "p90": ordered[(len(ordered) * 9) // 10],
                              "mean": statistics.fmean(samples)}
    if len(samples) <= 20:
        out["samples"] = samples
    return out


def _for_json(result: dict) -> dict:
    """Each per-token series summarised (a run holds ~10,000 samples a library)."""
    if "cases" not in result:
        return result
    cases = {label: {k: _summary(v) if k.endswith("_s") else v for k, v in case.items()}
             for label, case in result["cases"].items()}
    return {**result, "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, action="append", required=True,
                        help="a directory with tokenizer.json (repeat for several vocabularies)")
    parser.add_argument("--library", action="append", choices=["llguidance", "xgrammar"])
    parser.add_argument("--python", default=sys.executable, help="the interpreter that has the libraries")
    parser.add_argument("--compile-repeats", type=int, default=5)
    parser.add_argument("--passes", type=int, default=3, help="passes over each valid output")
    parser.add_argument("--threads", type=int, default=2, help="the libraries' worker threads (compile, batch fill)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {"machine": {**machine_info(), "lscpu_flags": lscpu_flags()}, "command": " ".join(sys.argv),
               "runs": []}
    for tokenizer in args.tokenizer:
        for library in args.library or ["llguidance", "xgrammar"]:
            result = run_library(args.python, library, tokenizer, args.compile_repeats, args.passes, args.threads)
            result["tokenizer"] = str(tokenizer)
            results["runs"].append(result)
            print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        results["runs"] = [_for_json(r) for r in results["runs"]]
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
