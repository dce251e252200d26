"""The human-readable report and the optional plot (matplotlib, `pip install firsttoken[bench]`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from firsttoken.tools.bench.stats import ClassSummary, Dist

if TYPE_CHECKING:
    from firsttoken.tools.bench.runner import BenchReport

_PHASE_ORDER = (
    "preprocess_s",
    "queue_s",
    "encode_s",
    "prefill_s",
    "sample_s",
    "send_s",
    "ttft_s",
    "e2e_s",
)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _dist_row(label: str, d: Dist) -> str:
    return f"  {label:<22}{_ms(d.p50):>10}{_ms(d.p95):>10}{_ms(d.p99):>10}{_ms(d.mean):>10}{d.count:>8}"


def _class_block(c: ClassSummary, show_phases: bool) -> list[str]:
    errors = ", ".join(f"{k} x{v}" for k, v in c.errors.items()) or "none"
    lines = [
        f"class {c.cls}: {c.num_requests} requests, {c.num_ok} ok, errors: {errors}; "
        f"tokens in/out {c.prompt_tokens:,}/{c.completion_tokens:,}"
        + ("" if c.num_good is None else f"; meeting SLOs {c.num_good}/{c.num_requests}"),
        f"  {'ms':<22}{'P50':>10}{'P95':>10}{'P99':>10}{'mean':>10}{'n':>8}",
        _dist_row("TTFT", c.ttft),
        _dist_row("TPOT", c.tpot),
        _dist_row("ITL", c.itl),
        _dist_row("e2e", c.e2e),
    ]
    if show_phases and c.server_phases:
        lines.append("  server phases (usage.firsttoken):")
        keys = [k for k in _PHASE_ORDER if k in c.server_phases]
        keys += sorted(set(c.server_phases) - set(keys))
        lines += [_dist_row("  " + k, c.server_phases[k]) for k in keys]
    return lines


def format_report(report: "BenchReport") -> str:
    s, c = report.summary, report.config
    arrivals = f"Poisson {report.rate:.4g}/s" if report.rate else "back to back"
    if report.calibration is not None:
        arrivals += f" (utilization {report.calibration.utilization:g} of the measured capacity)"
    if c.concurrency:
        arrivals += f", at most {c.concurrency} in flight"
    workload = ", ".join(f"{k}={v}" for k, v in report.workload.items())
    lines = [
        f"server {c.base_url}  model {report.model}",
        f"workload: {workload}",
        f"arrivals: {arrivals}; warmup {c.warmup}",
        *([report.calibration.describe()] if report.calibration is not None else []),
        "TTFT = send -> first chunk with non-empty content; TPOT = (e2e - TTFT) / (completion tokens - 1); "
        "ITL = gaps between content chunks",
        "",
    ]
    for summary in s.classes.values():
        lines += _class_block(summary, s.server_timings_seen)
        lines.append("")
    errors = ", ".join(f"{k} x{v}" for k, v in s.errors.items()) or "none"
    lines += [
        f"duration {s.duration_s:.2f} s; requests {s.num_requests} ({s.num_ok} ok; errors: {errors})",
        f"throughput {s.request_throughput:.3f} req/s, {s.output_throughput:.1f} output tok/s"
        + (
            ""
            if s.tokens_from_usage
            else " (some token counts from content chunks: no usage chunk)"
        ),
    ]
    if s.goodput_fraction is not None:
        slo = " and ".join(p for p in (c.slo_ttft_s and f"TTFT <= {c.slo_ttft_s}s",
                                       c.slo_tpot_s and f"TPOT <= {c.slo_tpot_s}s") if p)
        lines.append(
            f"goodput ({slo}): {s.goodput_fraction:.1%} of requests, {s.goodput_rate:.3f} req/s"
        )
    if not s.server_timings_seen:
        lines.append("server phase timings: not reported by this server (no usage.firsttoken)")
    return "\n".join(lines)


def plot_report(report: "BenchReport", path: str | Path) -> bool:
    """TTFT distribution per class and TTFT over time; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    measured = [r for r in report.records if not r.warmup and r.ok and r.ttft_s is not None]
    classes = [k for k in report.summary.classes if k != "all"]
    fig, (ax_cdf, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for cls in classes:
        ttfts = sorted(r.ttft_s for r in measured if r.cls == cls)  # type: ignore[misc]
        if ttfts:
            ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax_cdf.step(ttfts, ys, where="post", label=f"{cls} (n={len(ttfts)})")
            ax_time.scatter([r.start_s for r in measured if r.cls == cls],
                            [r.ttft_s for r in measured if r.cls == cls], s=10, label=cls)
    ax_cdf.set(
        xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT distribution per class"
    )
    ax_cdf.set_xscale("log")
    ax_cdf.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_time.set(xlabel="send time (s since start)", ylabel="TTFT (s)", title="TTFT over time")
    for ax in (ax_cdf, ax_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
