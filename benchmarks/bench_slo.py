"""Issue 15's benchmark: every class's TTFT under the seed's mix, at loads calibrated to this machine, side by side.

    python benchmarks/bench_slo.py [--model DIR] [--utilizations 0.6,0.8] [--overload 1.3] [--num-requests 60]
                                   [--json out.json] [--plot-dir DIR] [--before OTHER_CHECKOUT]
                                   [--mix text=0.5,1img=0.2,3img=0.1,video=0.2 --video-seconds 10]
                                   [--image-size 1024x1024]

The seed's mix (50% text ~800 tokens, 30% one 1024x1024 image, 20% three, each beside ~800 tokens of text), seeded
Poisson arrivals. The rate is calibrated, never fixed: each class's unloaded service time (mean e2e of requests sent
alone) is measured once on a default server, capacity = 1 / sum(share x service), and every run offers U x capacity.
Each configuration gets its own `firsttoken serve` process and the same arrivals (same seed, same rate).

At each U in --utilizations (targets from issue 15, default flags):
    fcfs           --scheduling fcfs (the seed's starting point)
    lanes-tokens   --step-time-target off (lanes budgeted in tokens: the previous default)
    default        no flags (time-bounded steps from the online step-cost model)
  text P99 <= 2.5x its unloaded TTFT; one-image and three-image P99 <= 1.05x fcfs's; TTFT prediction
  |predicted - actual| / actual: median <= 15%, P90 <= 35% per class.
At U = --overload, with objectives derived from the unloaded TTFTs (text: --text-slo-x x unloaded text TTFT; image:
--image-slo-x x unloaded three-image TTFT):
    fcfs, lanes (default flags, no objective), slo (default + --ttft-slo)
  admitted P99 <= 1.2x its class objective; refusals are 429 with Retry-After; goodput (requests meeting their
  objective per second of arrivals) >= 1.5x fcfs's and lanes'; the mean visual-token budget applied.

Prints a table per load with n beside every percentile, the targets as met / MISSED, the machine (CPU flags), and
writes the raw records (--json) and a TTFT-over-time plot per load (--plot-dir).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import checkout, small_model, start_server, stop_server  # noqa: E402
from machine import machine_info  # noqa: E402

from firsttoken.config import ImageConfig  # noqa: E402
from firsttoken.tools.bench import BenchConfig, parse_size, run_bench  # noqa: E402
from firsttoken.tools.bench.runner import measure_calibration  # noqa: E402

CLASSES = ("text", "1img", "3img")  # the classes of --mix (main sets them; the seed's by default)
SEED_MIX = "text=0.5,1img=0.3,3img=0.2"
WORDS_FOR_800_TOKENS = 512  # bench's English words -> ~800 tokens of the checkpoint's tokenizer (see bench_lanes)
LOADED = {"fcfs": ["--scheduling", "fcfs"], "lanes-tokens": ["--step-time-target", "off"], "default": [],
          "no-bias": ["--ttft-bias-step", "0"],  # no-bias: the predicted TTFT without its learnt correction
          "least-work": ["--long-order", "least-work"],  # the long lane's order before the deadline order
          "mkl": ["--cpu-kernels", "off"],  # decode steps' products by MKL, as before the few-rows kernels
          "itl-auto": ["--itl-target", "auto"]}  # a pace for streaming answers (default: off)
LOWERED = re.compile(r"lowered from (\d+) to (\d+) per image")


def config(base: str, args: argparse.Namespace, **kw) -> BenchConfig:
    kw.setdefault("seed", args.seed)
    kw.setdefault("mix", parse_mix(args.mix))
    return BenchConfig(url=base, model="m", workload="seed-mix", text_tokens=WORDS_FOR_800_TOKENS,
                       image_text_tokens=WORDS_FOR_800_TOKENS, output_tokens=args.output_tokens, progress=False,
                       video_seconds=args.video_seconds, image_size=args.image_size, **kw)


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    return tuple((name.strip(), float(w)) for name, _, w in (part.partition("=") for part in text.split(",")))


def visual_classes() -> tuple[str, ...]:
    return tuple(c for c in CLASSES if c != "text")


def nearest_rank(values: list[float], q: float) -> float | None:
    v = sorted(values)
    return v[max(1, math.ceil(q / 100 * len(v))) - 1] if v else None


def calibrate(model: str, args: argparse.Namespace) -> dict:
    """Unloaded service time (e2e) and TTFT per class, on a default server, each class's requests sent alone."""
    proc, base = start_server(model, [])
    try:
        return calibrate_on(base, args)
    finally:
        stop_server(proc)


def calibrate_on(base: str, args: argparse.Namespace) -> dict:
    """``calibrate`` against the server at ``base``."""
    cal = measure_calibration(replace(config(base, args), utilization=1.0, calibration_requests=args.unloaded_requests))
    ttft = {}
    for cls in CLASSES:
        r = run_bench(config(base, args, mix=((cls, 1.0),), concurrency=1, num_requests=args.unloaded_requests,
                             warmup=1, seed=args.seed + 7))
        ttft[cls] = nearest_rank([x.ttft_s for x in r.records if x.ok and not x.warmup], 50)
    return {"service_s": cal.service_s, "capacity_rps": cal.capacity_rps, "unloaded_ttft_s": ttft,
            "num_probes": args.unloaded_requests}


def run(model: str, flags: list[str], rate: float, args: argparse.Namespace) -> dict:
    proc, base = start_server(model, flags)
    try:
        return run_on(base, flags, rate, args)
    finally:
        stop_server(proc)


def run_on(base: str, flags: list[str], rate: float, args: argparse.Namespace) -> dict:
    """One loaded run against the server at ``base`` (started with ``flags``): one request of each class first
    (seeds apart from the measured run: nothing it sends is cached), then the seeded arrivals at ``rate``."""
    for cls in CLASSES:
        run_bench(config(base, args, mix=((cls, 1.0),), concurrency=1, num_requests=1, seed=args.seed + 11))
    started = time.time()
    report = run_bench(config(base, args, rate=rate, num_requests=args.num_requests))
    records = [r.to_dict() for r in report.records]
    # what the server ended with: its step-cost model, the step-time bound in force, engine totals
    with urllib.request.urlopen(f"{base}/stats", timeout=30) as resp:
        stats = json.load(resp)
    server = {"cost_model": stats.get("cost_model"), "totals": stats.get("totals")}
    return {"flags": flags, "rate": rate, "started_unix_s": started, "records": records, "server": server}


def summarize(result: dict, slo: dict[str, float] | None, image_max_tokens: int) -> dict:
    records = [r for r in result["records"] if not r["warmup"]]
    span = max(r["start_s"] for r in records) - min(r["start_s"] for r in records)
    out: dict = {"arrival_span_s": span}
    met_total = 0
    for cls in CLASSES:
        rs = [r for r in records if r["cls"] == cls]
        ok = [r for r in rs if r["error"] is None]
        ttft = [r["ttft_s"] for r in ok]
        errors = []
        for r in ok:
            t = r["server_timings"] or {}
            if t.get("predicted_ttft_s") is not None and t.get("ttft_s"):
                errors.append(abs(t["predicted_ttft_s"] - t["ttft_s"]) / t["ttft_s"])
        refused = [r for r in rs if r["status"] == 429]
        budgets = []
        for r in ok:
            if r["num_images"]:
                m = LOWERED.search((r["server_timings"] or {}).get("image_budget", ""))
                budgets.append(int(m.group(2)) if m else image_max_tokens)
        c = {"sent": len(rs), "n": len(ok), "p50": nearest_rank(ttft, 50), "p95": nearest_rank(ttft, 95),
             "p99": nearest_rank(ttft, 99), "refused_429": len(refused),
             "refused_with_retry_after": sum(r["retry_after_s"] is not None for r in refused),
             "other_errors": len(rs) - len(ok) - len(refused),
             "prediction_n": len(errors), "prediction_err_p50": nearest_rank(errors, 50),
             "prediction_err_p90": nearest_rank(errors, 90),
             "degraded": sum(bool((r["server_timings"] or {}).get("image_budget")) for r in ok),
             **itl_summary([g for r in ok for g in r.get("itl_s") or []]),
             "mean_image_budget": sum(budgets) / len(budgets) if budgets else None}
        if slo is not None:
            limit = slo["text" if cls == "text" else "image"]
            c["slo_s"] = limit
            c["met_slo"] = sum(t <= limit for t in ttft)
            met_total += c["met_slo"]
        out[cls] = c
    if slo is not None:
        out["goodput_rps"] = met_total / span if span > 0 else None
    return out


def itl_summary(gaps: list[float]) -> dict:
    """Gaps between a class's consecutive streamed tokens, pooled over its requests: the reading speed."""
    gaps = sorted(gaps)
    return {"itl_n": len(gaps), "itl_mean": sum(gaps) / len(gaps) if gaps else None,
            "itl_p90": nearest_rank(gaps, 90), "itl_p99": nearest_rank(gaps, 99)}


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def print_load(title: str, results: dict, unloaded: dict) -> None:
    print(f"\n{title}; TTFT seconds (nearest-rank), n = successful requests")
    print("config        class  sent    n |    P50    P95    P99 | P99/unl  pred|err| P50  P90 (n) | 429 degr budget")
    for name, r in results.items():
        s = r["summary"]
        for cls in CLASSES:
            c = s[cls]
            if not c["n"]:
                print(f"{name:13s} {cls:5s} {c['sent']:5d} {0:4d} |  (no successful requests)  | "
                      f"429 {c['refused_429']}")
                continue
            pred = (f"{c['prediction_err_p50']:9.1%} {c['prediction_err_p90']:5.1%} ({c['prediction_n']})"
                    if c["prediction_n"] else f"{'-':>9s} {'-':>5s} (0)")
            budget = "-" if c["mean_image_budget"] is None else f"{c['mean_image_budget']:.0f}"
            print(f"{name:13s} {cls:5s} {c['sent']:5d} {c['n']:4d} | {c['p50']:6.2f} {c['p95']:6.2f} {c['p99']:6.2f} | "
                  f"{c['p99'] / unloaded[cls]:6.2f}x {pred:>20s} | {c['refused_429']:3d} {c['degraded']:4d} "
                  f"{budget:>6s}")
        itl = ", ".join(f"{cls} {s[cls]['itl_mean']:.3f} / {s[cls]['itl_p90']:.3f} / {s[cls]['itl_p99']:.3f} "
                        f"(n={s[cls]['itl_n']})" for cls in CLASSES if s[cls].get("itl_n"))
        if itl:
            print(f"{name:13s} ITL mean / P90 / P99 s: {itl}")
        cm = (r.get("server") or {}).get("cost_model") or {}
        if cm.get("step_time_target_s") is not None:
            print(f"{name:13s} step-time bound at the end {cm['step_time_target_s'] * 1e3:.0f} ms")
        if "goodput_rps" in s:
            print(f"{name:13s} goodput {s['goodput_rps']:.4f} requests/s meeting their objective "
                  f"(arrival span {s['arrival_span_s']:.0f} s)")


def text_lane_price(cal: dict, utilization: float, mix: str) -> float:
    """1 / (1 - U x text's share of the work): how much giving text priority stretches an image request's sojourn
    in a work-conserving scheduler, from the unloaded service times measured in the run."""
    shares = dict(parse_mix(mix))
    work = {cls: shares.get(cls, 0.0) * cal["service_s"][cls] for cls in cal["service_s"]}
    share = work.get("text", 0.0) / sum(work.values())
    return 1.0 / (1.0 - utilization * share)


def targets_loaded(results: dict, unloaded: dict, price: float | None = None) -> list[str]:
    """The loaded targets: text P99 within 2.5x unloaded; each image class's P99 within 1.05x fcfs's, and with
    ``price`` (the text lane's, issue 52) its P50 and P99 within 1.05 x fcfs x price."""
    d, f = results["default"]["summary"], results["fcfs"]["summary"]
    lines = []
    text = d["text"]["p99"] / unloaded["text"]
    old = results.get("lanes-tokens", {}).get("summary")  # the previous default, when it was run
    was = f"lanes-tokens {old['text']['p99'] / unloaded['text']:.2f}x, " if old else ""
    lines.append(f"text P99 / unloaded = {text:.2f}x (target <= 2.5x: {verdict(text <= 2.5)}; "
                 f"{was}fcfs {f['text']['p99'] / unloaded['text']:.2f}x)")
    for cls in visual_classes():
        ratio = d[cls]["p99"] / f[cls]["p99"]
        was = f"; lanes-tokens {old[cls]['p99'] / f[cls]['p99']:.2f}x" if old else ""
        lines.append(f"{cls} P99 default / fcfs = {ratio:.2f}x (target <= 1.05x: {verdict(ratio <= 1.05)}{was})")
        if price is not None:
            for q in ("p50", "p99"):
                r = d[cls][q] / f[cls][q]
                lines.append(f"{cls} {q.upper()} default / fcfs = {r:.2f}x (n={d[cls]['n']}/{f[cls]['n']}; target <= "
                             f"1.05 x the text lane's price {price:.3f} = {1.05 * price:.2f}x: "
                             f"{verdict(r <= 1.05 * price)})")
    for cls in CLASSES:
        c = d[cls]
        if c["prediction_n"]:
            ok = c["prediction_err_p50"] <= 0.15 and c["prediction_err_p90"] <= 0.35
            lines.append(f"{cls} prediction error P50 {c['prediction_err_p50']:.1%} P90 {c['prediction_err_p90']:.1%} "
                         f"(n={c['prediction_n']}; target <= 15% / <= 35%: {verdict(ok)})")
        else:
            lines.append(f"{cls} prediction: none made (MISSED)")
    return lines


def targets_overload(results: dict) -> list[str]:
    s = results["slo"]["summary"]
    lines = []
    for cls in CLASSES:
        c = s[cls]
        if c["n"]:
            ratio = c["p99"] / c["slo_s"]
            lines.append(f"{cls} admitted P99 / objective = {ratio:.2f}x (n={c['n']}; target <= 1.2x: "
                         f"{verdict(ratio <= 1.2)})")
    refused = sum(s[c]["refused_429"] for c in CLASSES)
    with_header = sum(s[c]["refused_with_retry_after"] for c in CLASSES)
    lines.append(f"refusals: {refused} x 429, {with_header} with Retry-After "
                 f"({verdict(refused == with_header)}); other errors {sum(s[c]['other_errors'] for c in CLASSES)}")
    for other in ("fcfs", "lanes"):
        g0 = results[other]["summary"]["goodput_rps"]
        ratio = s["goodput_rps"] / g0 if g0 else math.inf
        lines.append(f"goodput slo / {other} = {ratio:.2f}x (target >= 1.5x: {verdict(ratio >= 1.5)})")
    budgets = [s[c]["mean_image_budget"] for c in visual_classes() if s[c]["mean_image_budget"] is not None]
    lines.append("mean visual-token budget applied per image: "
                 + ", ".join(f"{c} {s[c]['mean_image_budget']:.0f}" for c in visual_classes()
                             if s[c]["mean_image_budget"] is not None)
                 + ("" if budgets else "-"))
    return lines


def plot(results: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), sharey=True, squeeze=False)
    colors = {"text": "#1f77b4", "1img": "#ff7f0e", "3img": "#d62728", "video": "#2ca02c"}
    for ax, (name, r) in zip(axes[0], results.items()):
        for cls in CLASSES:
            pts = [(x["start_s"], x["ttft_s"]) for x in r["records"] if x["cls"] == cls and not x["warmup"]
                   and x["ttft_s"] is not None]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, color=colors.get(cls), label=cls)
            refused = [x["start_s"] for x in r["records"] if x["cls"] == cls and x["status"] == 429]
            ax.scatter(refused, [0] * len(refused), marker="x", s=14, color=colors.get(cls))
        ax.set_title(name)
        ax.set_xlabel("arrival (s)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("TTFT (s), x = refused (429)")  # squeeze=False: a 1 x n grid, one config or several
    axes[0, 0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--utilizations", default="0.6,0.8")
    ap.add_argument("--overload", type=float, default=1.3, help="U of the overload run (0: skip it)")
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--unloaded-requests", type=int, default=3)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--text-slo-x", type=float, default=3.0, help="text objective = this x unloaded text TTFT")
    ap.add_argument("--image-slo-x", type=float, default=1.5,
                    help="image objective = this x unloaded three-image TTFT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", default=SEED_MIX, help="classes and weights (text, Nimg, video), as firsttoken bench's")
    ap.add_argument("--video-seconds", type=float, default=4.0, help="each video class request's clip length")
    ap.add_argument("--image-size", type=parse_size, default=(1024, 1024), help="each image's WIDTHxHEIGHT")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot-dir", default=None)
    ap.add_argument("--configs", default=",".join(LOADED), help="which loaded configurations to run")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                    help="another loaded configuration: a name and the serve flags it adds, e.g. "
                         "'t0.1=--step-time-target 0.1' (repeatable; add NAME to --configs to run it)")
    ap.add_argument("--before", type=Path, default=None,
                    help="another checkout (a git worktree of an earlier commit): each loaded configuration also runs "
                         "on its server, right after ours on the same arrivals, as before:NAME, with the targets "
                         "read for it too (a refactor's before/after)")
    ap.add_argument("--before-configs", default=None,
                    help="which loaded configurations also run on --before (default: all of --configs; e.g. "
                         "'default' when the change cannot touch fcfs)")
    ap.add_argument("--overload-config", action="append", default=[], metavar="NAME=FLAGS",
                    help="another configuration of the overload run, with --ttft-slo as `slo` has it, e.g. "
                         "'margin0=--ttft-slo-wait-margin 0' (repeatable; compared with `slo` on the same arrivals)")
    args = ap.parse_args()
    global CLASSES
    CLASSES = tuple(name for name, _ in parse_mix(args.mix))
    for item in args.config:
        name, _, flags = item.partition("=")
        LOADED[name] = shlex.split(flags)
    model = small_model(args.model)
    out: dict = {"machine": machine_info(), "model": Path(model).name,
                 "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    cal = calibrate(model, args)
    out["calibration"] = cal
    unloaded = cal["unloaded_ttft_s"]
    print(f"machine: {out['machine']}")
    print("unloaded (each class alone, n=%d): service %s; TTFT %s; capacity %.4f requests/s" % (
        args.unloaded_requests, ", ".join(f"{c} {s:.2f} s" for c, s in cal["service_s"].items()),
        ", ".join(f"{c} {t:.2f} s" for c, t in unloaded.items()), cal["capacity_rps"]))
    image_max = ImageConfig().image_max_tokens
    lines: list[str] = []
    for u in [float(x) for x in args.utilizations.split(",") if x]:
        rate = u * cal["capacity_rps"]
        results = {}
        for name in args.configs.split(","):
            results[name] = run(model, LOADED[name], rate, args)
            results[name]["summary"] = summarize(results[name], None, image_max)
            if args.before is not None and name in (args.before_configs or args.configs).split(","):
                with checkout(args.before.resolve()):
                    results[f"before:{name}"] = run(model, LOADED[name], rate, args)
                results[f"before:{name}"]["summary"] = summarize(results[f"before:{name}"], None, image_max)
        out[f"U={u:g}"] = results
        title = f"U={u:g}: Poisson {rate:.4f}/s, {args.num_requests} requests"
        print_load(title, results, unloaded)
        price = text_lane_price(cal, u, args.mix)
        out.setdefault("text_lane_price", {})[f"U={u:g}"] = price
        if {"fcfs", "default"} <= set(results):
            lines += [f"U={u:g}: {x}" for x in targets_loaded(results, unloaded, price)]
        if "before:default" in results and {"before:fcfs", "fcfs"} & set(results):
            before = {"fcfs": results.get("before:fcfs", results.get("fcfs")), "default": results["before:default"]}
            lines += [f"U={u:g} before: {x}" for x in targets_loaded(before, unloaded, price)]
        if args.json:  # before plotting: the raw records are what matters
            Path(args.json).write_text(json.dumps(out, indent=1))
        if args.plot_dir:
            Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
            plot(results, title, Path(args.plot_dir) / f"ttft-over-time-U{u:g}.png")
    if args.overload:
        slo = {"text": args.text_slo_x * unloaded["text"], "image": args.image_slo_x * unloaded["3img"]}
        rate = args.overload * cal["capacity_rps"]
        flag = f"text={slo['text']:.3f},image={slo['image']:.3f}"
        results = {}
        extra = [(name, ["--ttft-slo", flag, *shlex.split(flags)])
                 for name, _, flags in (item.partition("=") for item in args.overload_config)]
        for name, flags in (("fcfs", LOADED["fcfs"]), ("lanes", []), ("slo", ["--ttft-slo", flag]), *extra):
            results[name] = run(model, flags, rate, args)
            results[name]["summary"] = summarize(results[name], slo, image_max)
        out[f"overload U={args.overload:g}"] = {"slo_s": slo, **results}
        title = f"overload U={args.overload:g}: Poisson {rate:.4f}/s, {args.num_requests} requests, --ttft-slo {flag}"
        print_load(title, results, unloaded)
        lines += [f"U={args.overload:g} (--ttft-slo {flag}): {x}" for x in targets_overload(results)]
        for name, _ in extra:  # the same targets for each extra configuration, read as `slo`'s
            lines += [f"U={args.overload:g} {name}: {x}" for x in targets_overload({**results, "slo": results[name]})]
        if args.json:  # before plotting: the raw records are what matters
            Path(args.json).write_text(json.dumps(out, indent=1))
        if args.plot_dir:
            Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
            plot(results, title, Path(args.plot_dir) / f"ttft-over-time-U{args.overload:g}-slo.png")
    print("\ntargets")
    for line in lines:
        print("  " + line)
    out["targets"] = lines
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
