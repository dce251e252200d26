"""``firsttoken plan``: where a device's memory goes and how many requests its KV pool admits, from
a checkpoint's config (see tools/plan.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from firsttoken.cli.usage import UsageError, from_config_error, read_config_json
from firsttoken.config import QUANTIZATIONS, VideoConfig
from firsttoken.tools.plan import (
    DTYPE_BYTES,
    MEMORY_UTILIZATION,
    DoesNotFit,
    PlanInputs,
    UnderOneTile,
    format_plan,
    make_plan,
    video_tokens_at_most,
)
from firsttoken.units import format_size, parse_bytes

# the defaults, read from one place
_DEFAULTS = PlanInputs(peak_concurrency=1, kv_cache_memory_bytes=1)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="memory and KV capacity planning: weights, workspace, KV pool, max concurrency, serve flags",
        description="Plan a device's memory and the KV pool for a workload from a checkpoint's config.json "
        "(no weights are loaded).",
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model", help="checkpoint directory (config.json; safetensors headers if present)"
    )
    src.add_argument("--config", help="a config.json file")
    memory = parser.add_mutually_exclusive_group(required=True)
    memory.add_argument(
        "--memory",
        help="the device's memory (80GiB, 80G, or bytes): the KV pool is what "
        "--gpu-memory-utilization of it leaves after weights, step workspace and the encoder cache",
    )
    memory.add_argument(
        "--kv-cache-memory", help="the KV pool itself, as serve --kv-cache-memory takes it"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        "--memory-utilization",
        dest="memory_utilization",
        type=float,
        default=MEMORY_UTILIZATION,
        help="share of --memory the server may use, as serve --gpu-memory-utilization "
        f"(default {MEMORY_UTILIZATION})",
    )
    _workload_args(parser)
    _engine_args(parser)
    parser.add_argument(
        "--json", metavar="FILE", help="also write the plan as JSON ('-': JSON on stdout only)"
    )
    parser.set_defaults(handler=run)


def _workload_args(parser: argparse.ArgumentParser) -> None:
    """What the peak looks like: requests in flight and what one holds."""
    parser.add_argument(
        "--peak-concurrency", type=int, required=True, help="requests in flight at the peak"
    )
    parser.add_argument("--text-tokens", type=int, default=_DEFAULTS.text_tokens)
    parser.add_argument("--images-per-request", type=int, default=_DEFAULTS.images_per_request)
    parser.add_argument("--image-tokens", type=int, default=_DEFAULTS.image_tokens,
                        help="visual-token budget per image")
    parser.add_argument("--videos-per-request", type=int, default=_DEFAULTS.videos_per_request)
    parser.add_argument(
        "--video-tokens",
        type=int,
        default=None,
        help="visual tokens per video, as serve --video-max-tokens caps them (default: "
        f"{_DEFAULTS.video_tokens}, serve's cap, or what --video-seconds can cost within it)",
    )
    parser.add_argument(
        "--video-seconds",
        type=float,
        default=None,
        help="clip length: a video costs at most its sampled frames at serve's 2 fps in two-frame "
        "grids of at most 768 tokens, within --video-tokens",
    )
    parser.add_argument("--output-tokens", type=int, default=_DEFAULTS.output_tokens)
    parser.add_argument("--template-overhead-tokens", type=int, default=None,
                        help="chat-template tokens per request (default: 21 + 2 per image)")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="default: prompt + output, whole blocks"
    )


def _engine_args(parser: argparse.ArgumentParser) -> None:
    """The serve flags that size memory beside the KV pool."""
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="tokens one step runs, sizing the workspace (default: serve's 2048, raised to fit "
        "one image beside a decode per peak request)",
    )
    parser.add_argument("--encoder-cache-memory", default=None,
                        help="vision-encoder output cache (default: serve's, "
                             f"{format_size(_DEFAULTS.encoder_cache_memory_bytes)})")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=_DEFAULTS.dtype)
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=_DEFAULTS.quantization,
        help="serve --quantization: fp16 and bf16 count the language model's linear layers at 2 bytes, "
        "int8 those of the language model and the vision tower at 1 byte (with --dtype "
        "float32); auto counts as none (serve may keep a bf16 checkpoint's weights at 2 "
        "bytes: the plan's figure is the larger)",
    )
    parser.add_argument("--block-size", type=int, default=_DEFAULTS.block_size)
    parser.add_argument(
        "--decode-reserve-tokens", type=int, default=_DEFAULTS.decode_reserve_tokens
    )


def run(args: argparse.Namespace) -> int:
    source_flag, source = ("--model", args.model) if args.model else ("--config", args.config)
    config = read_config_json(source_flag, source, allow_file=True)
    try:
        inputs = PlanInputs(
            peak_concurrency=args.peak_concurrency,
            kv_cache_memory_bytes=_size("--kv-cache-memory", args.kv_cache_memory),
            device_memory_bytes=_size("--memory", args.memory),
            memory_utilization=args.memory_utilization,
            text_tokens=args.text_tokens,
            images_per_request=args.images_per_request,
            image_tokens=args.image_tokens,
            videos_per_request=args.videos_per_request,
            video_tokens=_video_tokens(args),
            output_tokens=args.output_tokens,
            dtype=args.dtype,
            quantization=args.quantization,
            block_size=args.block_size,
            decode_reserve_tokens=args.decode_reserve_tokens,
            template_overhead_tokens=args.template_overhead_tokens,
            max_model_len=args.max_model_len,
            max_batched_tokens=args.max_batched_tokens,
            encoder_cache_memory_bytes=_size("--encoder-cache-memory", args.encoder_cache_memory,
                                             _DEFAULTS.encoder_cache_memory_bytes),
        )
    except ValueError as exc:
        raise from_config_error(exc, args) or UsageError(None, None, str(exc)) from None
    try:
        plan = make_plan(config, inputs, model_dir=args.model)
    except DoesNotFit as exc:
        raise UsageError("--memory", args.memory, str(exc)) from None
    except UnderOneTile as exc:
        raise UsageError("--image-tokens", str(args.image_tokens), str(exc)) from None
    except ValueError as exc:  # ConfigFieldMissing: the sentence names the field and what it is for
        raise UsageError(source_flag, source, str(exc)) from None
    text = json.dumps(plan.to_dict(), indent=1)
    if args.json == "-":
        print(text)
        return 0
    print(format_plan(plan))
    if args.json:
        try:
            Path(args.json).write_text(text + "\n")
        except OSError as exc:
            raise UsageError(
                "--json", args.json, f"cannot write it ({exc.strerror or exc})"
            ) from None
    return 0


def _video_tokens(args: argparse.Namespace) -> int:
    """Per-video tokens: the budget serve would take as --video-max-tokens, lowered to what
    --video-seconds costs."""
    budget = _DEFAULTS.video_tokens if args.video_tokens is None else args.video_tokens
    try:
        video = VideoConfig(video_max_tokens=budget)  # serve's check: at least one two-frame grid
    except ValueError as exc:
        raise UsageError(
            "--video-tokens", budget, str(exc).removeprefix("video_max_tokens ")
        ) from None
    if args.video_seconds is None:
        return budget
    if not args.video_seconds > 0:
        raise UsageError("--video-seconds", args.video_seconds, "must be > 0")
    return video_tokens_at_most(args.video_seconds, video)


def _size(flag: str, text: str | None, default: int | None = None) -> int | None:
    if text is None:
        return default
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise UsageError(flag, text, str(exc)) from None
