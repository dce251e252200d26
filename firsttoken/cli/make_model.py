"""``firsttoken make-model DIR``: write a random-weight checkpoint of a served family (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, InternVL3.5; models/checkpoint.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from firsttoken.cli.usage import UsageError
from firsttoken.models.checkpoint import make_dummy_model, make_model, recipes
from firsttoken.models.recipe import CHECKPOINT_DTYPES, LAYOUTS

# make_model writes it last: its presence marks our own output
CHECKPOINT_META = "firsttoken_checkpoint.json"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "make-model",
        help="write a random-weight checkpoint (Qwen-VL, InternVL3.5) in Hugging Face format",
        description="Write a random-weight Qwen-VL checkpoint that transformers loads unchanged.",
    )
    parser.add_argument("dir", help="output directory (created if missing)")
    parser.add_argument(
        "--family", choices=sorted(recipes()), default="qwen2-vl", help="model family"
    )
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=LAYOUTS, default="transformers")
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    parser.add_argument(
        "--dtype",
        choices=CHECKPOINT_DTYPES,
        default="float32",
        help="the weights' dtype on disk (published Qwen-VL checkpoints are bfloat16)",
    )
    parser.add_argument(
        "--dummy-config",
        type=Path,
        metavar="CONFIG_JSON",
        help="instead: no weights, this config.json (a published model's, e.g. Qwen2-VL-7B-Instruct's) "
        "with the demo tokenizer, for `firsttoken serve --load-format dummy` (--family, --size, "
        "--seed, --layout, --shards and --dtype do not apply)",
    )
    parser.set_defaults(handler=run)


def check_writable_dir(out: Path) -> None:
    """make_model replaces config.json and every model*.safetensors in DIR: only a new or empty
    directory, or one make-model wrote before (it has CHECKPOINT_META), may be written, so a real
    checkpoint is never lost."""
    if out.exists() and not out.is_dir():
        raise UsageError(None, out, "exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / CHECKPOINT_META).is_file():
        raise UsageError(
            None,
            out,
            f"not empty and not written by make-model (no {CHECKPOINT_META}); it would "
            "overwrite config.json and the weights there: choose a new or empty directory",
        )


def run(args: argparse.Namespace) -> int:
    check_writable_dir(Path(args.dir))
    if args.dummy_config is not None:
        return run_dummy(Path(args.dir), args.dummy_config)
    if args.shards < 1:
        raise UsageError("--shards", args.shards, "must be >= 1")
    try:
        out = make_model(
            args.dir,
            size=args.size,
            seed=args.seed,
            layout=args.layout,
            shards=args.shards,
            family=args.family,
            dtype=args.dtype,
        )
    # more --shards than this size has tensors, or a layout the family lacks
    except ValueError as exc:
        flag, value = (
            ("--layout", args.layout) if "layout" in str(exc) else ("--shards", args.shards)
        )
        raise UsageError(flag, value, str(exc)) from None
    except OSError as exc:  # no permission, disk full
        raise UsageError(
            None, args.dir, f"cannot write the checkpoint here ({exc.strerror or exc})"
        ) from None
    meta = json.loads((out / CHECKPOINT_META).read_text())
    params = meta["params"]
    print(
        f"wrote {out} ({args.family} {args.size}, seed {args.seed}, {args.layout} layout, {args.shards} shard(s)"
        f"{'' if args.dtype == 'float32' else ', ' + args.dtype}): "
        f"{params['total']:,} parameters ({params['language_model']:,} language model, {params['vision']:,} vision)"
    )
    return 0


def run_dummy(out: Path, config_path: Path) -> int:
    """``--dummy-config``: a weightless directory for --load-format dummy."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError("--dummy-config", config_path, f"cannot read it as JSON ({exc})") from None
    try:
        make_dummy_model(out, config)
    except ValueError as exc:  # not a family we serve
        raise UsageError("--dummy-config", config_path, str(exc)) from None
    print(f"wrote {out}: {config_path}'s shapes, the demo tokenizer, no weights; serve it with "
          f"`firsttoken serve --model {out} --load-format dummy`")
    return 0
