"""``firsttoken tokens IMAGE...``: what each image costs in visual tokens under a budget, from headers only.

The same plan the server makes (``inputs/budget.plan_image``): nothing is decoded and no model runs, so it answers
for a 50-megapixel photo in milliseconds. ``--image-max-tokens 16384`` is Qwen2-VL's reference processor default
(no budget to speak of); the server's default cap is 1280.
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
from firsttoken.config import ImageConfig
from firsttoken.inputs.budget import image_budget, plan_image
from firsttoken.inputs.image import ImageInputError, probe_image
from firsttoken.models.config import ImageProcessorConfig
from firsttoken.models.registry import read_json

SERVE_DEFAULT = ImageConfig()
# Only the geometry matters for counting: without --model, Qwen2-VL's 14-px patches merged 2x2 (28 px per token).
QWEN2_VL_GEOMETRY = ImageProcessorConfig()


@dataclass(frozen=True)
class ImageRow:
    image: str
    original_size: tuple[int, int] | None  # (width, height) from the header
    resized_size: tuple[int, int] | None
    num_tokens: int | None  # visual tokens; the prompt also gets <|vision_start|> and <|vision_end|>
    budget_tokens: int
    error: str | None = None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tokens",
        help="visual tokens per image under a budget (headers only, no model)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("images", nargs="+", type=Path, metavar="IMAGE")
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
    p.add_argument("--max-image-pixels", type=int, default=10**9, help="refuse headers declaring more pixels")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.set_defaults(handler=run)


def count_images(
    paths: list[Path], budget: ImageConfig, detail: str | None, vision: ImageProcessorConfig, max_image_pixels: int = 10**9
) -> list[ImageRow]:
    tokens = image_budget(budget, detail, None, "image_url")
    rows = []
    for path in paths:
        try:
            header = probe_image(path.read_bytes(), max_image_pixels)
            plan = plan_image(header.width, header.height, tokens, budget.image_min_tokens, vision)
            rows.append(ImageRow(str(path), plan.original_size, plan.resized_size, plan.num_tokens, tokens))
        except (OSError, ImageInputError) as err:
            rows.append(ImageRow(str(path), None, None, None, tokens, error=str(err)))
    return rows


def format_table(rows: list[ImageRow]) -> str:
    def size(s: tuple[int, int] | None) -> str:
        return f"{s[0]}x{s[1]}" if s else "-"

    width = max(len("image"), *(len(r.image) for r in rows))
    lines = [f"{'image':<{width}}  {'original':>11}  {'resized':>11}  {'tokens':>7}  {'budget':>7}"]
    for r in rows:
        tokens = str(r.num_tokens) if r.num_tokens is not None else f"error: {r.error}"
        lines.append(
            f"{r.image:<{width}}  {size(r.original_size):>11}  {size(r.resized_size):>11}  "
            f"{tokens:>7}  {r.budget_tokens:>7}"
        )
    total = sum(r.num_tokens or 0 for r in rows)
    lines.append(f"total: {total} visual tokens (+2 per image for <|vision_start|><|vision_end|>)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """A missing file or bad flag is a UsageError (nothing is counted); an unreadable image is its row's error."""
    for path in args.images:
        existing_file(None, path)
    vision = QWEN2_VL_GEOMETRY
    if args.model:
        model_dir = Path(args.model)
        vision = parse_model_config("--model", args.model, read_config_json("--model", args.model),
                                    read_json(model_dir / "preprocessor_config.json")).image_processor
    try:
        budget = ImageConfig(image_max_tokens=args.image_max_tokens,
                             image_min_tokens=min(args.image_min_tokens, args.image_max_tokens))
    except ValueError as exc:
        raise from_config_error(exc, args) or UsageError(None, None, str(exc)) from None
    rows = count_images(args.images, budget, args.detail, vision, args.max_image_pixels)
    if args.json:
        total = sum(r.num_tokens or 0 for r in rows)
        print(json.dumps({"images": [asdict(r) for r in rows], "total_visual_tokens": total}, indent=2))
    else:
        print(format_table(rows))
    return 1 if any(r.error for r in rows) else 0
