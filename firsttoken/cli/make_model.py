"""``firsttoken make-model DIR``: write a random-weight Qwen2-VL checkpoint (see models/checkpoint.py)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from firsttoken.models.checkpoint import LAYOUTS, SIZES, make_model


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "make-model",
        help="write a random-weight Qwen2-VL checkpoint in Hugging Face format",
        description="Write a random-weight Qwen2-VL checkpoint that transformers loads unchanged.",
    )
    parser.add_argument("dir", help="output directory (created if missing)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=LAYOUTS, default="transformers")
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        out = make_model(args.dir, size=args.size, seed=args.seed, layout=args.layout, shards=args.shards)
    except ValueError as exc:  # bad --shards for this size
        print(f"firsttoken make-model: error: {exc}", file=sys.stderr)
        return 2
    meta = json.loads((out / "firsttoken_checkpoint.json").read_text())
    params = meta["params"]
    print(
        f"wrote {out} ({args.size}, seed {args.seed}, {args.layout} layout, {args.shards} shard(s)): "
        f"{params['total']:,} parameters ({params['language_model']:,} language model, {params['vision']:,} vision)"
    )
    return 0
