"""``firsttoken serve-ray``: firsttoken engine replicas on Ray Serve behind one OpenAI-compatible
ingress.

    firsttoken serve-ray --model DIR --replicas 2
    firsttoken serve-ray --model DIR --replicas 1:4          # autoscaled on queued requests
    firsttoken serve-ray --model DIR --short-replicas 3 --long-replicas 1 --routing affinity

Every ``firsttoken serve`` flag applies to each replica (engine, cache, scheduling, images) and to
the ingress (HTTP server, limits, API key); ``--host``/``--port`` are Serve's HTTP proxy. With
``RAY_ADDRESS`` set it joins that cluster, else it starts a local one. The application is
serving/app.py's; docs/scaling.md says how it routes. A Serve config file names the same application
(``firsttoken.cli.serve_ray:app_builder``) with these flags as its ``args``; ``options_from_args``
reads them exactly as the command line does.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from firsttoken.cli.serve import add_config_flags, serve_config
from firsttoken.config import ServeConfig
from firsttoken.serving.options import FleetOptions, ReplicaCount

log = logging.getLogger("firsttoken.serve")

def _replica_count(text: str) -> ReplicaCount:
    try:
        return ReplicaCount.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# (flag, FleetOptions field, type, metavar, help); the defaults are FleetOptions'
_FLEET_FLAGS: tuple[tuple[str, str, type, str, str], ...] = (
    ("--replicas", "replicas", _replica_count, "N|MIN:MAX",
     "engine replicas in the one pool; MIN:MAX autoscales between them on queued requests"),
    ("--short-replicas", "short_replicas", _replica_count, "N|MIN:MAX",
     "engine replicas for prompts under --long-prompt-threshold tokens (with --long-replicas: two pools)"),
    ("--long-replicas", "long_replicas", _replica_count, "N|MIN:MAX",
     "engine replicas for prompts of --long-prompt-threshold tokens or more"),
    ("--routing", "routing", str, "POLICY",
     ("replica choice inside a pool: affinity (the replica that got the prompt's prefix, while it has room; else "
      "p2c), p2c (power of two choices on requests in flight and free KV blocks) or round-robin")),
    ("--max-queued-per-replica", "max_queued_per_replica", int, "N",
     ("requests one replica may hold waiting beyond its running batch (--max-num-seqs); when every replica of the "
      "pool holds that many, HTTP 429 with Retry-After (default: --max-queued-requests)")),
    ("--replica-cpus", "replica_cpus", float, "X", "Ray CPUs reserved per engine replica"),
    ("--ingress-cpus", "ingress_cpus", float, "X", "Ray CPUs reserved for the ingress"),
    ("--autoscale-target-queued", "autoscale_target_queued", float, "X",
     "an autoscaled pool adds replicas while more than X requests per replica wait in the engines' queues or at "
     "the router, and removes one when none wait and the rest can run what runs"),
    ("--upscale-delay", "upscale_delay_s", float, "SECONDS",
     "an autoscaled pool adds replicas once the need has lasted this long"),
    ("--downscale-delay", "downscale_delay_s", float, "SECONDS",
     "an autoscaled pool removes a replica once the spare capacity has lasted this long"),
    ("--autoscale-window", "autoscale_window_s", float, "SECONDS",
     "replicas' queue lengths are averaged over this window before the autoscaler reads them"),
)  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve-ray",
        help="run engine replicas on Ray Serve behind one OpenAI-compatible ingress",
        description=__doc__.split("\n\n")[0],
    )
    add_flags(p)
    p.set_defaults(handler=run)


def add_flags(p: argparse.ArgumentParser) -> None:
    """The fleet's flags, then every ``serve`` flag."""
    fleet = p.add_argument_group("replicas on Ray Serve")
    defaults = {f.name: f.default for f in fields(FleetOptions)}
    for flag, name, kind, metavar, text in _FLEET_FLAGS:
        default = defaults[name]
        shown = "" if default is None else f" (default: {default})"
        fleet.add_argument(
            flag, dest=name, type=kind, default=default, metavar=metavar, help=text + shown
        )
    add_config_flags(p)


def fleet_options(args: argparse.Namespace) -> FleetOptions:
    """FleetOptions from parsed flags; a bad value is a UsageError naming its flag."""
    from firsttoken.cli.usage import UsageError

    try:
        return FleetOptions(**{name: getattr(args, name) for _, name, _, _, _ in _FLEET_FLAGS})
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        flag = next((f for f, name, _, _, _ in _FLEET_FLAGS if name == field), None)
        raise UsageError(flag, getattr(args, field, None) if flag else None, str(exc)) from None


def options_from_args(values: Mapping[str, Any]) -> tuple[ServeConfig, FleetOptions]:
    """A Serve config file's ``args`` (flag names with or without dashes -> values; ``true`` for a
    switch) checked exactly as ``firsttoken serve-ray`` checks its command line. ValueError says
    which flag is wrong."""
    from firsttoken.cli.usage import UsageError

    argv: list[str] = []
    for name, value in values.items():
        flag = "--" + str(name).removeprefix("--").replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    parser = _ArgsParser(
        prog="firsttoken.cli.serve_ray:app_builder", add_help=False, allow_abbrev=False
    )
    add_flags(parser)
    try:
        return checked_options(parser.parse_args(argv))
    except UsageError as exc:
        raise ValueError(exc.line("serve-ray")) from None


def checked_options(args: argparse.Namespace) -> tuple[ServeConfig, FleetOptions]:
    """The config tree and the fleet's options from parsed flags, and the model directory and config
    checked (cheap: before Ray starts or a replica loads anything). A mistake is a UsageError naming
    its flag."""
    from firsttoken.assembly import model_dir_of
    from firsttoken.cli.serve_checks import check_serve_config, flag_error
    from firsttoken.cli.usage import UsageError
    from firsttoken.models.hub import ModelNotFound

    try:
        config = serve_config(args)
    except ValueError as exc:
        raise flag_error(exc, args) from None
    options = fleet_options(args)
    try:
        model_dir = model_dir_of(config)
    except ModelNotFound as exc:
        raise UsageError("--model", config.model, str(exc)) from None
    check_serve_config(config, model_dir)
    return config, options


def app_builder(args: Mapping[str, Any]):  # -> ray.serve.Application
    """The application for a Serve config file:
    ``import_path: firsttoken.cli.serve_ray:app_builder`` with ``args`` holding
    ``firsttoken serve-ray`` flags by name (``model: /models/x``, ``replicas: "1:4"``,
    ``max-num-seqs: 8``; ``true`` for a switch), checked exactly as on the command line
    (docs/scaling.md)."""
    from firsttoken.serving.app import build_application

    config, options = options_from_args(args)
    return build_application(config, options)


class _ArgsParser(argparse.ArgumentParser):
    # a config file's mistake is an exception for Serve to report, not an exit
    def error(self, message: str):
        raise ValueError(f"serve-ray args: {message}")


def run(args: argparse.Namespace) -> int:
    """Check the flags (cheap, before Ray starts), deploy, serve until interrupted."""
    import ray
    from ray import serve

    from firsttoken.api.logs import configure_logging
    from firsttoken.serving.app import APP_NAME, build_application

    config, options = checked_options(args)
    configure_logging(config.server.log_level, config.server.log_format)
    # RAY_ADDRESS: join that cluster; else a new local one (never a stale `ray start` left on this
    # machine)
    ray.init(address=None if os.environ.get("RAY_ADDRESS") else "local")
    serve.start(http_options={"host": config.server.host, "port": config.server.port})
    log.info(
        "deploying %s on Ray Serve: pools %s, routing %s",
        APP_NAME,
        options.pools(),
        options.routing,
    )
    # as Ctrl-C: stop the application and the local cluster
    signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        serve.run(
            build_application(config, options), name=APP_NAME, route_prefix="/", blocking=True
        )
    except (KeyboardInterrupt, SystemExit):
        log.info("stopping %s", APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(0)
