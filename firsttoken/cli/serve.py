"""``firsttoken serve``: load a checkpoint (or build the demo one), start the engine thread, serve
HTTP.

The flags are generated from the config tree (firsttoken/config.py: each leaf field's name, type,
help and default), so ``firsttoken serve --help`` lists every option exactly once, with the default
the server uses.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from firsttoken.assembly import model_dir_of, served_name_of
from firsttoken.cli.usage import OneLineParser
from firsttoken.config import ServeConfig, config_flags, config_from_options
from firsttoken.units import parse_bytes

__all__ = [
    "add_config_flags",
    "add_parser",
    "build_server",
    "model_dir_of",
    "parse_serve_flags",
    "run",
    "serve_config",
    "served_name_of",
]

log = logging.getLogger("firsttoken.serve")


def _argparse_type(parse: Any) -> Any:
    """Built-in types as argparse knows them ('invalid int value'); our parsers keep their own
    message."""
    if parse in (int, float, str, Path):
        return parse

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="Serve a Qwen-VL checkpoint over an OpenAI-compatible HTTP API.",
    )
    add_config_flags(p)
    p.set_defaults(handler=run)


def parse_serve_flags(argv: Sequence[str]) -> argparse.Namespace:
    """``firsttoken serve``'s flags alone, parsed as ``serve`` parses them (another command planning
    for a server, ``simulate --serve-args``, reads them so). A bad flag exits as argparse does
    (SystemExit)."""
    parser = OneLineParser(prog="firsttoken serve")
    add_config_flags(parser)
    return parser.parse_args(argv)


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """Every option of the config tree as a flag, grouped by section (``serve`` and ``serve-ray``
    share them)."""
    groups: dict[tuple[str, ...], argparse._ArgumentGroup] = {}
    for f in config_flags():
        section = f.path[:-1]
        if section not in groups:
            groups[section] = p.add_argument_group(GROUP_TITLES.get(section, "model"))
        group = groups[section]
        if f.parse is None:  # a switch
            group.add_argument(f.flag, dest=f.dest, action="store_true", help=f.help)
        else:
            group.add_argument(
                f.flag,
                dest=f.dest,
                type=_argparse_type(f.parse),
                default=f.default,
                metavar=_metavar(f),
                help=f.help if "default:" in f.help else f"{f.help} (default: {f.shown})",
            )


GROUP_TITLES = {
    (): "model",
    ("engine",): "engine",
    ("engine", "cache"): "KV cache and encoder cache",
    ("engine", "scheduler"): "scheduling (step budget, lanes, admission)",
    ("images",): "images and input limits",
    ("videos",): "videos (budget and limits)",
    ("server",): "HTTP server, logs and metrics",
}


def _metavar(f: Any) -> str:
    # a Literal field: its values, as argparse shows choices (checked by the config tree)
    if f.choices:
        return "{" + ",".join(f.choices) + "}"
    if f.parse is parse_bytes:
        return "SIZE"
    if f.parse is int:
        return "N"
    if f.parse is float:
        return "SECONDS" if f.dest.endswith(("timeout", "window")) else "X"
    if f.parse is Path:
        return "PATH"
    return f.dest.rsplit("_", 1)[-1].upper()


def serve_config(args: argparse.Namespace | None = None, **overrides: Any) -> ServeConfig:
    """The config tree from parsed flags and/or overrides by flag dest
    (config.config_from_options)."""
    return config_from_options(vars(args) if args is not None else None, **overrides)


def build_server(
    config: ServeConfig,
    fault_hook: Any = None,
    media_network: Any = None,
    warm_grammars: bool = False,
):
    """Everything `serve` starts, minus uvicorn: (app, async_engine). Tests use it too; `fault_hook`
    is the runner's test seam (see runner.model_runner.FaultHook), None in production;
    `media_network` replaces how remote images reach the network (inputs.media.MediaNetwork:
    resolver, fetcher), None in production; ``warm_grammars``: build the output-grammar compiler's
    vocabulary before serving (`serve` does; without it the first constrained request builds it)."""
    from firsttoken.api.observability import observability_from_config
    from firsttoken.api.server import build_app
    from firsttoken.api.settings import ServedModel
    from firsttoken.assembly import assemble
    from firsttoken.engine.async_engine import AsyncEngine
    from firsttoken.inputs.processor import load_tokenizer

    model_dir = model_dir_of(config)
    tokenizer = load_tokenizer(model_dir, config.chat_template)
    observability = observability_from_config(config.server, tokenizer)
    engine, processor = assemble(config, model_dir, tokenizer, observability.recorder, fault_hook,
                                 media_network)
    async_engine = AsyncEngine(engine, on_abort=observability.recorder.on_aborted)
    if warm_grammars:
        start = time.monotonic()
        processor.warm_grammars()
        log.info(
            "output grammars ready in %.1f s (the vocabulary's token trie)",
            time.monotonic() - start,
        )
    served = ServedModel(served_name_of(config, model_dir), engine.max_model_len, str(model_dir),
                         engine.resolved.as_dict())
    return build_app(async_engine, processor, served, config.server, observability), async_engine


def run(args: argparse.Namespace) -> int:
    """Check the flags (cheap, before any weight is read), load, serve until SIGTERM. A
    misconfiguration is a cli.usage.UsageError: one line naming the flag, exit 2 (cli.main prints
    it)."""
    import torch
    import uvicorn

    from firsttoken.api.http_protocol import LingerBounds, header_timeout_protocol
    from firsttoken.api.logs import configure_logging
    from firsttoken.api.shutdown import DrainingServer
    from firsttoken.cli.serve_checks import check_serve_config, flag_error
    from firsttoken.cli.usage import UsageError
    from firsttoken.models.hub import ModelNotFound

    try:
        config = serve_config(args)
    except ValueError as exc:
        raise flag_error(exc, args) from None
    try:
        model_dir = model_dir_of(config)
    except ModelNotFound as exc:
        raise UsageError("--model", config.model, str(exc)) from None
    check_serve_config(config, model_dir)
    server_cfg = config.server
    configure_logging(server_cfg.log_level, server_cfg.log_format)
    if config.engine.num_threads:
        torch.set_num_threads(config.engine.num_threads)
    try:
        app, async_engine = build_server(config, warm_grammars=True)
    # a flag the cheap checks could not judge (it needed the tokenizer or the model)
    except ValueError as exc:
        raise flag_error(exc, args) from None
    async_engine.start()
    log.info("serving on http://%s:%d", server_cfg.host, server_cfg.port)
    uv = uvicorn.Config(
        app,
        host=server_cfg.host,
        port=server_cfg.port,
        log_level=server_cfg.log_level.lower(),
        http=header_timeout_protocol(
            server_cfg.request_header_timeout_s,
            LingerBounds.for_body_limit(server_cfg.max_request_bytes),
        ),
        # after our own drain: cancel (abort) what is left
        timeout_graceful_shutdown=1,
        # uvicorn's loggers propagate to ours (text or json, with request ids)
        log_config=None,
    )
    server = DrainingServer(uv, async_engine, app.state.slots, server_cfg.shutdown_timeout_s)
    try:
        server.run()
    finally:
        async_engine.shutdown()
    return 0
