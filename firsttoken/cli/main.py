"""The ``firsttoken`` command: one argparse subcommand per module in COMMANDS.

Contract for a command module: ``add_parser(subparsers)`` registers its subparser and sets
``handler=<callable(argparse.Namespace) -> int>`` as a default; the handler's return value is the
process exit status. Add a subcommand by writing ``firsttoken/cli/<name>.py`` and listing it here.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from types import ModuleType

from firsttoken.cli import make_model, serve
from firsttoken.cli import bench as bench_command
from firsttoken.cli import doctor as doctor_command
from firsttoken.cli import plan as plan_command
from firsttoken.cli import regress as regress_command
from firsttoken.cli import tokens as tokens_command

COMMANDS: tuple[ModuleType, ...] = (serve, make_model, plan_command, bench_command, tokens_command, regress_command,
                                     doctor_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="firsttoken", description="Qwen2-VL inference server tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
