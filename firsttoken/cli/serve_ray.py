"""``firsttoken serve-ray``: firsttoken engine replicas on Ray Serve behind one OpenAI-compatible ingress.

    firsttoken serve-ray --model DIR --replicas 2
    firsttoken serve-ray --model DIR --short-replicas 3 --long-replicas 1 --routing affinity

Every ``firsttoken serve`` flag applies to each replica (engine, cache, scheduling, images) and to the ingress (HTTP
server, limits, API key); ``--host``/``--port`` are Serve's HTTP proxy. With ``RAY_ADDRESS`` set it joins that
cluster, else it starts a local one. The application is serving/app.py's; docs/scaling.md says how it routes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from dataclasses import fields

from firsttoken.cli.serve import add_config_flags, serve_config
from firsttoken.serving.app import FleetOptions

log = logging.getLogger("firsttoken.serve")

# (flag, FleetOptions field, type, metavar, help); the defaults are FleetOptions'
_FLEET_FLAGS: tuple[tuple[str, str, type, str, str], ...] = (
    ("--replicas", "replicas", int, "N", "engine replicas in the one pool"),
    ("--short-replicas", "short_replicas", int, "N",
     "engine replicas for prompts under --long-prompt-threshold tokens (with --long-replicas: two pools)"),
    ("--long-replicas", "long_replicas", int, "M",
     "engine replicas for prompts of --long-prompt-threshold tokens or more"),
    ("--routing", "routing", str, "POLICY",
     ("replica choice inside a pool: affinity (the replica that got the prompt's prefix, while it has room; else "
      "p2c), p2c (power of two choices on requests in flight and free KV blocks) or round-robin")),
    ("--max-queued-per-replica", "max_queued_per_replica", int, "N",
     ("requests one replica may hold waiting beyond its running batch (--max-num-seqs); when every replica of the "
      "pool holds that many, HTTP 429 with Retry-After (default: --max-queued-requests)")),
    ("--replica-cpus", "replica_cpus", float, "X", "Ray CPUs reserved per engine replica"),
    ("--ingress-cpus", "ingress_cpus", float, "X", "Ray CPUs reserved for the ingress"),
)  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve-ray", help="run engine replicas on Ray Serve behind one OpenAI-compatible "
                              "ingress", description=__doc__.split("\n\n")[0])
    fleet = p.add_argument_group("replicas on Ray Serve")
    defaults = {f.name: f.default for f in fields(FleetOptions)}
    for flag, name, kind, metavar, text in _FLEET_FLAGS:
        default = defaults[name]
        shown = "" if default is None else f" (default: {default})"
        fleet.add_argument(flag, dest=name, type=kind, default=default, metavar=metavar, help=text + shown)
    add_config_flags(p)
    p.set_defaults(handler=run)


def fleet_options(args: argparse.Namespace) -> FleetOptions:
    """FleetOptions from parsed flags; a bad value is a UsageError naming its flag."""
    from firsttoken.cli.usage import UsageError

    try:
        return FleetOptions(**{name: getattr(args, name) for _, name, _, _, _ in _FLEET_FLAGS})
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        flag = next((f for f, name, _, _, _ in _FLEET_FLAGS if name == field), None)
        raise UsageError(flag, getattr(args, field, None) if flag else None, str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Check the flags (cheap, before Ray starts), deploy, serve until interrupted."""
    import ray
    from ray import serve

    from firsttoken.api.logs import configure_logging
    from firsttoken.cli.serve_checks import check_serve_config, flag_error
    from firsttoken.cli.usage import UsageError
    from firsttoken.models.hub import ModelNotFound
    from firsttoken.serving.app import APP_NAME, build_application
    from firsttoken.serving.build import model_dir_of

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
    configure_logging(config.server.log_level, config.server.log_format)
    # RAY_ADDRESS: join that cluster; else a new local one (never a stale `ray start` left on this machine)
    ray.init(address=None if os.environ.get("RAY_ADDRESS") else "local")
    serve.start(http_options={"host": config.server.host, "port": config.server.port})
    log.info("deploying %s on Ray Serve: pools %s, routing %s", APP_NAME, options.pools(), options.routing)
    signal.signal(signal.SIGTERM, _exit_on_term)  # as Ctrl-C: stop the application and the local cluster
    try:
        serve.run(build_application(config, options), name=APP_NAME, route_prefix="/", blocking=True)
    except (KeyboardInterrupt, SystemExit):
        log.info("stopping %s", APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(0)
