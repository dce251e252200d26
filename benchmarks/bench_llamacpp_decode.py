"""Served decode only, side by side: llama.cpp's llama-server (f32 and bf16 GGUFs) and firsttoken (fp32 and bf16), and
optionally firsttoken from another checkout (before/after a change), on the same `small` checkpoint and machine.

The decode half of bench_llamacpp.py (its prompts, clients and servers: batch 1 = one streaming request of 128
tokens, ms per token after the first; batch 8 = eight at once, total tokens/s; llama.cpp with -np 1 and -np 8;
every server on 2 threads), without the TTFT rounds, so a change to the decode path is measured in minutes. Rounds
alternate between the servers; medians of ``--repeats``. The GGUFs come from an earlier bench_llamacpp.py run (its
work dir), or pass them.

    python benchmarks/bench_llamacpp_decode.py --work-dir /work/peers/llamacpp --baseline /path/to/old/checkout \\
        --json docs/runs/llamacpp-decode.json
    # more firsttoken servers of this checkout, each with its own flags (compared with llama.cpp's GGUF of their dtype)
    python benchmarks/bench_llamacpp_decode.py --work-dir /work/peers/llamacpp \\
        --configs "bf16_d2=--dtype bfloat16 --decode-threads 2"
    # --quantization int8 beside llama.cpp's Q8_0 (gguf/qwen2vl-small-orig-q8_0.gguf, e.g. bench_llamacpp.py --quant
    # q8_0's), before/after: our int8 servers are compared with Q8_0, fp32 with f32
    python benchmarks/bench_llamacpp_decode.py --work-dir /work/peers/llamacpp --quants f32,q8_0 --ours int8 \\
        --baseline /path/to/old/checkout
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_llamacpp as b  # noqa: E402
from _common import checkout  # noqa: E402
from llamacpp_peer import GGUFPair, LlamaCppTree  # noqa: E402
from machine import machine_info  # noqa: E402

OURS = {"fp32": list(b.FIRSTTOKEN_FLAGS), "bf16": [*b.FIRSTTOKEN_FLAGS, "--dtype", "bfloat16"],
        "int8": [*b.FIRSTTOKEN_FLAGS, "--quantization", "int8"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", type=Path, required=True, help="bench_llamacpp.py's work dir: build/bin/llama-"
                   "server, small-orig/, gguf/qwen2vl-small-orig-{f32,bf16}.gguf and its mmproj")  # fmt: skip
    p.add_argument("--baseline", type=Path, default=None, help="another checkout's root: its firsttoken too")
    p.add_argument("--configs", default="", help="more firsttoken servers: label=serve flags, separated by ';'")
    p.add_argument("--quants", default="f32,bf16", help="llama.cpp's GGUFs to serve (f32, bf16, q8_0)")
    p.add_argument("--ours", default="fp32,bf16", help="our servers of this checkout (and --baseline's): fp32, bf16, "
                   "int8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    work = args.work_dir.resolve()
    tree, gguf = LlamaCppTree(work), work / "gguf"
    mmproj = gguf / "mmproj-small-orig-f32.gguf"
    llama = {f"llama_{q}": GGUFPair(gguf / f"qwen2vl-small-orig-{q}.gguf", mmproj) for q in args.quants.split(",")}
    model = work / "small-orig"
    flags = {k: OURS[k] for k in args.ours.split(",")}
    baseline_flags = dict(flags)
    for item in filter(None, (c.strip() for c in args.configs.split(";"))):
        label, _, extra = item.partition("=")
        flags[label.strip()] = [*b.FIRSTTOKEN_FLAGS, *extra.split()]
    with ExitStack() as stack:
        single = {k: b.start_llama(stack, tree.server, v, 1, ()) for k, v in llama.items()}
        batched = {k: b.start_llama(stack, tree.server, v, b.BATCH, ()) for k, v in llama.items()}
        ours = {f"ours_{k}": b.start_firsttoken(stack, model, v) for k, v in flags.items()}
        if args.baseline is not None:
            with checkout(args.baseline.resolve()):
                ours |= {f"baseline_{k}": b.start_firsttoken(stack, model, v) for k, v in baseline_flags.items()}
        before = machine_info()
        b1 = b.measure_decode_b1({**single, **ours}, args.repeats, args.timeout)
        b8 = b.measure_decode_batch({**batched, **ours}, args.repeats, args.timeout)
        after = machine_info()
    results: dict[str, Any] = {"argv": sys.argv, "machine_before": before, "machine_after": after,
                               "llama_commit": tree.commit(), "repeats": args.repeats,
                               "flags": flags, "baseline": str(args.baseline) if args.baseline else None}
    m = before
    print(f"\nCPU {m['cpu']}, {m['cores']} cores, flags {' '.join(m['cpu_flags'])}; medians of {args.repeats}")
    print(f"{'':16s}{'b1 ms/token':>12s}{'/ llama':>9s}{f'b{b.BATCH} tokens/s':>15s}{'/ llama':>9s}")
    for name in b1:
        label = name.split("_", 1)[1]
        own = flags.get(label, OURS["fp32"])
        peer = "llama_bf16" if "bfloat16" in own else "llama_q8_0" if "int8" in own else "llama_f32"
        peer = peer if peer in b1 else next(k for k in b1 if k.startswith("llama_"))  # its GGUF not served
        results[name] = {"decode_b1_s_per_token": b1[name].runs, "decode_b8_tokens_per_s": b8[name].runs}
        print(f"{name:16s}{b1[name].median * 1e3:12.2f}{b1[name].median / b1[peer].median:8.2f}x"
              f"{b8[name].median:15.1f}{b8[name].median / b8[peer].median:8.2f}x")
    print(f"(targets, issue 17: b1 <= 1.0x llama.cpp's ms/token, b{b.BATCH} >= 2x its tokens/s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
