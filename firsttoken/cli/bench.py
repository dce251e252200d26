"""``firsttoken bench --url URL``: seeded load against any OpenAI-compatible server (see
tools/bench/)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from firsttoken.cli.usage import (
    UsageError,
    check_reachable,
    existing_file,
    first_line,
    from_config_error,
)
from firsttoken.tools.bench.config import BenchConfig, parse_mix, parse_size


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="seeded load generator for any OpenAI-compatible server: TTFT/TPOT/ITL per class, goodput, JSON",
        description="Send a seeded chat workload (streaming, include_usage) and report what the client saw.",
    )
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model id to send (default: the server's first from /v1/models)")
    _workload_args(p.add_argument_group("workload"))
    _arrival_args(p.add_argument_group("arrivals"))
    _report_args(p.add_argument_group("report"))
    p.set_defaults(handler=run)


def _workload_args(w: Any) -> None:
    w.add_argument("--workload", choices=("seed-mix", "text", "multiturn"), default="seed-mix")
    w.add_argument(
        "--workload-file", help="JSONL, one chat request body per line (overrides --workload)"
    )
    w.add_argument(
        "--mix",
        type=parse_mix,
        default=parse_mix("text=0.5,1img=0.3,3img=0.2"),
        help="seed-mix classes and weights: text, Nimg (N images), video (one synthetic clip) "
        "(default text=0.5,1img=0.3,3img=0.2)",
    )
    w.add_argument(
        "--image-size",
        type=parse_size,
        default=(1024, 1024),
        help="WIDTHxHEIGHT (default 1024x1024)",
    )
    w.add_argument("--image-format", choices=("jpeg", "png"), default="jpeg")
    w.add_argument("--video-seconds", type=float, default=4.0,
                   help="the video class's clip length, seconds (default 4; sent as a data:video/mp4 video_url)")
    w.add_argument("--video-size", type=parse_size, default=(640, 360),
                   help="the video class's frame size, WIDTHxHEIGHT, both even (default 640x360)")
    w.add_argument(
        "--video-fps", type=int, default=24, help="the video class's frame rate (default 24)"
    )
    w.add_argument(
        "--text-tokens",
        type=int,
        default=800,
        help="text-only prompt length, roughly (default 800)",
    )
    w.add_argument(
        "--image-text-tokens", type=int, default=32, help="words beside the images (default 32)"
    )
    w.add_argument("--output-tokens", type=int, default=128, help="max_tokens (default 128)")
    w.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos=true (needed for servers that reject vendor extras)",
    )
    w.add_argument(
        "--turns", type=int, default=3, help="multiturn: follow-ups per conversation (default 3)"
    )
    w.add_argument("--multiturn-images", type=int, default=3)


def _arrival_args(a: Any) -> None:
    rate = a.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="Poisson arrivals, sessions/s")
    rate.add_argument(
        "--utilization",
        type=float,
        metavar="U",
        help="Poisson arrivals at U x this machine's capacity, measured first from each class's "
        "unloaded service time (1 = as fast as sessions finish one at a time)",
    )
    a.add_argument(
        "--calibration-requests",
        type=int,
        default=3,
        help="with --utilization: sessions per class sent alone, after one warm-up (default 3)",
    )
    a.add_argument("--concurrency", type=int, help="at most this many sessions in flight")
    a.add_argument(
        "--num-requests", type=int, help="sessions to measure (default 100 unless --duration)"
    )
    a.add_argument("--duration", type=float, help="seconds to keep starting sessions")
    a.add_argument(
        "--warmup", type=int, default=0, help="sessions run first and left out of the statistics"
    )
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")


def _report_args(o: Any) -> None:
    o.add_argument("--slo-ttft", type=float, help="goodput: TTFT SLO, seconds")
    o.add_argument("--slo-tpot", type=float, help="goodput: TPOT SLO, seconds")
    o.add_argument(
        "--json", metavar="FILE", help="write config, workload, per-request records and summary"
    )
    o.add_argument(
        "--plot",
        metavar="FILE.png",
        help="TTFT distribution per class + TTFT over time (matplotlib)",
    )
    o.add_argument("--no-progress", dest="progress", action="store_false")


# BenchConfig fields whose flag is spelled differently (the rest are the flag's name with
# underscores)
RENAMED_FLAGS = {"duration_s": "--duration", "timeout_s": "--timeout", "slo_ttft_s": "--slo-ttft",
                 "slo_tpot_s": "--slo-tpot", "workload_file": "--workload-file"}


def run(args: argparse.Namespace) -> int:
    from firsttoken.tools.bench import (  # needs httpx: only when run
        format_report,
        plot_report,
        run_bench,
    )
    from firsttoken.tools.bench.workload import Workload

    num_requests = (
        args.num_requests if args.num_requests is not None else (None if args.duration else 100)
    )
    if args.workload_file:
        existing_file("--workload-file", args.workload_file)
    try:
        config = BenchConfig(
            url=args.url,
            model=args.model,
            workload="file" if args.workload_file else args.workload,
            workload_file=args.workload_file,
            mix=args.mix,
            image_size=args.image_size,
            image_format=args.image_format,
            video_seconds=args.video_seconds,
            video_size=args.video_size,
            video_fps=args.video_fps,
            text_tokens=args.text_tokens,
            image_text_tokens=args.image_text_tokens,
            output_tokens=args.output_tokens,
            ignore_eos=args.ignore_eos,
            turns=args.turns,
            multiturn_images=args.multiturn_images,
            rate=args.rate,
            utilization=args.utilization,
            calibration_requests=args.calibration_requests,
            concurrency=args.concurrency,
            num_requests=num_requests,
            duration_s=args.duration,
            warmup=args.warmup,
            seed=args.seed,
            slo_ttft_s=args.slo_ttft,
            slo_tpot_s=args.slo_tpot,
            timeout_s=args.timeout,
            progress=args.progress,
        )
    except ValueError as exc:
        raise from_config_error(exc, args, RENAMED_FLAGS) or UsageError(
            None, None, str(exc)
        ) from None
    if args.workload_file:
        try:
            # reads and parses the file: a bad line is said before any request is sent
            Workload(config)
        except (ValueError, OSError) as exc:
            raise UsageError("--workload-file", args.workload_file, first_line(str(exc))) from None
    # one line now, not one error per request later
    check_reachable("--url", args.url, min(10.0, args.timeout))
    report = run_bench(config)
    print(format_report(report))
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        if plot_report(report, args.plot):
            print(f"wrote {args.plot}")
        else:
            print("--plot needs matplotlib: pip install 'firsttoken[bench]'", file=sys.stderr)
    return 0 if report.summary.num_ok else 1
