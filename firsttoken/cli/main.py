"""The ``firsttoken`` command: one argparse subcommand per module in COMMANDS.

Contract for a command module: ``add_parser(subparsers)`` registers its subparser and sets
``handler=<callable(argparse.Namespace) -> int>`` as a default; the handler's return value is the
process exit status. Add a subcommand by writing ``firsttoken/cli/<name>.py`` and listing it here.

Errors are said once, here: a handler raises ``cli.usage.UsageError`` for what the user can fix (one
line, exit 2); anything else escaping a handler is one line and exit 1, its traceback only under
``--debug`` (or ``serve --log-level debug``).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType

from firsttoken.cli import bench as bench_command
from firsttoken.cli import doctor as doctor_command
from firsttoken.cli import make_model, serve, serve_ray
from firsttoken.cli import plan as plan_command
from firsttoken.cli import regress as regress_command
from firsttoken.cli import simulate as simulate_command
from firsttoken.cli import tokens as tokens_command
from firsttoken.cli.usage import (
    EXIT_FAILURE,
    EXIT_USAGE,
    OneLineParser,
    UsageError,
    first_line,
)

COMMANDS: tuple[ModuleType, ...] = (
    serve,
    serve_ray,
    make_model,
    plan_command,
    bench_command,
    tokens_command,
    regress_command,
    doctor_command,
    simulate_command,
)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="firsttoken",
                           description="a multimodal LLM inference server with a fast first token, and its tools")
    parser.add_argument("--debug", action="store_true",
                        help="print the Python traceback when a command fails unexpectedly")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, but an unknown flag is reported by its command's parser
    (``see firsttoken serve --help``)."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        commands = next(
            a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
        ).choices
        commands[args.command].error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    try:
        return int(args.handler(args))
    except UsageError as exc:
        print(exc.line(args.command), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"firsttoken {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001  (the one place an unexpected failure becomes a readable line)
        if _wants_traceback(args):
            traceback.print_exc()
        detail = first_line(str(exc))
        hint = ("run with --log-level debug for the traceback" if hasattr(args, "log_level")
                else f"run `firsttoken --debug {args.command} ...` for the traceback")
        print(f"firsttoken {args.command}: unexpected {type(exc).__name__}"
              f"{': ' + detail if detail else ''} ({'traceback above' if _wants_traceback(args) else hint})",
              file=sys.stderr)
        return EXIT_FAILURE


def _wants_traceback(args: argparse.Namespace) -> bool:
    return bool(args.debug) or str(getattr(args, "log_level", "")).lower() == "debug"


if __name__ == "__main__":
    raise SystemExit(main())
