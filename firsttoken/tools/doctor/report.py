"""A doctor Report: the TTFT breakdown per class, the state lines (visual tokens, KV, scheduling,
caches), the ranked findings and what the server's metrics do not show. Text for people, ``to_dict``
for ``--json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from firsttoken.metrics.recorder import FIRST_TOKEN_PARTS
from firsttoken.tools.doctor.observe import CLASSES, PHASES, Observation, Throughput, observe
from firsttoken.tools.doctor.rules import (
    Context,
    Finding,
    KVSizing,
    Thresholds,
    diagnose,
    long_lane_below_throughput,
)


@dataclass(frozen=True)
class Report:
    url: str | None
    obs: Observation
    findings: list[Finding]
    thresholds: Thresholds
    probe: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        o = self.obs
        return {
            "url": self.url,
            "source": o.source,
            "has_stats": o.has_stats,
            "breakdown": {k: _class_dict(c) for k, c in o.classes.items()},
            "engine_time_to_first_token_s": o.first_token_engine_s,
            "state": _state(o, self.thresholds),
            "findings": [f.to_dict() for f in self.findings],
            "cannot_see": list(o.cannot_see),
            "probe": self.probe,
            "notes": list(self.notes),
        }


def doctor_from_texts(
    metrics_text: str,
    stats: dict[str, Any] | None = None,
    *,
    url: str | None = None,
    thresholds: Thresholds | None = None,
    kv: KVSizing | None = None,
    measured_reuse: float | None = None,
    measured_hit_rate: float | None = None,
    probe: dict[str, Any] | None = None,
) -> Report:
    th = thresholds or Thresholds()
    obs = observe(metrics_text, stats)
    if kv is not None and kv.kv_bytes_per_token:
        obs.cannot_see = [x for x in obs.cannot_see if not x.startswith("KV bytes per block")]
    ctx = Context(obs, th, kv or KVSizing(), measured_reuse, measured_hit_rate)
    # llama.cpp has no TTFT at all
    served = obs.prompt_tokens_total if obs.source == "llamacpp" else obs.classes
    notes = (
        []
        if served
        else ["no request has reached its first token yet: no TTFT breakdown (try --probe)"]
    )
    return Report(url, obs, diagnose(ctx), th, probe, notes)


def _class_dict(c) -> dict[str, Any]:
    share = {p: (s / c.ttft_mean_s if c.ttft_mean_s else None) for p, s in c.phase_mean_s.items()}
    return {"count": c.count, "ttft_s": {"p50": c.ttft_p50_s, "p95": c.ttft_p95_s, "p99": c.ttft_p99_s,
                                         "mean": c.ttft_mean_s},
            "phase_mean_s": c.phase_mean_s, "phase_share": share}  # fmt: skip


def _state(o: Observation, th: Thresholds) -> dict[str, Any]:
    return {
        "visual_tokens_per_image": o.visual_tokens_per_image, "image_budget_reference": th.image_budget_tokens,
        "kv_usage_ratio": o.kv_usage_ratio, "kv_blocks_total": o.kv_blocks_total,
        "preemptions": o.num_preemptions, "preemptions_by_reason": o.preemptions_by_reason,
        "waiting": o.waiting_by_lane, "waiting_for_capacity": o.waiting_for_capacity,
        "scheduling": sorted(o.scheduling_modes), "short_requests_delayed_by_long": o.short_delayed_by_long,
        "long_lane_only": o.long_lane_only or None,
        "encoder_cache_hits": o.encoder_cache_hits, "encoder_cache_queries": o.encoder_cache_queries,
        "prefix_cache_hit_tokens": o.prefix_hit_tokens, "prefix_cache_query_tokens": o.prefix_query_tokens,
        "requests": o.num_requests, "running": o.num_running,
        "throughput": _throughput_dict(o.throughput),
        "prediction": {"step": o.step_prediction, "ttft": o.ttft_prediction,
                       "step_time_target_s": o.step_time_target_s},
        "ttft_objective": {"image_budget_lowered": o.image_budget_lowered, "refused": o.refused_over_slo},
    }  # fmt: skip


def _throughput_dict(t: Throughput | None) -> dict[str, Any] | None:
    if t is None:
        return None
    return {"prompt_tokens": t.prompt_tokens, "prompt_s": t.prompt_s, "prompt_tokens_per_s": t.prompt_tokens_per_s,
            "generated_tokens": t.generated_tokens, "generation_s": t.generation_s,
            "generation_steps": t.generation_steps, "generation_s_per_token": t.generation_s_per_token,
            "decode_calls": t.decode_calls,
            "sequences_per_call": t.sequences_per_call}  # fmt: skip


# ---- text ----------------------------------------------------------------------------------------
def _s(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1000:.0f}ms" if x < 1 else f"{x:.2f}s")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def format_report(r: Report) -> str:
    o = r.obs
    src = {
        "firsttoken": "firsttoken (/metrics" + (" + /stats)" if o.has_stats else ", no /stats)"),
        "vllm": "vLLM (/metrics)",
        "llamacpp": "llama.cpp (/metrics)",
        "prometheus": "unknown server",
    }[o.source]
    served = "requests not exported" if o.num_requests is None else f"{o.num_requests} requests"
    lines = [f"firsttoken doctor: {r.url or 'saved metrics'}: {src}, {served}", ""]
    lines += _breakdown_lines(o)
    lines += _engine_time_lines(o)
    lines += _throughput_lines(o) if o.source == "llamacpp" else _state_lines(o, r.thresholds)
    if r.probe:
        lines.append(f"probe                   {r.probe.get('summary', '')}")
    lines.append("")
    lines += _finding_lines(r.findings)
    if o.cannot_see:
        lines.append("")
        lines.append("cannot see here:")
        lines.extend(f"  - {x}" for x in o.cannot_see)
    for note in r.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _breakdown_lines(o: Observation) -> list[str]:
    if not o.classes:
        return []
    phases = [p for p in (*PHASES, "other") if any(p in c.phase_mean_s for c in o.classes.values())]
    lines = [
        "where TTFT goes (share of mean TTFT per class)",
        f"{'class':6s}{'n':>6s}{'P50':>9s}{'P95':>9s}{'P99':>9s} | "
        + " ".join(f"{p:>10s}" for p in phases),
    ]
    for k in (*CLASSES, "all"):
        c = o.classes.get(k)
        if c is None or not c.count:
            continue
        shares = " ".join(
            f"{_pct(c.phase_mean_s.get(p, 0) / c.ttft_mean_s if c.ttft_mean_s else None):>10s}"
            for p in phases
        )
        lines.append(f"{k:6s}{c.count:>6d}{_s(c.ttft_p50_s):>9s}{_s(c.ttft_p95_s):>9s}{_s(c.ttft_p99_s):>9s} | "
                     + shares)
    return [*lines, ""]  # fmt: skip


def _engine_time_lines(o: Observation) -> list[str]:
    """Where the time from the end of preprocessing to the first token went, summed per class
    (firsttoken)."""
    rows = {k: v for k, v in o.first_token_engine_s.items() if sum(v.values()) > 0}
    if not rows:
        return []
    parts = list(FIRST_TOKEN_PARTS)
    lines = ["where the engine's time to each first token goes (share per class)",
             f"{'class':6s}{'seconds':>9s} | " + " ".join(f"{p:>13s}" for p in parts)]
    for k in CLASSES:
        if k in rows:
            total = sum(rows[k].values())
            lines.append(
                f"{k:6s}{total:>9.2f} | "
                + " ".join(f"{_pct(rows[k].get(p, 0) / total):>13s}" for p in parts)
            )
    return [*lines, ""]


def _state_lines(o: Observation, th: Thresholds) -> list[str]:
    lines = []
    if o.visual_tokens_per_image is not None:
        tiles = f" = {o.visual_tokens_per_image / th.tokens_per_tile:.1f} tiles" if th.tokens_per_tile else ""
        lines.append(f"visual tokens / image   {o.visual_tokens_per_image:,.0f}{tiles} "
                     f"(budget reference {th.image_budget_tokens:,})")  # fmt: skip
    kv = f"usage {_pct(o.kv_usage_ratio)}" + (
        f" of {o.kv_blocks_total:,.0f} blocks" if o.kv_blocks_total else ""
    )
    reasons = ", ".join(f"{k} {v:.0f}" for k, v in (o.preemptions_by_reason or {}).items())
    kv += f"; preemptions {'-' if o.num_preemptions is None else f'{o.num_preemptions:.0f}'}"
    kv += f" ({reasons})" if reasons else ""
    if o.waiting_for_capacity is not None:
        kv += f"; waiting for capacity {o.waiting_for_capacity:.0f}"
    lines.append(f"KV                      {kv}")
    if o.scheduling_modes:
        lines.append(f"scheduling              {'/'.join(sorted(o.scheduling_modes))}; short requests delayed by "
                     f"long work {o.short_delayed_by_long or 0:.0f}")  # fmt: skip
    seen = long_lane_below_throughput(o)
    if seen is not None:
        bounded = o.long_lane_only.get("bounded", {}).get("steps", 0)
        lines.append(f"long lane alone         {seen[0]:.0%} below its throughput over {seen[2]} steps with only long "
                     f"prompts to prefill ({bounded:.0f} of them bounded)")  # fmt: skip
    enc = (
        f"{o.encoder_cache_hits:.0f}/{o.encoder_cache_queries:.0f} images hit"
        if o.encoder_cache_queries is not None and o.encoder_cache_hits is not None
        else "-"
    )
    pre = (
        f"{o.prefix_hit_tokens:.0f}/{o.prefix_query_tokens:.0f} tokens hit"
        if o.prefix_query_tokens is not None and o.prefix_hit_tokens is not None
        else "-"
    )
    if o.prefix_cache_enabled is False:
        pre += " (off)"
    lines.append(f"caches                  encoder {enc}; prefix {pre}")
    return lines + _prediction_lines(o)


CLASS_NAMES = {"0": "text", "1": "1 image", "2+": "2+ images", "video": "video"}  # keys: CLASSES


def _prediction_lines(o: Observation) -> list[str]:
    """The step-cost model's fit and the admission-time TTFT prediction against what was measured,
    then what the TTFT objective (--ttft-slo) did: budgets lowered, requests refused."""
    lines = []

    def view(v: dict) -> str:
        if not v["n"]:
            return "no predictions yet"
        median = "-" if v["p50"] is None else f"{v['p50']:.2f}"
        return (f"{_pct(v['within_15pct'])} within 15%, {_pct(v['within_35pct'])} within 35%, median {median} "
                f"(n={v['n']:.0f})")

    if o.step_prediction is not None:
        target = "off" if o.step_time_target_s is None else _s(o.step_time_target_s)
        lines.append(f"step-cost model         predicted/actual step time: {view(o.step_prediction)}; "
                     f"step-time target {target}")  # fmt: skip
    for cls, v in o.ttft_prediction.items():
        if v["n"]:
            lines.append(f"{'predicted TTFT ' + CLASS_NAMES[cls]:24s}predicted/measured: {view(v)}")
    if o.image_budget_lowered is not None or o.refused_over_slo is not None:
        lowered = "-" if o.image_budget_lowered is None else f"{o.image_budget_lowered:.0f}"
        refused = "-" if o.refused_over_slo is None else f"{o.refused_over_slo:.0f}"
        lines.append(f"TTFT objective          image budget lowered for {lowered} requests; {refused} refused (429)")
    return lines


def _throughput_lines(o: Observation) -> list[str]:
    """llama.cpp: what its counters and gauges give, per sequence (its seconds are summed per
    slot)."""
    t = o.throughput
    if t is None:
        return []
    lines = []
    if o.num_requests is not None:
        lines.append(f"requests                {o.num_requests} finished (generated tokens - generation steps)")
    rate = t.prompt_tokens_per_s
    cached = (
        f"; {o.prefix_hit_tokens:,.0f} from the prompt cache"
        if o.prefix_hit_tokens is not None
        else ""
    )
    lines.append(f"prompt                  {t.prompt_tokens:,.0f} tokens computed in {t.prompt_s:.1f} s"
                 + (f": {rate:,.0f} tokens/s" if rate else "") + cached)  # fmt: skip
    per = t.generation_s_per_token
    lines.append(f"generation              {t.generated_tokens:,.0f} tokens in {t.generation_s:.1f} s"
                 + (f": {per * 1000:.1f} ms per output token after the first, per sequence" if per else ""))  # fmt: skip
    if o.prompt_tokens_mean is not None and o.output_tokens_mean is not None:
        lines.append(f"per request             {o.prompt_tokens_mean:,.0f} prompt tokens, "
                     f"{o.output_tokens_mean:,.1f} generated (means)")  # fmt: skip
    if t.decode_calls is not None:
        busy = (
            f" ({t.sequences_per_call:.2f} sequences per call)"
            if t.sequences_per_call is not None
            else ""
        )
        lines.append(f"forward calls           {t.decode_calls:,.0f}{busy}")
    waiting = o.waiting_by_lane.get("all")
    lines.append(f"queue now               {'-' if o.num_running is None else f'{o.num_running:.0f}'} processing, "
                 f"{'-' if waiting is None else f'{waiting:.0f}'} deferred (waiting for a free slot)")  # fmt: skip
    return lines


def _finding_lines(findings: list[Finding]) -> list[str]:
    if not findings:
        return ["findings: none"]
    lines = ["findings (ranked by estimated share of TTFT)"]
    for i, f in enumerate(findings, 1):
        lines.append(f"{i}. [{f.severity}] ~{f.share:.0%} of TTFT  {f.title}")
        ev = ", ".join(f"{k}={v}" for k, v in f.evidence.items() if v is not None)
        lines.append(f"   evidence: {ev}")
        lines.append(f"   change:   {f.change}")
        if f.note:
            lines.append(f"   note:     {f.note}")
    return lines
