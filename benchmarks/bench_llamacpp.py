"""firsttoken vs llama.cpp's llama-server on the same `small` checkpoint, same prompts, same machine: streaming
TTFT (text ~800 tokens, one 1024x1024 image, three), decode time per token at batch 1 and total tokens/s at
batch 8. Prints the ratios against issue 17's targets and the CPU flags; writes JSON. A benchmark, not a test.

    python benchmarks/bench_llamacpp.py --work-dir /work/peers/llamacpp --convert-venv /work/peers/convert-venv \
        [--build] [--quant q8_0|f16|bf16] [--ours-fp16] [--ours-int8] [--ours-bf16] [--ours-bf16-weights]
        [--json OUT]
    # reuse an existing build and GGUFs:
    python benchmarks/bench_llamacpp.py --llama-dir /work/peers/llamacpp \
        --gguf /work/peers/llamacpp/gguf/qwen2vl-small-orig-f32.gguf \
        --mmproj /work/peers/llamacpp/gguf/mmproj-small-orig-f32.gguf

The servers (all started first; an idle one costs no CPU):
- llama.cpp: llama-server -t 2 -tb 2, -np 1 for TTFT and batch-1 decode, -np 8 for batch 8; f32 GGUF (and, with
  --quant q8_0 or f16, a Q8_0 or F16 one with the same f32 vision projector); requests carry "cache_prompt": false.
- firsttoken: serve --dtype float32 --num-threads 2 --image-max-tokens 16384 (no budget: 1,369 visual tokens per
  1024x1024 image, as llama.cpp), caches off; and again with the default image budget for a separate TTFT column;
  with --ours-fp16, another with --quantization fp16 (float16 weights, FBGEMM) in every measurement; with
  --ours-int8, another with --quantization int8 (int8 weights in both towers, inputs quantized per row), set
  beside llama.cpp's Q8_0 when --quant q8_0 is given; with --ours-bf16, another with --dtype bfloat16 (both towers
  in bf16: --dtype auto's choice on a CPU with native bf16), set beside llama.cpp's BF16 language model (its vision
  projector stays f32) when --quant bf16 is given; with --ours-bf16-weights, another with --quantization bf16
  (the language model's linear weights bf16, activations float32: the weight bytes of llama.cpp's BF16 GGUF, set
  beside it when --quant bf16 is given).
Each measurement runs 1 warm-up + --repeats (3) rounds; a round sends the same prompt to every server in turn (the
order rotating), so load from other processes on a shared machine falls on all alike; medians are reported, and
the load average before and after. Prompts differ between rounds, so no cache can hit. One code path measures
every server: httpx streaming of /v1/chat/completions. TTFT = send -> first chunk carrying a token (content or
finish_reason), with max_tokens 1 so an invisible first token cannot delay it; decode = (end - first token) /
(n - 1) over 128 tokens with ignore_eos; batch 8 = 8 concurrent such requests, all output tokens / wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import checkout, start_server, stop_server  # noqa: E402
from llamacpp_peer import (  # noqa: E402
    GGUFPair,
    LlamaCppTree,
    build,
    convert,
    converter_python,
    small_checkpoint,
    start_llama_server,
)
from machine import machine_info  # noqa: E402

from firsttoken.tools.bench.images import encode_data_url, synth_image
from firsttoken.tools.bench.workload import words

THREADS = 2
TEXT_WORDS = 600  # ~810 prompt tokens with our tokenizer and chat template
IMAGE_SIDE = 1024
IMAGE_TEXT_WORDS = 16
PROMPTS = (("text", 0), ("1img", 1), ("3img", 3))  # class -> images per prompt
DECODE_TOKENS = 128
DECODE_PROMPT_WORDS = 24
BATCH = 8
LLAMA_CTX = 8192  # -np 1: a 3-image prompt (4,923 tokens) fits; -np 8: 1,024 per slot
NO_BUDGET_TOKENS = 16384
FIRSTTOKEN_FLAGS = ("--dtype", "float32", "--num-threads", str(THREADS), "--no-prefix-cache", "--no-encoder-cache")
TARGETS = {"text": 0.8, "1img": 0.6, "3img": 0.6, "decode_b1": 1.0, "decode_b8": 2.0}  # issues 17 and 42
# usage.firsttoken's parts kept per TTFT run: preprocessing, then where the time to the first token went
TIMING_PARTS = ("ttft_s", "preprocess_s", "handoff_s", "encoder_compute_s", "forward_s", "step_overhead_s",
                "other_steps_s", "engine_idle_s", "send_s", "steps_to_first_token")
SCHEDULES = {"fcfs": ("--scheduling", "fcfs"), "off": ("--step-time-target", "off")}  # beside the default


# ---- one request, timed from the client ---------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    ttft_s: float  # send -> first chunk carrying a token
    end_s: float  # send -> last chunk carrying a token
    prompt_tokens: int | None
    completion_tokens: int | None
    timings: dict[str, Any] | None = None  # firsttoken's usage.firsttoken (None from llama.cpp)

    @property
    def s_per_token(self) -> float | None:
        n = self.completion_tokens
        return (self.end_s - self.ttft_s) / (n - 1) if n and n > 1 else None


def _carries_token(chunk: dict[str, Any]) -> bool:
    return any((c.get("delta") or {}).get("content") or c.get("finish_reason") for c in chunk.get("choices") or [])


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> Timing:
    """POST a streaming chat completion; raises on an HTTP error, a missing token or an error event."""
    body = body | {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
                   "cache_prompt": False}  # fmt: skip
    start = time.perf_counter()
    first = last = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {str(chunk['error'])[:300]}")
            if _carries_token(chunk):
                last = time.perf_counter() - start
                first = last if first is None else first
            usage = chunk.get("usage") or usage
    if first is None or last is None:
        raise RuntimeError("the stream carried no token")
    return Timing(first, last, usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("firsttoken"))


# ---- prompts ----------------------------------------------------------------------------------------------
def prompt_body(num_images: int, key: str) -> dict[str, Any]:
    """A prompt with ``num_images`` images (text only when 0), seeded by ``key``: max_tokens 1, for TTFT."""
    if num_images == 0:
        content: Any = words(TEXT_WORDS, f"{key}:text")
    else:
        content = [{"type": "image_url",
                    "image_url": {"url": encode_data_url(synth_image(IMAGE_SIDE, IMAGE_SIDE, f"{key}:img{i}"))}}
                   for i in range(num_images)]  # fmt: skip
        content.append({"type": "text", "text": words(IMAGE_TEXT_WORDS, f"{key}:text")})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}


def decode_body(key: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": words(DECODE_PROMPT_WORDS, key)}], "max_tokens": DECODE_TOKENS,
            "ignore_eos": True}  # fmt: skip


# ---- measurements: every server in turn, per repeat ---------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    median: float
    runs: list[float]
    best: float  # the fastest run: min for seconds, max for tokens/s (other load only ever slows a run)
    prompt_tokens: int | None = None
    parts: dict[str, float] | None = None  # firsttoken: the median of each timing part of usage.firsttoken


def _interleaved(bases: dict[str, str], repeats: int, once: Callable[[str, int], Any]) -> dict[str, list[Any]]:
    """once(base, i) for every server per repeat i (0 = warm-up, dropped), the order rotating each repeat, so
    load from other processes on a shared machine falls on all servers alike."""
    names = list(bases)
    out: dict[str, list[Any]] = {name: [] for name in names}
    for i in range(repeats + 1):
        for name in names[i % len(names):] + names[: i % len(names)]:
            result = once(bases[name], i)
            if i:
                out[name].append(result)
    return out


def measure_ttft(bases: dict[str, str], repeats: int, timeout_s: float) -> dict[str, dict[str, Measured]]:
    """name -> class -> median TTFT; every server gets the same prompt at repeat i."""
    out: dict[str, dict[str, Measured]] = {name: {} for name in bases}
    for cls, num_images in PROMPTS:

        def once(base: str, i: int, cls: str = cls, num_images: int = num_images) -> Timing:
            return asyncio.run(_one(base, prompt_body(num_images, f"{cls}:{i}"), timeout_s))

        for name, runs in _interleaved(bases, repeats, once).items():
            ttft = [r.ttft_s for r in runs]
            parts = None
            if all(r.timings for r in runs):
                parts = {k: statistics.median(float(r.timings[k]) for r in runs) for k in TIMING_PARTS
                         if all(k in r.timings for r in runs)}  # an older checkout reports fewer
            out[name][cls] = Measured(statistics.median(ttft), ttft, min(ttft), runs[-1].prompt_tokens, parts)
            print(f"  {name} {cls}: TTFT {out[name][cls].median:.3f} s ({runs[-1].prompt_tokens} prompt tokens)",
                  flush=True)  # fmt: skip
    return out


def measure_decode_b1(bases: dict[str, str], repeats: int, timeout_s: float) -> dict[str, Measured]:
    def once(base: str, i: int) -> float:
        t = asyncio.run(_one(base, decode_body(f"b1:{i}"), timeout_s))
        if t.completion_tokens != DECODE_TOKENS or t.s_per_token is None:
            raise RuntimeError(f"{base}: {t.completion_tokens} tokens generated, wanted {DECODE_TOKENS}")
        return t.s_per_token

    by_name = _interleaved(bases, repeats, once)
    out = {name: Measured(statistics.median(runs), runs, min(runs)) for name, runs in by_name.items()}
    for name, m in out.items():
        print(f"  {name} decode batch 1: {m.median * 1000:.1f} ms/token", flush=True)
    return out


def measure_decode_batch(bases: dict[str, str], repeats: int, timeout_s: float) -> dict[str, Measured]:
    """Total output tokens/s of BATCH concurrent 128-token requests (wall time from first send to last token)."""

    async def round_(base: str, i: int) -> float:
        async with httpx.AsyncClient(base_url=base, timeout=timeout_s) as client:
            start = time.perf_counter()
            timings = await asyncio.gather(*(stream_chat(client, decode_body(f"b{BATCH}:{i}:{k}"))
                                             for k in range(BATCH)))  # fmt: skip
            wall = time.perf_counter() - start
        return sum(t.completion_tokens or 0 for t in timings) / wall

    runs_by = _interleaved(bases, repeats, lambda base, i: asyncio.run(round_(base, i)))
    out = {name: Measured(statistics.median(runs), runs, max(runs)) for name, runs in runs_by.items()}
    for name, m in out.items():
        print(f"  {name} decode batch {BATCH}: {m.median:.1f} tokens/s", flush=True)
    return out


async def _one(base: str, body: dict[str, Any], timeout_s: float) -> Timing:
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s) as client:
        return await stream_chat(client, body)


# ---- the servers ------------------------------------------------------------------------------------------------
def start_llama(stack: ExitStack, server: Path, gguf: GGUFPair, parallel: int, extra_args: tuple[str, ...]) -> str:
    proc, base = start_llama_server(server, gguf, threads=THREADS, parallel=parallel, ctx_len=LLAMA_CTX,
                                    extra_args=extra_args)
    stack.callback(stop_server, proc)
    return base


def start_firsttoken(stack: ExitStack, model: Path, flags: list[str]) -> str:
    proc, base = start_server(model, flags)
    stack.callback(stop_server, proc)
    return base


def run_all(tree: LlamaCppTree, model: Path, llama: dict[str, GGUFPair], args: argparse.Namespace) -> dict[str, Any]:
    """Start every server (idle ones cost no CPU), then measure them in turn. llama: result key -> GGUFs."""
    results: dict[str, Any] = {}
    no_budget = [*FIRSTTOKEN_FLAGS, "--image-max-tokens", str(NO_BUDGET_TOKENS)]
    with ExitStack() as stack:
        extra = tuple(args.llama_args.split())
        single = {name: start_llama(stack, tree.server, gguf, 1, extra) for name, gguf in llama.items()}
        batched = {name: start_llama(stack, tree.server, gguf, BATCH, extra) for name, gguf in llama.items()}
        ours = {"firsttoken_fp32": start_firsttoken(stack, model, no_budget)}
        for quant in _ours_variants(args):
            ours[f"firsttoken_{quant}"] = start_firsttoken(stack, model, _variant_flags(no_budget, quant))
        ttft_bases = {**single, **ours}
        if not args.no_budget_column:
            ttft_bases["firsttoken_budget"] = start_firsttoken(stack, model, list(FIRSTTOKEN_FLAGS))
        for schedule in _schedules(args):
            ttft_bases[f"firsttoken_{schedule}"] = start_firsttoken(stack, model, [*no_budget, *SCHEDULES[schedule]])
        if args.before is not None:  # the default schedule as another checkout has it (before/after in one run)
            with checkout(args.before):
                ttft_bases["firsttoken_before"] = start_firsttoken(stack, model.resolve(), no_budget)
        results["machine_before"] = machine_info()
        ttft = measure_ttft(ttft_bases, args.repeats, args.timeout)
        b1 = {} if args.ttft_only else measure_decode_b1({**single, **ours}, args.repeats, args.timeout)
        b8 = {} if args.ttft_only else measure_decode_batch({**batched, **ours}, args.repeats, args.timeout)
        results["machine_after"] = machine_info()
    for name in ttft_bases:
        results[name] = {"ttft": ttft[name]} | ({"decode_b1": b1[name], "decode_b8": b8[name]} if name in b1 else {})
    for name, gguf in llama.items():
        results[name] |= {"gguf": str(gguf.model), "mmproj": str(gguf.mmproj)}
    results["firsttoken_fp32"]["flags"] = no_budget
    for quant in _ours_variants(args):
        results[f"firsttoken_{quant}"]["flags"] = _variant_flags(no_budget, quant)
    if "firsttoken_budget" in results:
        results["firsttoken_budget"]["flags"] = list(FIRSTTOKEN_FLAGS)
    for schedule in _schedules(args):
        results[f"firsttoken_{schedule}"]["flags"] = [*no_budget, *SCHEDULES[schedule]]
    return results


def _schedules(args: argparse.Namespace) -> list[str]:
    return [s for s in args.schedules.split(",") if s]


def idle_speed(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 42's view per class: each schedule's TTFT against its own compute parts (preprocessing + vision tower +
    the forwards of its chunks: the default's target is within 5% of that) and against llama.cpp."""
    llama = results["llama_f32"]["ttft"]
    out: dict[str, dict[str, Any]] = {}
    names = [f"firsttoken_{s}" for s in (*SCHEDULES, "before") if f"firsttoken_{s}" in results]
    for name in ("firsttoken_fp32", *names):
        for cls, _ in PROMPTS:
            m = results[name]["ttft"][cls]
            p = m.parts or {}
            compute = p.get("preprocess_s", 0.0) + p.get("encoder_compute_s", 0.0) + p.get("forward_s", 0.0)
            row = {"ttft_s": m.median, "compute_s": compute, "ttft_over_compute": m.median / compute if compute else None,
                   "vs_llama": m.median / llama[cls].median, "parts": p}
            if name == "firsttoken_fp32":
                row["verdict_compute"] = _verdict(row["ttft_over_compute"] or float("inf"), 1.05, True)
                row["verdict_llama"] = _verdict(row["vs_llama"], TARGETS[cls], True)
            out[f"{name}:{cls}"] = row
    return out


def print_idle_speed(results: dict[str, Any]) -> None:
    rows = idle_speed(results)
    print(f"\nunloaded TTFT, issue 42 (medians of {results['repeats']}): TTFT, its own compute parts (preprocess + "
          "vision tower + forwards), the rest, and llama.cpp")
    print(f"{'server:class':28s}{'TTFT':>8s}{'compute':>9s}{'TTFT/comp':>10s}{'overhead':>9s}{'idle':>7s}"
          f"{'steps':>6s}{'/llama':>8s}  verdicts (default: <= 1.05 of compute; <= target x llama)")
    for key, r in rows.items():
        p = r["parts"]
        verdicts = f"{r.get('verdict_compute', '')} {r.get('verdict_llama', '')}"
        print(f"{key:28s}{r['ttft_s']:8.3f}{r['compute_s']:9.3f}{r['ttft_over_compute'] or 0:10.3f}"
              f"{p.get('step_overhead_s', 0):9.3f}{p.get('engine_idle_s', 0):7.3f}{p.get('steps_to_first_token', 0):6.0f}"
              f"{r['vs_llama']:8.2f}  {verdicts}")


# ---- report -------------------------------------------------------------------------------------------------
def _verdict(ratio: float, target: float, lower_is_better: bool) -> str:
    met = ratio <= target if lower_is_better else ratio >= target
    return f"{'met' if met else 'MISS'} ({'<=' if lower_is_better else '>='} {target:g})"


def _ratio(ours: Measured, llama: Measured, target: float, lower_is_better: bool) -> dict[str, Any]:
    r = ours.median / llama.median
    return {"ratio": r, "best_ratio": ours.best / llama.best, "target": target,
            "verdict": _verdict(r, target, lower_is_better)}  # fmt: skip


def ratios(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """ours / llama.cpp per measurement (medians; bests beside them), with issue 17's target and verdict."""
    llama, ours = results["llama_f32"], results["firsttoken_fp32"]
    out = {f"ttft_{cls}": _ratio(ours["ttft"][cls], llama["ttft"][cls], TARGETS[cls], True) for cls, _ in PROMPTS}
    out["decode_b1"] = _ratio(ours["decode_b1"], llama["decode_b1"], TARGETS["decode_b1"], True)
    out["decode_b8"] = _ratio(ours["decode_b8"], llama["decode_b8"], TARGETS["decode_b8"], False)
    for quant in VARIANTS:
        q = results.get(f"firsttoken_{quant}")
        if q is None:
            continue
        # against llama.cpp f32 (the same targets; int8 against llama.cpp's Q8_0 and bf16 against its BF16 when
        # measured) and against our fp32 (int8's TTFT target: 0.6)
        peer = results.get(PEER.get(quant, "llama_f32"), llama)
        for cls, _ in PROMPTS:
            out[f"{quant}_ttft_{cls}"] = _ratio(q["ttft"][cls], peer["ttft"][cls], TARGETS[cls], True)
            out[f"{quant}_vs_fp32_ttft_{cls}"] = _ratio(q["ttft"][cls], ours["ttft"][cls], 0.6, True)
        out[f"{quant}_decode_b1"] = _ratio(q["decode_b1"], peer["decode_b1"], TARGETS["decode_b1"], True)
        out[f"{quant}_decode_b8"] = _ratio(q["decode_b8"], peer["decode_b8"], TARGETS["decode_b8"], False)
        out[f"{quant}_vs_fp32_decode_b1"] = _ratio(q["decode_b1"], ours["decode_b1"], 1.0, True)
        out[f"{quant}_vs_fp32_decode_b8"] = _ratio(q["decode_b8"], ours["decode_b8"], 1.0, False)
    return out


VARIANTS = ("fp16", "int8", "bf16", "bf16w")  # our servers beside fp32: --quantization fp16 / int8, --dtype
# bfloat16, --quantization bf16 (bf16 weights, float32 activations)
PEER = {"int8": "llama_q8_0", "bf16": "llama_bf16", "bf16w": "llama_bf16"}  # the llama.cpp GGUF each is set
# beside, when it was measured


def _ours_variants(args: argparse.Namespace) -> list[str]:
    return [q for q, on in zip(VARIANTS, (args.ours_fp16, args.ours_int8, args.ours_bf16, args.ours_bf16_weights))
            if on]


def _variant_flags(base: list[str], variant: str) -> list[str]:
    if variant == "bf16":  # the later --dtype wins
        return [*base, "--dtype", "bfloat16"]
    if variant == "bf16w":
        return [*base, "--quantization", "bf16"]
    return [*base, "--quantization", variant]


def print_table(results: dict[str, Any]) -> None:
    llama, ours, budget = results["llama_f32"], results["firsttoken_fp32"], results.get("firsttoken_budget")
    quant_name = next((k for k in ("llama_q8_0", "llama_f16", "llama_bf16") if k in results), None)
    q8 = results.get(quant_name) if quant_name else None
    rat = ratios(results)
    m = results["machine"]
    print(f"\nCPU {m['cpu']}, {m['cores']} cores, flags {' '.join(m['cpu_flags']) or '(none of avx2/avx512/amx)'}; "
          f"llama.cpp {results.get('llama_commit') or '?'}; medians of {results['repeats']} after 1 warm-up")  # fmt: skip
    head = (f"{'':19s}{'tokens':>11s}{'llama f32':>11s}{'ours fp32':>11s}{'ours/llama':>12s}{'(best)':>8s}  "
            f"{'target':17s}")  # fmt: skip
    head += f"{quant_name.replace('_', ' '):>11s}" if q8 else ""
    head += f"{'ours budget':>13s}{'tokens':>8s}" if budget else ""
    print(head)

    def row(label: str, key: str, tokens: str, a: float, b: float, unit: str, extra: str) -> None:
        r = rat[key]
        print(f"{label:19s}{tokens:>11s}{a:10.3f}{unit}{b:10.3f}{unit}{r['ratio']:11.2f}x{r['best_ratio']:7.2f}x  "
              f"{r['verdict']:17s}{extra}")  # fmt: skip

    for cls, _ in PROMPTS:
        a, b = llama["ttft"][cls], ours["ttft"][cls]
        tokens = str(b.prompt_tokens) if a.prompt_tokens == b.prompt_tokens else f"{a.prompt_tokens}/{b.prompt_tokens}"
        extra = f"{q8['ttft'][cls].median:10.3f}s" if q8 else ""
        extra += f"{budget['ttft'][cls].median:12.3f}s{budget['ttft'][cls].prompt_tokens:>8}" if budget else ""
        row(f"TTFT {cls}", f"ttft_{cls}", tokens, a.median, b.median, "s", extra)
    a, b = llama["decode_b1"].median * 1e3, ours["decode_b1"].median * 1e3
    row("decode b1 ms/token", "decode_b1", "", a, b, " ", f"{q8['decode_b1'].median * 1e3:10.3f}" if q8 else "")
    a, b = llama["decode_b8"].median, ours["decode_b8"].median
    row(f"decode b{BATCH} tokens/s", "decode_b8", "", a, b, " ", f"{q8['decode_b8'].median:10.3f}" if q8 else "")
    print("(ours/llama: TTFT and ms/token lower is better, tokens/s higher; (best) = ratio of the fastest runs)")
    for quant in VARIANTS:
        q = results.get(f"firsttoken_{quant}")
        if q is None:
            continue
        peer = PEER.get(quant, "llama_f32")
        peer = (peer if peer in results else "llama_f32").replace("_", " ")
        label = {"bf16": "--dtype bfloat16", "bf16w": "--quantization bf16"}.get(quant, f"--quantization {quant}")
        print(f"\nours {label:27s}{f'ours {quant}':>11s}{f'/ {peer}':>13s}{'/ ours fp32':>13s}")
        for cls, _ in PROMPTS:
            print(f"TTFT {cls:27s}{q['ttft'][cls].median:10.3f}s{rat[f'{quant}_ttft_{cls}']['ratio']:12.2f}x"
                  f"{rat[f'{quant}_vs_fp32_ttft_{cls}']['ratio']:12.2f}x")
        decodes = (("decode b1 ms/token", "decode_b1", 1e3), (f"decode b{BATCH} tokens/s", "decode_b8", 1))
        for label, key, scale in decodes:
            print(f"{label:32s}{q[key].median * scale:10.3f} {rat[f'{quant}_{key}']['ratio']:12.2f}x"
                  f"{rat[f'{quant}_vs_fp32_{key}']['ratio']:12.2f}x")


def _jsonable(x: Any) -> Any:
    if isinstance(x, Measured):
        return asdict(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/llamacpp-peer"),
                   help="where llama.cpp is built and the checkpoint/GGUFs go (reused when present)")  # fmt: skip
    p.add_argument("--llama-dir", type=Path, default=None, help="an existing work dir with src/ and "
                   "build/bin/llama-server (default: --work-dir)")  # fmt: skip
    p.add_argument("--build", action="store_true", help="download the sdist from PyPI and build llama-server "
                   "when missing (~10-40 min on 2 cores)")  # fmt: skip
    p.add_argument("--convert-venv", type=Path, default=None, help="the converter's venv (default: "
                   "WORK/convert-venv; created when missing)")  # fmt: skip
    p.add_argument("--model", type=Path, default=None, help="our checkpoint, original layout (default: build "
                   "small into WORK/small-orig)")  # fmt: skip
    p.add_argument("--gguf", type=Path, default=None, help="an existing f32 language-model GGUF (skips conversion)")
    p.add_argument("--mmproj", type=Path, default=None, help="with --gguf: its vision projector GGUF")
    p.add_argument("--quant", choices=["q8_0", "f16", "bf16"], default=None,
                   help="also measure llama.cpp on this quantization")
    p.add_argument("--ours-fp16", action="store_true", help="also measure firsttoken with --quantization fp16")
    p.add_argument("--ours-int8", action="store_true", help="also measure firsttoken with --quantization int8")
    p.add_argument("--ours-bf16", action="store_true", help="also measure firsttoken with --dtype bfloat16 (set "
                   "beside llama.cpp's BF16 GGUF when --quant bf16 is given)")
    p.add_argument("--ours-bf16-weights", action="store_true", help="also measure firsttoken with --quantization "
                   "bf16 (bf16 weights, float32 activations; beside llama.cpp's BF16 GGUF when --quant bf16 is given)")
    p.add_argument("--llama-args", default="", help="more llama-server flags for every llama.cpp server, e.g. "
                   "--no-repack (its Q8_0 weight repacking crashed at load on an AVX-512 AMX Xeon)")
    p.add_argument("--gguf-quant", type=Path, default=None, help="with --quant: an existing quantized GGUF")
    p.add_argument("--no-budget-column", action="store_true", help="skip our default-budget TTFT run")
    p.add_argument("--schedules", default="", help="also measure TTFT with these schedules beside the default "
                   f"(comma-separated: {', '.join(SCHEDULES)}): issue 42's idle-speed table")
    p.add_argument("--ttft-only", action="store_true", help="measure TTFT only (no decode runs)")
    p.add_argument("--before", type=Path, default=None, help="another checkout (e.g. a git worktree of an earlier "
                   "commit): its default schedule is measured beside ours as firsttoken_before")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    work = args.work_dir.resolve()
    tree = LlamaCppTree((args.llama_dir or work).resolve())
    if args.build:
        build(tree)
    if not tree.server.exists():
        raise SystemExit(f"no llama-server at {tree.server}: pass --build or --llama-dir")
    model = small_checkpoint(args.model or work / "small-orig")
    needs_conversion = args.gguf is None or (args.quant and args.gguf_quant is None)
    python = converter_python(tree, args.convert_venv or work / "convert-venv") if needs_conversion else None
    f32 = GGUFPair(args.gguf, args.mmproj) if args.gguf else convert(tree, python, model, work / "gguf", "f32")

    llama = {"llama_f32": f32}
    if args.quant:
        quant = args.gguf_quant or convert(tree, python, model, work / "gguf", args.quant).model
        llama[f"llama_{args.quant}"] = GGUFPair(quant, f32.mmproj)
    results: dict[str, Any] = {"machine": machine_info(), "llama_commit": tree.commit(), "repeats": args.repeats,
                               "llama_args": args.llama_args,
                               "model": str(model), "threads": THREADS}  # fmt: skip
    print(f"machine: {results['machine']}", flush=True)
    results |= run_all(tree, model, llama, args)
    if args.ttft_only:
        results["idle_speed"] = idle_speed(results)
        print_idle_speed(results)
    else:
        results["ratios"] = ratios(results)
        print_table(results)
        if _schedules(args):
            results["idle_speed"] = idle_speed(results)
            print_idle_speed(results)
    if args.json:
        args.json.write_text(json.dumps(_jsonable(results), indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
