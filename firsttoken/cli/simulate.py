"""``firsttoken simulate``: how many replicas, and which split between short and long pools, keep
P99 TTFT under a target at a request rate. A discrete-event simulation of firsttoken's own scheduler
per replica, priced by a step-cost profile measured on the deployment's machine (tools/simulate.py;
validation in docs/scaling.md).

    firsttoken simulate --model DIR --profile http://replica:8000 --rate 3 --replicas 1,2,4,8
    firsttoken simulate --model DIR --profile profile.json --rate 3 --target-p99 text=1.5,image=12 --search-pools
    firsttoken simulate --model DIR --profile profile.json --trace bench.json        # replay a measured run
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from firsttoken.cli.usage import UsageError, existing_dir, existing_file, first_line
from firsttoken.config import ImageConfig

DEFAULT_TARGETS = "text=1.5,image=12"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="fleet planning: replicas x lanes x routing, simulated",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--model", required=True, help="checkpoint directory (image geometry, vision-tower units)"
    )
    p.add_argument("--profile", required=True,
                   help="a replica's step-cost profile: a running server's URL (its /stats), a saved /stats JSON, "
                        "or a file written by --save-profile")
    p.add_argument(
        "--save-profile", default=None, help="write the profile used here to this JSON file"
    )
    p.add_argument(
        "--serve-args",
        default="",
        help="the replicas' serve flags, quoted, e.g. \"--scheduling fcfs --kv-cache-memory 8GiB\" "
        "(default: serve's defaults; KV blocks from the profile's server)",
    )
    _workload_args(p)
    _fleet_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json", default=None, help="write every simulated configuration's summary here"
    )
    p.set_defaults(handler=run)


def _workload_args(p: argparse.ArgumentParser) -> None:
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--rate", type=float, default=None, help="seed-mix Poisson arrivals, requests/s"
    )
    load.add_argument(
        "--trace",
        default=None,
        help="replay a firsttoken bench --json run (arrivals, classes, tokens)",
    )
    p.add_argument("--num-requests", type=int, default=1000, help="with --rate (default: 1000)")
    p.add_argument(
        "--output-tokens", type=int, default=32, help="with --rate: tokens generated per request"
    )
    p.add_argument(
        "--text-tokens",
        type=int,
        default=800,
        help="with --rate: text tokens per prompt (default 800)",
    )
    p.add_argument(
        "--image-size", default="1024x1024", help="WIDTHxHEIGHT of every image (default 1024x1024)"
    )
    p.add_argument("--image-max-tokens", type=int, default=ImageConfig().image_max_tokens,
                   help="the replicas' per-image budget (default: serve's)")


def _fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replicas", default="1", help="replica counts to simulate, e.g. 1,2,4,8 (default 1)"
    )
    p.add_argument(
        "--pools",
        default=None,
        help="SHORT,LONG: replicas in the short and long lane pools "
        "(default: one pool of all replicas)",
    )
    p.add_argument(
        "--search-pools",
        action="store_true",
        help="at each replica count, also try every short/long split and report the best",
    )
    p.add_argument("--routing", default="least-loaded",
                   help="round-robin | least-loaded | p2c | least-work (default least-loaded)")
    p.add_argument(
        "--target-p99",
        default=None,
        help=f"TTFT P99 objectives in seconds per class, e.g. {DEFAULT_TARGETS}: report the fewest "
        "replicas (and split) that meet them",
    )
    p.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="what-if: replicas this many times faster than the profiled one (divides every "
        "coefficient; 1 = as measured)",
    )
    p.add_argument(
        "--step-noise",
        type=float,
        default=0.0,
        help="lognormal sigma of step-time noise (default 0)",
    )


def run(args: argparse.Namespace) -> int:
    from firsttoken.models.registry import load_model_config
    from firsttoken.tools import simulate as sim

    model_dir = existing_dir("--model", args.model)
    try:
        model = load_model_config(model_dir)
    except (ValueError, KeyError, OSError) as exc:
        raise UsageError(
            "--model", args.model, f"cannot read the checkpoint's config: {first_line(str(exc))}"
        )
    scheduler, cache, kv_blocks = _serve_options(args.serve_args, model)
    profile = _profile(args.profile, scheduler)
    profile = sim.replace(profile, cache=cache, num_kv_blocks=kv_blocks or profile.num_kv_blocks)
    if args.speedup != 1.0:
        if args.speedup <= 0:
            raise UsageError("--speedup", args.speedup, "must be > 0")
        profile = sim.replace(
            profile,
            coefficients={k: v / args.speedup for k, v in profile.coefficients.items()},
            preprocess_s={k: v / args.speedup for k, v in profile.preprocess_s.items()},
        )
    if args.save_profile:
        Path(args.save_profile).write_text(json.dumps(profile.to_dict(), indent=1))
    size = _size(args.image_size)
    if args.trace:
        records = json.loads(existing_file("--trace", args.trace).read_text())
        records = records.get("records", records) if isinstance(records, dict) else records
        workload = sim.from_trace(records, model, size, args.image_max_tokens)
    else:
        if args.rate is None or args.rate <= 0:
            raise UsageError(
                "--rate", args.rate, "give a request rate > 0 (requests/s), or --trace FILE"
            )
        workload = sim.seed_mix(
            model,
            args.rate,
            args.num_requests,
            args.seed,
            text_tokens=args.text_tokens,
            image_size=size,
            image_budget_tokens=args.image_max_tokens,
            output_tokens=args.output_tokens,
        )
    counts = _ints("--replicas", args.replicas)
    targets = _targets(args.target_p99) if args.target_p99 else None
    rows = []
    priced: dict[str, float] = {}
    for n in counts:
        for pools in _splits(n, args.pools, args.search_pools):
            router = sim.Router(args.routing, pools, scheduler.long_prompt_threshold, args.seed)
            result = sim.simulate(workload, [profile] * n, router, args.step_noise, args.seed)
            priced = {k: max(v, priced.get(k, 0.0)) for k, v in result.max_terms.items()}
            summary = result.summary()
            rows.append({"replicas": n, "pools": pools and {k: len(v) for k, v in pools.items()},
                         "routing": args.routing, **summary,
                         "meets": None if targets is None else _meets(summary, targets)})
    warnings = profile.extrapolations(priced)
    for w in warnings:  # before the table: its numbers rest on these prices
        print(f"warning: {w}")
    if warnings:
        print("(profile a server that has served requests like these: its /stats then covers them)")
    _print(rows, targets, workload, args)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"profile": profile.to_dict(), "rows": rows, "warnings": warnings}, indent=1)
        )
    return 0


def _serve_options(serve_args: str, model: Any) -> tuple[Any, Any, int | None]:
    """The replicas' scheduler and cache config from serve flags; KV blocks when --kv-cache-memory
    is given."""
    from firsttoken.cli.serve import parse_serve_flags, serve_config
    from firsttoken.engine.resolve import plan_kv_capacity

    argv = shlex.split(serve_args)
    try:
        config = serve_config(parse_serve_flags(argv))
    except SystemExit:
        raise UsageError(
            "--serve-args", serve_args, "not flags `firsttoken serve` accepts (see serve --help)"
        )
    blocks = (
        plan_kv_capacity(model, config.engine).num_blocks if "--kv-cache-memory" in argv else None
    )
    return config.engine.scheduler, config.engine.cache, blocks


def _profile(source: str, scheduler: Any) -> Any:
    from firsttoken.tools import simulate as sim

    if source.startswith(("http://", "https://")):
        import httpx

        try:
            stats = httpx.get(source.rstrip("/") + "/stats", timeout=10).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise UsageError(
                "--profile", source, f"could not read its /stats: {first_line(str(exc))}"
            )
    else:
        stats = json.loads(existing_file("--profile", source).read_text())
    try:
        if "cost_model" in stats:
            return sim.Profile.from_stats(stats, scheduler)
        return sim.Profile(
            dict(stats["coefficients"]),
            scheduler,
            num_kv_blocks=int(stats["num_kv_blocks"]),
            max_model_len=int(stats.get("max_model_len", 32768)),
            encoder_capacity_tokens=int(stats.get("encoder_capacity_tokens", 65536)),
            preprocess_s=dict(stats.get("preprocess_s", {})),
            coverage=dict(stats.get("coverage", {})),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError("--profile", source, f"not a profile: {first_line(str(exc))}")


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
        if w > 0 and h > 0:
            return w, h
    except ValueError:
        pass
    raise UsageError("--image-size", text, "expected WIDTHxHEIGHT, e.g. 1024x1024")


def _ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(flag, text, "expected replica counts >= 1, e.g. 1,2,4")
    return values


def _targets(text: str) -> dict[str, float]:
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise UsageError(
                "--target-p99", text, f"expected CLASS=SECONDS pairs, e.g. {DEFAULT_TARGETS}"
            )
    if not set(out) <= {"text", "image"} or not out:
        raise UsageError(
            "--target-p99", text, f"classes are text and image, e.g. {DEFAULT_TARGETS}"
        )
    return out


def _splits(n: int, pools: str | None, search: bool) -> list[dict[str, list[int]] | None]:
    if pools:
        try:
            s, long = (int(x) for x in pools.split(","))
        except ValueError:
            raise UsageError("--pools", pools, "expected SHORT,LONG replica counts, e.g. 1,3")
        if s < 1 or long < 1:
            raise UsageError("--pools", pools, "each pool needs at least one replica")
        if s + long != n:
            raise UsageError(
                "--pools", pools, f"the pools add up to {s + long}, not the {n} replicas simulated"
            )
        return [{"short": list(range(s)), "long": list(range(s, n))}]
    options: list[dict[str, list[int]] | None] = [None]
    if search and n > 1:
        options += [{"short": list(range(s)), "long": list(range(s, n))} for s in range(1, n)]
    return options


def _meets(summary: dict, targets: dict[str, float]) -> bool:
    for cls, c in summary["classes"].items():
        limit = targets.get("text" if cls in ("text", "0") else "image")
        if limit is not None and (c["p99"] is None or c["p99"] > limit or c["refused"]):
            return False
    return True


def _print(
    rows: list[dict], targets: dict[str, float] | None, workload: list, args: argparse.Namespace
) -> None:
    source = f"trace {args.trace}" if args.trace else f"seed mix at {args.rate:g} requests/s"
    print(f"{len(workload)} requests, {source}; routing {args.routing}; speedup {args.speedup:g}; "
          f"TTFT seconds (nearest-rank), n per class")
    classes = sorted({c for r in rows for c in r["classes"]})
    head = (
        "replicas pools     "
        + "".join(f"| {c:>5s}  n    P50    P99 " for c in classes)
        + "| busy  meets"
    )
    print(head)
    for r in rows:
        pools = f"{r['pools']['short']}s+{r['pools']['long']}l" if r["pools"] else "one"
        cells = ""
        for c in classes:
            x = r["classes"].get(c)
            cells += (f"| {'':>5s}{x['n']:3d} {x['p50']:6.2f} {x['p99']:6.2f} " if x and x["n"]
                      else f"| {'':>5s}  - {'-':>6s} {'-':>6s} ")
        busy = max(r["utilization"]) if r["utilization"] else 0
        meets = "" if r["meets"] is None else ("yes" if r["meets"] else "no")
        print(f"{r['replicas']:8d} {pools:9s} {cells}| {busy:4.0%}  {meets}")
    if targets is not None:
        ok = [r for r in rows if r["meets"]]
        if ok:
            best = min(
                ok, key=lambda r: (r["replicas"], max(c["p99"] or 0 for c in r["classes"].values()))
            )
            pools = (
                f"{best['pools']['short']} short + {best['pools']['long']} long"
                if best["pools"]
                else "one pool"
            )
            print(f"fewest replicas meeting P99 {args.target_p99}: {best['replicas']} ({pools})")
        else:
            print(f"no configuration simulated meets P99 {args.target_p99}: try more replicas")
