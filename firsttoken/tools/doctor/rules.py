"""The seed's cheat sheet as rules over an ``Observation``: each returns a ``Finding`` (or None)
with its evidence, ONE concrete change (a flag and a value) and an estimated share of all TTFT that
the change would remove.

Shares are ratios, not absolute seconds, so the rules read the same on a laptop-sized checkpoint and
a real one:

    image budget   excess visual tokens / all prompt tokens (engine work, queue included, scales with tokens)
    fcfs / mixed   TTFT the text-only class spent queued / all TTFT (the wait lanes take away)
    long lane      N x image classes' own engine seconds to first token / all TTFT, where N is how far below its
                   throughput the long lane ran while only it had prefill work (1 - at-throughput seconds / wall)
    KV pressure    min(1, preemptions per request) x (queue + encode + prefill) / all TTFT (recompute, re-wait)
    caches off     reusable share of prompts x (encode + prefill) / all TTFT

Absolute limits (``Thresholds``) only gate or grade, and are configurable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from firsttoken.config import ImageConfig
from firsttoken.tools.doctor.observe import CLASSES, IMAGE_ONLY_CLASSES, Observation

SEVERITIES = ("high", "medium", "low")


@dataclass(frozen=True)
class Thresholds:
    # the visual tokens per image doctor recommends (serve's)
    image_budget_tokens: int = ImageConfig().image_max_tokens
    # per-image visual tokens above factor x budget: no effective budget
    image_budget_factor: float = 1.5
    high_share: float = 0.25  # estimated share of TTFT from which a finding is high severity
    medium_share: float = 0.10
    kv_usage_high: float = 0.9  # KV usage ratio at scrape time counted as pressure
    # short requests delayed by long work / short requests, under lanes
    delayed_fraction: float = 0.1
    # caches off, no probe: share of prompt work a follow-up-heavy workload repeats
    assumed_reuse: float = 0.5
    # optional absolute target: a finding when P99 TTFT exceeds it
    ttft_p99_target_s: float | None = None
    # the long lane this far below its throughput while only it had work: a finding
    long_lane_below: float = 0.10
    long_lane_min_steps: int = 20  # ... over at least this many such steps
    # a tiling family's tokens per tile, and the tiles image_budget_tokens buys at most (doctor --model
    # of InternVL): findings count images in tiles too
    tokens_per_tile: int | None = None
    budget_tiles: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.medium_share <= self.high_share <= 1:
            raise ValueError("need 0 < medium_share <= high_share <= 1")
        if self.image_budget_tokens < 1 or self.image_budget_factor < 1:
            raise ValueError("image_budget_tokens must be >= 1 and image_budget_factor >= 1")


@dataclass(frozen=True)
class KVSizing:
    """How doctor turns 'the pool is too small' into a --kv-cache-memory value (see
    kv_memory_for)."""

    kv_bytes_per_token: int | None = None  # from the model's config via tools.plan; None: unknown
    # None: estimated from the metrics (Little's law while busy)
    peak_concurrency: int | None = None


@dataclass(frozen=True)
class Finding:
    key: str  # image_budget | scheduling | long_lane | kv_pressure | caches | ttft_target
    severity: str  # high | medium | low
    share: float  # estimated share of all TTFT the change would remove, 0..1
    title: str
    evidence: dict[str, Any]
    change: str  # one concrete change: flags and values
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "severity": self.severity, "share": round(self.share, 4), "title": self.title,
                "evidence": self.evidence, "change": self.change, "note": self.note}  # fmt: skip


@dataclass
class Context:
    obs: Observation
    th: Thresholds
    kv: KVSizing = field(default_factory=KVSizing)
    # from --probe's follow-up turns: share of prompt tokens resent
    measured_reuse: float | None = None
    measured_hit_rate: float | None = None  # the probe's follow-ups: cached / prompt tokens


def severity(share: float, th: Thresholds) -> str:
    return "high" if share >= th.high_share else "medium" if share >= th.medium_share else "low"


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _finding(
    ctx: Context,
    key: str,
    share: float,
    title: str,
    evidence: dict,
    change: str,
    note: str = "",
) -> Finding:
    share = max(0.0, min(1.0, share))
    return Finding(key, severity(share, ctx.th), share, title, evidence, change, note)


# ---- the rules -----------------------------------------------------------------------------------
def image_budget(ctx: Context) -> Finding | None:
    o, th = ctx.obs, ctx.th
    per_image = o.visual_tokens_per_image
    if not per_image or o.visual_tokens_total is None or not o.prompt_tokens_total:
        return None
    if per_image <= th.image_budget_factor * th.image_budget_tokens:
        return None
    excess = o.visual_tokens_total * (1 - th.image_budget_tokens / per_image)
    share = excess / o.prompt_tokens_total
    tile = th.tokens_per_tile
    evidence = {"visual_tokens_per_image": round(per_image), "budget_tokens": th.image_budget_tokens,
                "visual_share_of_prompt_tokens": _r(o.visual_tokens_total / o.prompt_tokens_total),
                "excess_visual_tokens_share": _r(share),
                "encode_prefill_share_of_image_ttft": _r(_share(o, ("encode", "prefill"), IMAGE_ONLY_CLASSES))}
    if tile:  # the budget buys whole tiles: budget_tiles at most, the thumbnail among them
        evidence |= {"tiles_per_image": _r(per_image / tile, 1), "budget_tiles": th.budget_tiles}
    return _finding(
        ctx, "image_budget", share,
        f"no effective image budget: {per_image:,.0f} visual tokens per image"
        + (f" ({per_image / tile:.1f} tiles)" if tile else "")
        + f", {per_image / th.image_budget_tokens:.1f}x a {th.image_budget_tokens}-token budget"
        + (f" (at most {th.budget_tiles} tiles)" if tile else ""),
        evidence,
        f"--image-max-tokens {th.image_budget_tokens}",
        f"check answers at the budget first: firsttoken regress --budgets 16384,{th.image_budget_tokens},400",
    )  # fmt: skip


def scheduling(ctx: Context) -> Finding | None:
    o, th = ctx.obs, ctx.th
    total = o.ttft_total_s()
    text = o.classes.get("0")
    if not total or text is None or not text.count:
        return None
    text_queue_total = text.phase_mean_s.get("queue", 0.0) * text.count
    text_queue_share = _r(_share(o, ("queue",), ("0",)))
    if "fcfs" in o.scheduling_modes:
        return _finding(
            ctx, "scheduling", text_queue_total / total,
            "one FIFO queue (--scheduling fcfs): text-only requests wait behind image prefills",
            {"scheduling": "fcfs", "text_queue_share_of_text_ttft": text_queue_share,
             "text_ttft_p95_s": _r(text.ttft_p95_s), "text_queue_share_of_all_ttft": _r(text_queue_total / total)},
            "--scheduling lanes",
        )  # fmt: skip
    delayed = o.short_delayed_by_long or 0.0
    if delayed / text.count < th.delayed_fraction:
        return None
    share = text_queue_total / total * min(1.0, delayed / text.count)
    return _finding(
        ctx, "scheduling", share,
        f"mixed batches: {delayed:.0f} short requests sat out a step while long work ran",
        {"short_requests_delayed_by_long": delayed, "text_requests": text.count,
         "text_queue_share_of_text_ttft": text_queue_share},
        "--long-step-tokens 256",
        "halves the long lane's work per step (default 512); long prompts take longer, short ones wait less",
    )  # fmt: skip


def long_lane_below_throughput(o: Observation) -> tuple[float, float, int] | None:
    """(how far below its throughput the long lane ran while only it had prefill work, the share of
    that shortfall in steps not sized for throughput, those steps) from firsttoken's long-lane-only
    counters; None without them."""
    by = o.long_lane_only
    wall = sum(v["wall_s"] for v in by.values())
    if not by or wall <= 0:
        return None
    lost = {k: max(v["wall_s"] - v["at_throughput_s"], 0.0) for k, v in by.items()}
    below = max(0.0, 1.0 - sum(v["at_throughput_s"] for v in by.values()) / wall)
    bounded = lost.get("bounded", 0.0) / sum(lost.values()) if sum(lost.values()) else 0.0
    return below, bounded, int(sum(v["steps"] for v in by.values()))


def long_lane(ctx: Context) -> Finding | None:
    o, th = ctx.obs, ctx.th
    seen = long_lane_below_throughput(o)
    if seen is None:
        return None
    below, bounded, steps = seen
    # a shortfall in throughput-sized steps is the step-cost model's error, not a setting: no change
    # to name
    if steps < th.long_lane_min_steps or below < th.long_lane_below or bounded < 0.5:
        return None
    total = o.ttft_total_s()
    own = sum(v.get(p, 0.0) for k, v in o.first_token_engine_s.items() if k in IMAGE_ONLY_CLASSES
              for p in ("encoder", "forward", "step_overhead", "idle"))
    paced = o.itl_target_s is not None
    by = o.long_lane_only.get("bounded", {})
    return _finding(
        ctx, "long_lane", below * own / total if total else 0.0,
        f"the long lane ran {below:.0%} below its throughput under load: {by.get('steps', 0):.0f} of {steps} steps "
        "with only long prompts to prefill were " + ("paced for streaming answers" if paced else "time-bounded"),
        {"below_throughput": _r(below), "bounded_share_of_shortfall": _r(bounded), "long_lane_only_steps": steps,
         "bounded_steps": by.get("steps", 0), "itl_target_s": o.itl_target_s,
         "step_time_target_s": o.step_time_target_s},
        "--itl-target off" if paced else "--step-time-target auto",
        "with no short prompt waiting, a bound protects nobody's first token: steps sized for throughput serve the "
        "images at the speed they have alone" + (" (answers then stream at the pace of those steps)" if paced else ""),
    )  # fmt: skip


def kv_pressure(ctx: Context) -> Finding | None:
    o, th = ctx.obs, ctx.th
    preempted = o.num_preemptions or 0.0
    waiting = o.waiting_for_capacity or 0.0
    usage = o.kv_usage_ratio
    if preempted <= 0 and waiting <= 0 and (usage is None or usage < th.kv_usage_high):
        return None
    per_request = preempted / max(1, o.num_requests or 0)
    share = min(1.0, per_request) * _share(o, ("queue", "encode", "prefill"))
    if preempted <= 0:
        share = th.medium_share  # full but not yet preempting: worth a look, not the first suspect
    reasons = o.preemptions_by_reason or {}
    # reasons are causes: a prefill chunk outgrows its blocks only under optimistic admission
    # (whole-prompt admission allocates the prompt up front and never preempts a prefill), so
    # decode_growth alone needs memory, not a switch
    optimistic = reasons.get("prefill_growth", 0) > 0
    memory = kv_memory_for(ctx)
    change = f"--kv-cache-memory {memory}"
    if optimistic:
        change = f"--kv-admission whole-prompt {change}"
    return _finding(
        ctx, "kv_pressure", share,
        f"KV pool too small for the peak: {preempted:.0f} preemptions ({per_request:.2f} per request)",
        {"preemptions": preempted, "preemptions_by_reason": reasons or None, "kv_usage_ratio": _r(usage),
         "kv_blocks_total": o.kv_blocks_total, "waiting_for_capacity": o.waiting_for_capacity,
         "peak_concurrency": _peak(ctx), "prompt_tokens_mean": _r(o.prompt_tokens_mean, 1)},
        change,
        "a preempted request drops its KV and prefills again later; plan the pool for the peak, not the mean "
        "(firsttoken plan)",
    )  # fmt: skip


def caches(ctx: Context) -> Finding | None:
    o = ctx.obs
    if o.source == "llamacpp":
        # its prompt cache is per slot and per request (cache_prompt): no server flag to name
        return None
    prefix_off = o.prefix_cache_enabled is False
    encoder_off = (
        o.encoder_cache_bytes == 0
        and o.encoder_cache_hits == 0
        and (o.encoder_cache_queries or 0) > 0
    )
    if ctx.measured_reuse is not None:
        reuse, hit = ctx.measured_reuse, ctx.measured_hit_rate or 0.0
        if reuse - hit < 0.2 and not (prefix_off or encoder_off):
            return None
        reuse = max(0.0, reuse - hit)
    elif prefix_off or encoder_off:
        reuse = ctx.th.assumed_reuse
    else:
        return None
    flags = [
        f
        for f, off in (
            ("--no-prefix-cache", prefix_off),
            ("--no-encoder-cache", encoder_off),
        )
        if off
    ]
    share = reuse * _share(o, ("encode", "prefill"))
    change = ("remove " + " ".join(flags)) if flags else "--encoder-cache-memory 2GiB"
    return _finding(
        ctx, "caches", share,
        "caches off: follow-up turns encode their images and prefill their history again"
        if flags else "follow-up turns hit the caches little",
        {"prefix_cache": "off" if prefix_off else "on", "encoder_cache": "off" if encoder_off else "on",
         "prefix_hit_rate": _r(_ratio(o.prefix_hit_tokens, o.prefix_query_tokens)),
         "encoder_hit_rate": _r(_ratio(o.encoder_cache_hits, o.encoder_cache_queries)),
         "reusable_share": _r(reuse), "reuse_measured": ctx.measured_reuse is not None,
         "encode_prefill_share_of_ttft": _r(_share(o, ("encode", "prefill")))},
        change,
        "" if ctx.measured_reuse is not None else
        f"assumes {ctx.th.assumed_reuse:.0%} of prompt work repeats (a follow-up-heavy workload); --probe measures it",
    )  # fmt: skip


def ttft_target(ctx: Context) -> Finding | None:
    target = ctx.th.ttft_p99_target_s
    worst = max(
        ((c.ttft_p99_s or 0.0, k) for k, c in ctx.obs.classes.items() if k != "all"),
        default=(0.0, ""),
    )
    if target is None or worst[0] <= target:
        return None
    return Finding("ttft_target", "low", 0.0, f"P99 TTFT of class {worst[1]} is {worst[0]:.2f} s (> {target} s)",
                   {"ttft_p99_s": _r(worst[0]), "class": worst[1]}, "see the findings above", "")  # fmt: skip


RULES: tuple[Callable[[Context], Finding | None], ...] = (
    image_budget,
    scheduling,
    long_lane,
    kv_pressure,
    caches,
    ttft_target,
)


def diagnose(ctx: Context) -> list[Finding]:
    """Every rule that fires, largest estimated share of TTFT first."""
    findings = [f for rule in RULES if (f := rule(ctx)) is not None]
    return sorted(findings, key=lambda f: (-f.share, SEVERITIES.index(f.severity)))


# ---- shares and sizing ---------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _share(o: Observation, phases: tuple[str, ...], classes: tuple[str, ...] = CLASSES) -> float:
    """Seconds of ``phases`` in ``classes`` over the TTFT of those classes (vLLM: the ``all``
    class)."""
    if o.source == "vllm":
        c = o.classes.get("all")
        return (
            sum(c.phase_mean_s.get(p, 0.0) for p in phases) / c.ttft_mean_s
            if c and c.ttft_mean_s
            else 0.0
        )
    denom = sum((c.ttft_mean_s or 0.0) * c.count for k, c in o.classes.items() if k in classes)
    return sum(o.phase_total_s(p, classes) for p in phases) / denom if denom else 0.0


def _peak(ctx: Context) -> int:
    """Requests in flight at the peak: given, or the mean in flight while the engine was busy (a
    floor)."""
    if ctx.kv.peak_concurrency:
        return ctx.kv.peak_concurrency
    o = ctx.obs
    if o.e2e_total_s and o.busy_s:
        return max(1, math.ceil(o.e2e_total_s / o.busy_s))
    return max(1, math.ceil((o.num_requests or 0) / 10))


def kv_memory_for(ctx: Context) -> str:
    """A --kv-cache-memory value for the peak to run to its last token: peak x (prompt + output)
    tokens, whole blocks, in MiB. Bytes per token come from the model's config (tools.plan) or
    vLLM's cache_config_info; without either, the answer is in blocks, relative to today's pool."""
    o = ctx.obs
    block = o.kv_block_size or 16
    tokens = (o.prompt_tokens_mean or 0.0) + (o.output_tokens_mean or 0.0)
    blocks = _peak(ctx) * math.ceil(tokens / block)
    per_block = (
        (ctx.kv.kv_bytes_per_token * block) if ctx.kv.kv_bytes_per_token else o.kv_bytes_per_block
    )
    if per_block:
        return f"{math.ceil(blocks * per_block / 2**20)}MiB"
    now = (
        f" ({blocks / o.kv_blocks_total:.1f}x today's {o.kv_blocks_total:.0f})"
        if o.kv_blocks_total
        else ""
    )
    return f"<{blocks} blocks{now}: firsttoken plan --model DIR --peak-concurrency {_peak(ctx)}>"
