"""``firsttoken doctor``: where a running server's TTFT goes, and one change per cause (see
tools/doctor/)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from firsttoken.cli.usage import (
    UsageError,
    existing_file,
    from_config_error,
    read_config_json,
    unreachable,
)
from firsttoken.tools.doctor.rules import KVSizing, Thresholds


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="read a server's /metrics and /stats: where TTFT goes, ranked causes, one flag change each",
        description="Diagnose TTFT from a server's /metrics (firsttoken, vLLM or llama.cpp names) and "
        "firsttoken's /stats.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="server root, e.g. http://127.0.0.1:8000")
    src.add_argument("--metrics-file", type=Path, help="a saved /metrics page instead of --url")
    p.add_argument("--stats-file", type=Path, help="with --metrics-file: a saved /stats JSON")
    p.add_argument(
        "--probe",
        action="store_true",
        help="run a short bench first (a few requests + 2 follow-ups)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--api-key", default=os.environ.get("FIRSTTOKEN_API_KEY"), help="bearer key (default: "
                   "$FIRSTTOKEN_API_KEY)")  # fmt: skip
    p.add_argument(
        "--served-model",
        default=None,
        help="--probe: the model id to send (default: the first)",
    )
    p.add_argument("--model", default=None, help="checkpoint dir or config.json: KV bytes per token, so a "
                   "KV finding names a --kv-cache-memory value; a tiling family's images counted in "
                   "tiles too")  # fmt: skip
    p.add_argument(
        "--dtype",
        default="float32",
        help="with --model: the KV dtype the server runs (default float32)",
    )
    p.add_argument("--peak-concurrency", type=int, default=None, help="requests in flight at the peak "
                   "(default: estimated from the metrics)")  # fmt: skip
    p.add_argument(
        "--image-budget",
        type=int,
        default=Thresholds.image_budget_tokens,
        help="visual tokens per image to recommend (default %(default)s)",
    )
    p.add_argument(
        "--high-share",
        type=float,
        default=Thresholds.high_share,
        help="estimated TTFT share from which a finding is high severity (default %(default)s)",
    )
    p.add_argument("--ttft-p99-target", type=float, default=None, help="seconds; a finding when a class's P99 "
                   "TTFT exceeds it")  # fmt: skip
    p.set_defaults(handler=run)


def kv_sizing(model: str | None, dtype: str, peak: int | None) -> KVSizing:
    if model is None:
        return KVSizing(peak_concurrency=peak)
    from firsttoken.tools.model_shape import DTYPE_BYTES, ModelShape

    if dtype not in DTYPE_BYTES:
        raise UsageError("--dtype", dtype, f"unknown dtype; use one of {', '.join(DTYPE_BYTES)}")
    config = read_config_json("--model", model, allow_file=True)
    try:
        return KVSizing(ModelShape.from_config(config).kv_bytes_per_token(DTYPE_BYTES[dtype]), peak)
    except ValueError as exc:  # tools.plan names the missing config.json field
        raise UsageError("--model", model, str(exc)) from None


def tile_facts(model: str | None, budget: int) -> tuple[int | None, int | None]:
    """With --model of a tiling family (InternVL3.5): its tokens per tile and the tiles ``budget``
    buys at most (within the checkpoint's max_patches); else (None, None)."""
    if model is None:
        return None, None
    from firsttoken.inputs.budget import image_tokens_at_most
    from firsttoken.models.registry import served_image_processor

    proc = served_image_processor(read_config_json("--model", model, allow_file=True), model)
    if proc is None or proc.tiles is None:  # (KV sizing may still read a config we do not serve)
        return None, None
    at_most = image_tokens_at_most(budget, proc)
    if at_most is None:
        raise UsageError("--image-budget", str(budget), f"under one tile: this model's images cost at least "
                         f"{proc.tokens_per_tile} tokens")
    return proc.tokens_per_tile, at_most // proc.tokens_per_tile


def run(args: argparse.Namespace) -> int:
    import httpx

    from firsttoken.tools.doctor import doctor_from_texts, format_report
    from firsttoken.tools.doctor.fetch import run_doctor

    tokens_per_tile, budget_tiles = tile_facts(args.model, args.image_budget)
    try:
        th = Thresholds(image_budget_tokens=args.image_budget, high_share=args.high_share,
                        medium_share=min(Thresholds.medium_share, args.high_share),
                        ttft_p99_target_s=args.ttft_p99_target, tokens_per_tile=tokens_per_tile,
                        budget_tiles=budget_tiles)  # fmt: skip
    except ValueError as exc:
        raise from_config_error(exc, args, {"image_budget_tokens": "--image-budget"}) or UsageError(
            None, None, str(exc)) from None
    kv = kv_sizing(args.model, args.dtype, args.peak_concurrency)
    if args.url:
        try:
            report = run_doctor(args.url, api_key=args.api_key, do_probe=args.probe, model=args.served_model,
                                thresholds=th, kv=kv)  # fmt: skip
        # down, unreachable, 401, not a firsttoken/vLLM server
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise unreachable_or_refused(args.url, exc) from None
    else:
        metrics = existing_file("--metrics-file", args.metrics_file).read_text()
        stats = None
        if args.stats_file:
            try:
                stats = json.loads(existing_file("--stats-file", args.stats_file).read_text())
            except ValueError as exc:
                raise UsageError("--stats-file", args.stats_file, f"not JSON ({exc})") from None
        try:
            report = doctor_from_texts(metrics, stats, thresholds=th, kv=kv)
        except (ValueError, KeyError) as exc:
            raise UsageError(
                "--metrics-file", args.metrics_file, f"cannot read it as /metrics: {exc!s}"
            ) from None
    print(json.dumps(report.to_dict(), indent=1) if args.json else format_report(report))
    return 0


def unreachable_or_refused(url: str, exc: Exception) -> UsageError:
    import httpx

    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        hint = "; pass --api-key (or set $FIRSTTOKEN_API_KEY)" if status in (401, 403) else ""
        return UsageError("--url", url, f"{exc.request.url.path} answered HTTP {status}{hint}")
    return unreachable("--url", url, exc)
