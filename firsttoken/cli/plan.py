"""``firsttoken plan``: KV capacity planning from a checkpoint's config (see tools/plan.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from firsttoken.tools.plan import DTYPE_BYTES, PlanInputs, format_plan, load_config, make_plan, parse_bytes


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="KV capacity planning: KV per request, max concurrency, serve flags",
        description="Plan the KV pool for a workload from a checkpoint's config.json (no weights are loaded).",
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory (config.json; safetensors headers if present)")
    src.add_argument("--config", help="a config.json file")
    parser.add_argument("--memory", required=True, type=parse_bytes,
                        help="KV pool memory (what --kv-cache-memory gets): 24GiB, 80G, or bytes")
    parser.add_argument("--peak-concurrency", type=int, required=True, help="requests in flight at the peak")
    parser.add_argument("--text-tokens", type=int, default=800)
    parser.add_argument("--images-per-request", type=int, default=3)
    parser.add_argument("--image-tokens", type=int, default=1200, help="visual-token budget per image")
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--template-overhead-tokens", type=int, default=None,
                        help="chat-template tokens per request (default: 21 + 2 per image)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: prompt + output, whole blocks")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--decode-reserve-tokens", type=int, default=64)
    parser.add_argument("--json", metavar="FILE", help="also write the plan as JSON ('-' for stdout only)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        inputs = PlanInputs(
            kv_cache_memory_bytes=args.memory,
            peak_concurrency=args.peak_concurrency,
            text_tokens=args.text_tokens,
            images_per_request=args.images_per_request,
            image_tokens=args.image_tokens,
            output_tokens=args.output_tokens,
            dtype=args.dtype,
            block_size=args.block_size,
            decode_reserve_tokens=args.decode_reserve_tokens,
            template_overhead_tokens=args.template_overhead_tokens,
            max_model_len=args.max_model_len,
        )
        source = args.model or args.config
        plan = make_plan(load_config(source), inputs, model_dir=args.model)
    except (ValueError, KeyError, OSError) as exc:
        print(f"firsttoken plan: error: {exc!s}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    print(format_plan(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
    return 0
