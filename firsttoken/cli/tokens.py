"""``firsttoken tokens FILE...``: what each image or video costs in visual tokens under a budget,
from headers only.

The same plans the server makes (``inputs/budget.plan_image``, ``inputs/video.plan_video_bytes``):
nothing is decoded and no model runs, so it answers for a 50-megapixel photo in milliseconds and for
a video from its container's header and packets (the frames it holds, never their pixels). A file is
a video when its first bytes are a container's (MP4/MOV, WebM/Matroska, AVI), an image otherwise.
``--image-max-tokens 16384`` is Qwen2-VL's reference processor default (no budget to speak of); the
server's default cap is 1280. The ``--video-*`` flags are ``serve``'s, with its defaults.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from firsttoken.cli.usage import (
    UsageError,
    existing_file,
    from_config_error,
    parse_model_config,
    read_config_json,
)
from firsttoken.config import ImageConfig, VideoConfig, build_config, config_flags
from firsttoken.inputs.budget import image_budget, plan_image
from firsttoken.inputs.image import ImageInputError, probe_image
from firsttoken.inputs.video import plan_video_bytes
from firsttoken.inputs.video_container import sniff_container
from firsttoken.models.model_config import ImageProcessorConfig
from firsttoken.models.registry import read_json

SERVE_DEFAULT = ImageConfig()
# Only the geometry matters for counting: without --model, Qwen2-VL's 14-px patches merged 2x2 (28
# px per token).
QWEN2_VL_GEOMETRY = ImageProcessorConfig()


@dataclass(frozen=True)
class ImageRow:
    image: str
    original_size: tuple[int, int] | None  # (width, height) from the header
    resized_size: tuple[int, int] | None
    # visual tokens; the prompt also gets <|vision_start|> and <|vision_end|>
    num_tokens: int | None
    budget_tokens: int
    error: str | None = None
    # a tiling family's cut ("3x3 + thumbnail"), None for native resolution
    tiles: str | None = None


@dataclass(frozen=True)
class VideoRow:
    """A video as the server would plan it (its header and packets; no frame decoded)."""

    video: str
    original_size: tuple[int, int] | None  # (width, height) from the header
    resized_size: tuple[int, int] | None  # every sampled frame's
    duration_s: float | None  # source frames / source fps
    source_frames: int | None  # frames the container holds (its packets)
    num_frames: int | None  # frames sampled (an even count)
    # grids x tokens per grid; the prompt also gets the family's start/end tokens
    num_tokens: int | None
    budget_tokens: int
    error: str | None = None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tokens",
        help="visual tokens per image under a budget (headers only, no model)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "images",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="images and videos, told by their bytes",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint directory whose vision geometry to use (default: Qwen2-VL's, 28 px per token)",
    )
    p.add_argument(
        "--image-max-tokens",
        type=int,
        default=SERVE_DEFAULT.image_max_tokens,
        help=f"per-image budget (default: {SERVE_DEFAULT.image_max_tokens}, the server's; 16384 = no budget)",
    )
    p.add_argument(
        "--image-min-tokens",
        type=int,
        default=SERVE_DEFAULT.image_min_tokens,
        help=f"per-image floor (default: {SERVE_DEFAULT.image_min_tokens})",
    )
    p.add_argument(
        "--detail",
        choices=("auto", "low", "high"),
        default=None,
        help=f"as image_url.detail (low = {SERVE_DEFAULT.image_low_detail_tokens} tokens)",
    )
    p.add_argument(
        "--max-image-pixels", type=int, default=10**9, help="refuse headers declaring more pixels"
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    videos = p.add_argument_group("videos (serve's flags and defaults)")
    for f in config_flags(VideoConfig):
        # a request's limit; each file here is one video
        if f.field_name == "max_videos_per_request":
            continue
        videos.add_argument(f.flag, dest=f.dest, type=f.parse, default=f.default,
                            metavar="N" if f.parse is int else "X",
                            help=f"{f.help} (default: {f.shown})")
    p.set_defaults(handler=run)


def count_images(
    paths: list[Path],
    budget: ImageConfig,
    detail: str | None,
    vision: ImageProcessorConfig,
    max_image_pixels: int = 10**9,
) -> list[ImageRow]:
    tokens = image_budget(budget, detail, None, "image_url")
    rows = []
    for path in paths:
        try:
            header = probe_image(path.read_bytes(), max_image_pixels)
            plan = plan_image(header.width, header.height, tokens, budget.image_min_tokens, vision)
            rows.append(
                ImageRow(str(path), plan.original_size, plan.resized_size, plan.num_tokens, tokens,
                         tiles=plan.tiles)
            )
        except (OSError, ImageInputError) as err:
            rows.append(ImageRow(str(path), None, None, None, tokens, error=str(err)))
    return rows


def count_videos(
    paths: list[Path], limits: VideoConfig, vision: ImageProcessorConfig
) -> list[VideoRow]:
    rows = []
    for path in paths:
        try:
            header, _, plan = plan_video_bytes(path.read_bytes(), limits, vision, param=str(path))
            rows.append(
                VideoRow(
                    str(path),
                    plan.original_size,
                    plan.resized_size,
                    plan.source_frames / plan.source_fps,
                    plan.source_frames,
                    plan.num_frames,
                    plan.num_tokens,
                    plan.budget_tokens,
                )
            )
        except (OSError, ImageInputError) as err:  # VideoInputError is an ImageInputError
            rows.append(
                VideoRow(
                    str(path),
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    limits.video_max_tokens,
                    error=str(err),
                )
            )
    return rows


def is_video(path: Path) -> bool:
    """Told by the first bytes, as the server tells containers; an unreadable file is left to the
    image path."""
    try:
        with path.open("rb") as f:
            return sniff_container(f.read(16)) is not None
    except OSError:
        return False


def _size(s: tuple[int, int] | None) -> str:
    return f"{s[0]}x{s[1]}" if s else "-"


def format_video_table(rows: list[VideoRow]) -> str:
    width = max(len("video"), *(len(r.video) for r in rows))
    lines = [
        f"{'video':<{width}}  {'original':>11}  {'resized':>11}  {'seconds':>8}  {'frames':>6}  "
        f"{'sampled':>7}  {'tokens':>7}  {'budget':>7}"
    ]
    for r in rows:
        if r.error:
            lines.append(f"{r.video:<{width}}  error: {r.error}")
            continue
        lines.append(
            f"{r.video:<{width}}  {_size(r.original_size):>11}  {_size(r.resized_size):>11}  "
            f"{r.duration_s:>8.2f}  {r.source_frames:>6}  {r.num_frames:>7}  {r.num_tokens:>7}  "
            f"{r.budget_tokens:>7}"
        )
    return "\n".join(lines)


def format_table(rows: list[ImageRow]) -> str:
    """One line per image; a ``tiles`` column where the family tiles (the resized size is then the
    tile grid's)."""
    width = max(len("image"), *(len(r.image) for r in rows))
    tiled = any(r.tiles for r in rows)
    tiles_width = max([len("tiles"), *(len(r.tiles or "") for r in rows)])
    head = f"{'image':<{width}}  {'original':>11}  {'resized':>11}  "
    tiles_head = f"{'tiles':<{tiles_width}}  " if tiled else ""
    lines = [head + tiles_head + f"{'tokens':>7}  {'budget':>7}"]
    for r in rows:
        tokens = str(r.num_tokens) if r.num_tokens is not None else f"error: {r.error}"
        cut = f"{r.tiles or '-':<{tiles_width}}  " if tiled else ""
        lines.append(
            f"{r.image:<{width}}  {_size(r.original_size):>11}  {_size(r.resized_size):>11}  "
            f"{cut}{tokens:>7}  {r.budget_tokens:>7}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """A missing file or bad flag is a UsageError (nothing is counted); an unreadable image is its
    row's error."""
    for path in args.images:
        existing_file(None, path)
    vision = QWEN2_VL_GEOMETRY
    if args.model:
        model_dir = Path(args.model)
        vision = parse_model_config(
            "--model",
            args.model,
            read_config_json("--model", args.model),
            read_json(model_dir / "preprocessor_config.json"),
        ).image_processor
    try:
        budget = ImageConfig(image_max_tokens=args.image_max_tokens,
                             image_min_tokens=min(args.image_min_tokens, args.image_max_tokens))
    except ValueError as exc:
        raise from_config_error(exc, args) or UsageError(None, None, str(exc)) from None
    try:
        limits = build_config(vars(args), VideoConfig)
    except ValueError as exc:
        raise from_config_error(exc, args) or UsageError(None, None, str(exc)) from None
    video_paths = [path for path in args.images if is_video(path)]
    rows = count_images(
        [path for path in args.images if path not in video_paths],
        budget,
        args.detail,
        vision,
        args.max_image_pixels,
    )
    videos = count_videos(video_paths, limits, vision)
    total = sum(r.num_tokens or 0 for r in [*rows, *videos])
    if args.json:
        print(
            json.dumps(
                {
                    "images": [asdict(r) for r in rows],
                    "videos": [asdict(r) for r in videos],
                    "total_visual_tokens": total,
                },
                indent=2,
            )
        )
    else:
        tables = ([format_table(rows)] if rows else []) + (
            [format_video_table(videos)] if videos else []
        )
        print("\n\n".join(tables))
        print(f"total: {total} visual tokens (+ each image's or video's start and end tokens)")
    return 1 if any(r.error for r in [*rows, *videos]) else 0
