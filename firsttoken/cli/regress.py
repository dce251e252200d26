"""``firsttoken regress``: answers under each visual-token budget vs the largest budget's (see
tools/regress.py).

With ``--url`` it asks that server; without, it starts our server in-process on a loopback port
(float32 by default, so greedy answers are exact) with ``--image-max-tokens`` = the largest budget
(and ``--video-max-tokens`` = the largest video budget). Images and videos are separate reports;
with both, the JSON is the images' report with the videos' under ``"videos"``.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from firsttoken.cli.usage import (
    UsageError,
    check_reachable,
    existing_dir,
    existing_file,
    first_line,
)
from firsttoken.config import VideoConfig


def parse_budgets(text: str) -> list[int]:
    try:
        budgets = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"budgets must be integers like 4096,1200,400, got {text!r}"
        ) from None
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError("budgets must be positive integers")
    return budgets


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "regress",
        help="answer agreement across visual-token budgets (exit 1 below --min-agreement)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--images", type=Path, default=None, help="directory of images")
    p.add_argument(
        "--videos",
        type=Path,
        default=None,
        help="directory of videos (.mp4, .webm, .mkv, .mov, .avi), each asked alone like an image",
    )
    p.add_argument("--prompts", type=Path, required=True, help="text file, one prompt per line")
    p.add_argument(
        "--budgets",
        type=parse_budgets,
        default=[4096, 1200, 400],
        help="comma-separated visual tokens per image (default 4096,1200,400); the largest is the reference",
    )
    p.add_argument(
        "--video-budgets",
        type=parse_budgets,
        default=[4096, 1024, 256],
        help="comma-separated visual tokens per video (default 4096,1024,256: serve's cap down to two grids at "
             f"their smallest; at least {VideoConfig().video_min_frame_tokens}); the largest is the reference",
    )
    p.add_argument("--url", default=None, help="server root (default: start one in-process)")
    p.add_argument(
        "--model",
        default=None,
        help="in-process: checkpoint dir (default: the demo); with --url: the model id to send",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="in-process dtype (default float32: exact greedy answers)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument(
        "--min-agreement",
        type=float,
        default=None,
        help="exit 1 when a budget's exact agreement is below this (0..1)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=run)


@contextmanager
def in_process_server(model: str | None, dtype: str, image_max_tokens: int, no_caches: bool = False,
                      video_max_tokens: int | None = None) -> Iterator[str]:
    """Our server on a free loopback port, engine thread included; yields its URL."""
    import httpx
    import uvicorn

    from firsttoken.cli.serve import build_server, serve_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = serve_config(
        model=model,
        dtype=dtype,
        port=port,
        kv_cache_memory=256 * 2**20,
        image_max_tokens=image_max_tokens,
        video_max_tokens=video_max_tokens or VideoConfig().video_max_tokens,
        max_input_tokens=None,
        no_prefix_cache=no_caches,
        no_encoder_cache=no_caches,
    )
    app, engine = build_server(config)
    engine.start()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        httpx.get(f"{url}/health").raise_for_status()
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()


def run(args: argparse.Namespace) -> int:
    from firsttoken.cli.serve_checks import check_checkpoint
    from firsttoken.tools.regress import (
        ChatServer,
        format_report,
        list_images,
        list_videos,
        read_prompts,
        run_regress,
    )

    if args.images is None and args.videos is None:
        raise UsageError("--images", None, "give --images DIR, --videos DIR or both")
    images: list[Path] = []
    videos: list[Path] = []
    for flag, directory, lister, out in (("--images", args.images, list_images, images),
                                         ("--videos", args.videos, list_videos, videos)):
        if directory is None:
            continue
        try:
            out.extend(lister(existing_dir(flag, directory)))
        except ValueError as exc:
            raise UsageError(flag, directory, str(exc)) from None
    least = VideoConfig().video_min_frame_tokens
    if videos and min(args.video_budgets) < least:
        raise UsageError("--video-budgets", ",".join(map(str, args.video_budgets)),
                         f"each must be at least {least} (one two-frame grid at its smallest)")
    try:
        prompts = read_prompts(existing_file("--prompts", args.prompts))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError("--prompts", args.prompts, first_line(str(exc))) from None
    if args.url:
        check_reachable("--url", args.url)
    elif args.model:
        check_checkpoint("--model", Path(args.model))

    def regress(url: str, model: str | None):
        server = ChatServer(url, model, max_tokens=args.max_tokens)
        try:
            return (
                [run_regress(server, images, prompts, args.budgets, args.min_agreement)]
                if images
                else []
            ) + (
                [
                    run_regress(
                        server, videos, prompts, args.video_budgets, args.min_agreement, "video"
                    )
                ]
                if videos
                else []
            )
        finally:
            server.close()

    if args.url:
        reports = regress(args.url, args.model)
    else:
        with in_process_server(args.model, args.dtype, max(args.budgets),
                               video_max_tokens=max(args.video_budgets)) as url:
            reports = regress(url, None)
    if args.json:
        body = reports[0].to_dict() | (
            {"videos": reports[1].to_dict()} if len(reports) == 2 else {}
        )
        print(json.dumps(body, indent=2))
    else:
        print("\n\n".join(format_report(r) for r in reports))
    return 0 if all(r.passed for r in reports) else 1
