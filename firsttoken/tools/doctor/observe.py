"""What doctor knows about a server: its /metrics (firsttoken's, vLLM's or llama.cpp's names) and,
when there, firsttoken's /stats, folded into one plain ``Observation``. Nothing here judges;
rules.py does.

Prometheus text is parsed with ``prometheus_client.parser.text_string_to_metric_families``; samples
are kept by sample name (``*_total``, ``*_sum``, ``*_count``, ``*_bucket``) with their labels. A
quantity the server does not expose stays ``None`` and its name goes into ``cannot_see``, so the
report says what it could not look at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from firsttoken.metrics.window import IMAGE_CLASSES

PHASES = ("preprocess", "queue", "encode", "prefill", "sample", "send")
# the server's request classes: "0" (text), "1", "2+" images, "video" (any video)
CLASSES = IMAGE_CLASSES
TEXT_CLASS, VIDEO_CLASS = "0", "video"
# under --image-max-tokens
IMAGE_ONLY_CLASSES = tuple(c for c in CLASSES if c not in (TEXT_CLASS, VIDEO_CLASS))

Labels = dict[str, str]


class Samples:
    """Prometheus samples by sample name; sums over the samples whose labels match a filter."""

    def __init__(self, text: str) -> None:
        self.by_name: dict[str, list[tuple[Labels, float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.by_name.setdefault(s.name, []).append((dict(s.labels), float(s.value)))

    def has(self, name: str) -> bool:
        return name in self.by_name

    def total(self, name: str, **match: str) -> float | None:
        rows = self.by_name.get(name)
        if rows is None:
            return None
        return sum(
            v for labels, v in rows if all(labels.get(k) == want for k, want in match.items())
        )

    def label_values(self, name: str, label: str) -> set[str]:
        return {labels[label] for labels, _ in self.by_name.get(name, []) if label in labels}

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, v in self.by_name.get(name, []):
            if label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + v
        return out

    def first(self, name: str) -> tuple[Labels, float] | None:
        rows = self.by_name.get(name)
        return rows[0] if rows else None

    def ratio_view(self, histogram: str, **match: str) -> dict[str, float | None] | None:
        """A predicted / actual histogram: n, its median (bucket-interpolated), and the shares
        within 15% and 35% of actual (observations in (0.85, 1.15] and (0.65, 1.35]: firsttoken's
        bucket edges)."""
        cum: dict[float, float] = {}
        for labels, v in self.by_name.get(f"{histogram}_bucket", []):
            if all(labels.get(k) == want for k, want in match.items()):
                cum[float(labels["le"])] = cum.get(float(labels["le"]), 0.0) + v
        n = cum.get(math.inf, 0.0)
        if not n:
            return (
                {"n": 0, "p50": None, "within_15pct": None, "within_35pct": None} if cum else None
            )

        def share(lo: float, hi: float) -> float | None:
            return (cum[hi] - cum[lo]) / n if lo in cum and hi in cum else None

        return {"n": n, "p50": self.quantile(histogram, 0.5, **match), "within_15pct": share(0.85, 1.15),
                "within_35pct": share(0.65, 1.35)}  # fmt: skip

    def quantile(self, histogram: str, q: float, **match: str) -> float | None:
        """histogram_quantile over the buckets matching ``match`` (summed), linear within a
        bucket."""
        bounds: dict[float, float] = {}
        for labels, v in self.by_name.get(f"{histogram}_bucket", []):
            if all(labels.get(k) == want for k, want in match.items()):
                le = float(labels["le"])
                bounds[le] = bounds.get(le, 0.0) + v
        if not bounds:
            return None
        edges = sorted(bounds)
        total = bounds[edges[-1]]
        if total <= 0:
            return None
        rank, prev_le, prev_n = q * total, 0.0, 0.0
        for le in edges:
            n = bounds[le]
            if n >= rank:
                if math.isinf(le):
                    return prev_le
                return prev_le + (le - prev_le) * (
                    (rank - prev_n) / (n - prev_n) if n > prev_n else 0.0
                )
            prev_le, prev_n = le, n
        return prev_le


@dataclass(frozen=True)
class ClassTiming:
    """One request class (``all`` or one of ``CLASSES``): requests, TTFT percentiles, mean seconds
    per phase."""

    count: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    ttft_mean_s: float | None
    phase_mean_s: dict[str, float]  # phase -> mean seconds per request; vLLM: queue, prefill, other


@dataclass(frozen=True)
class Throughput:
    """Cumulative prompt and generation work, from a server that exports token and second counters
    but no per-request latencies (llama.cpp). Seconds are summed per sequence: sequences that
    overlap in time (parallel slots) each count their own, so tokens / seconds is the rate one
    sequence saw, not the server's total."""

    prompt_tokens: float  # prompt tokens computed (not taken from a cache), images' tokens included
    prompt_s: float
    generated_tokens: float
    generation_s: float  # from each sequence's last prompt token to its last generated token
    # model forward calls (prompt batches + generation steps, images excluded)
    decode_calls: float | None = None
    # mean sequences busy per forward call: the batch actually run
    sequences_per_call: float | None = None
    # generated tokens after each request's first; None: unknown
    generation_steps: float | None = None

    @property
    def prompt_tokens_per_s(self) -> float | None:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else None

    @property
    def generation_s_per_token(self) -> float | None:
        """Mean time per output token after the first (TPOT), waits for other sequences' prompts
        included; over all generated tokens (a little low) when the step count is unknown."""
        steps = (
            self.generation_steps if self.generation_steps is not None else self.generated_tokens
        )
        return self.generation_s / steps if steps else None


@dataclass
class Observation:
    source: str  # "firsttoken" | "vllm" | "llamacpp" | "prometheus" (none of their names found)
    has_stats: bool = False
    classes: dict[str, ClassTiming] = field(default_factory=dict)
    num_requests: int | None = 0  # None: the server exports no request count
    prompt_tokens_mean: float | None = None
    output_tokens_mean: float | None = None
    prompt_tokens_by_class: dict[str, float] = field(default_factory=dict)  # mean per request
    prompt_tokens_total: float | None = None
    visual_tokens_total: float | None = None
    # encoder cache hits + misses: images that reached the encoder cache
    num_images: float | None = None
    # one-image requests' mean if any, else visual / num_images
    visual_tokens_per_image: float | None = None
    scheduling_modes: set[str] = field(default_factory=set)  # lane labels seen: short/long, or fcfs
    short_delayed_by_long: float | None = None
    kv_usage_ratio: float | None = None
    kv_blocks_total: float | None = None
    kv_block_size: int | None = None
    # vLLM's cache_config_info; firsttoken does not export it
    kv_bytes_per_block: float | None = None
    preemptions_by_reason: dict[str, float] | None = None
    num_preemptions: float | None = None
    waiting_by_lane: dict[str, float] = field(default_factory=dict)
    waiting_for_capacity: float | None = None
    encoder_cache_hits: float | None = None
    encoder_cache_queries: float | None = None
    encoder_cache_bytes: float | None = None
    prefix_hit_tokens: float | None = None
    prefix_query_tokens: float | None = None
    prefix_cache_enabled: bool | None = None
    e2e_total_s: float | None = None
    busy_s: float | None = None  # engine time inside steps
    # requests being processed at scrape time (llama.cpp: busy slots)
    num_running: float | None = None
    throughput: Throughput | None = None
    # firsttoken's step-cost model and TTFT objective: predicted / actual as {n, p50, within_15pct,
    # within_35pct}
    step_prediction: dict[str, float | None] | None = None
    # image class -> ratio view
    ttft_prediction: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # None: no time bound (off, or the model not trained yet)
    step_time_target_s: float | None = None
    itl_target_s: float | None = None  # --itl-target's pace in force (None: off)
    # steps in which only the long lane had prefill work, by sizing ("throughput" | "bounded"):
    # steps, wall_s, at_throughput_s (what their work would take in throughput steps;
    # firsttoken_long_lane_only_*)
    long_lane_only: dict[str, dict[str, float]] = field(default_factory=dict)
    # requests whose visual-token budget the TTFT objective lowered
    image_budget_lowered: float | None = None
    # requests answered 429 because their predicted TTFT missed the objective
    refused_over_slo: float | None = None
    # firsttoken: seconds from the end of preprocessing to each first token, summed, by image class
    # and part (handoff, encoder, forward, step_overhead, other_steps, idle:
    # metrics.recorder.FIRST_TOKEN_PARTS)
    first_token_engine_s: dict[str, dict[str, float]] = field(default_factory=dict)
    cannot_see: list[str] = field(default_factory=list)

    def ttft_total_s(self) -> float:
        """Sum of TTFT over the requests per class (mean x count), the denominator of every
        share."""
        return sum((c.ttft_mean_s or 0.0) * c.count for k, c in self.classes.items() if k != "all")

    def phase_total_s(self, phase: str, classes: tuple[str, ...] = CLASSES) -> float:
        return sum(
            c.phase_mean_s.get(phase, 0.0) * c.count
            for k, c in self.classes.items()
            if k in classes
        )


def observe(metrics_text: str, stats: dict[str, Any] | None = None) -> Observation:
    samples = Samples(metrics_text)
    if samples.has("firsttoken_time_to_first_token_seconds_count") or samples.has(
        "firsttoken_engine_steps_total"
    ):
        return _firsttoken(samples, stats)
    if samples.has("vllm:time_to_first_token_seconds_count"):
        return _vllm(samples)
    if samples.has("llamacpp:prompt_tokens_total"):
        return _llamacpp(samples)
    return Observation(
        source="prometheus",
        cannot_see=["no firsttoken_*, vllm:* or llamacpp:* metrics on this /metrics page"],
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- firsttoken ----------------------------------------------------------------------------------
def _firsttoken(m: Samples, stats: dict[str, Any] | None) -> Observation:
    o = Observation(source="firsttoken", has_stats=stats is not None)
    o.classes = _classes_from_stats(stats) if stats else _classes_from_metrics(m)
    o.num_requests = int(m.total("firsttoken_requests_total") or 0)
    o.prompt_tokens_total = m.total("firsttoken_request_prompt_tokens_sum")
    o.prompt_tokens_mean = _ratio(
        o.prompt_tokens_total, m.total("firsttoken_request_prompt_tokens_count")
    )
    o.output_tokens_mean = _ratio(m.total("firsttoken_request_generation_tokens_sum"),
                                  m.total("firsttoken_request_generation_tokens_count"))  # fmt: skip
    for cls in CLASSES:
        mean = _ratio(m.total("firsttoken_request_prompt_tokens_sum", images=cls),
                      m.total("firsttoken_request_prompt_tokens_count", images=cls))  # fmt: skip
        if mean is not None:
            o.prompt_tokens_by_class[cls] = mean
    _observe_images(o, m)
    _observe_scheduling(o, m)
    o.cannot_see = (
        []
        if stats
        else [("/stats (exact P50/P95/P99 per class): TTFT percentiles are estimated from histogram buckets")]
    )
    o.cannot_see.append(
        "KV bytes per block (not exported): a --kv-cache-memory value needs the model's config (--model)"
    )
    return o


def _observe_images(o: Observation, m: Samples) -> None:
    """Visual tokens per image, the encoder cache and the prefix cache."""
    # images' visual tokens: a video's are under its own budget (--video-max-tokens), not the image
    # budget's
    o.visual_tokens_total = m.total("firsttoken_request_visual_tokens_sum")
    if o.visual_tokens_total is not None:
        o.visual_tokens_total -= (
            m.total("firsttoken_request_visual_tokens_sum", images=VIDEO_CLASS) or 0.0
        )
    o.encoder_cache_hits = m.total("firsttoken_encoder_cache_hits_total")
    misses = m.total("firsttoken_encoder_cache_misses_total")
    if o.encoder_cache_hits is not None and misses is not None:
        o.encoder_cache_queries = o.encoder_cache_hits + misses
        o.num_images = o.encoder_cache_queries
    o.encoder_cache_bytes = m.total("firsttoken_encoder_cache_bytes")
    # Exact from one-image requests; images whose tokens all came from the prefix cache never reach
    # the encoder cache, so visual / (hits + misses) overstates when the prefix cache hits.
    one = m.total("firsttoken_request_visual_tokens_count", images="1")
    if one:
        o.visual_tokens_per_image = (
            m.total("firsttoken_request_visual_tokens_sum", images="1") or 0.0
        ) / one
    elif o.num_images and o.visual_tokens_total is not None:
        o.visual_tokens_per_image = o.visual_tokens_total / o.num_images
    o.prefix_hit_tokens = m.total("firsttoken_prefix_cache_hit_tokens_total")
    o.prefix_query_tokens = m.total("firsttoken_prefix_cache_query_tokens_total")
    if o.prefix_query_tokens is not None and o.prompt_tokens_total:
        # a disabled prefix cache looks nothing up
        o.prefix_cache_enabled = o.prefix_query_tokens > 0


def _observe_scheduling(o: Observation, m: Samples) -> None:
    """Lanes, the KV pool, preemptions, the cost model's predictions and where first tokens' engine
    time went."""
    o.scheduling_modes = m.label_values("firsttoken_time_to_first_token_seconds_count", "lane")
    o.short_delayed_by_long = m.total("firsttoken_short_requests_delayed_by_long_total")
    o.kv_usage_ratio = m.total("firsttoken_kv_cache_usage_ratio")
    o.kv_blocks_total = m.total("firsttoken_kv_cache_capacity_blocks")
    o.preemptions_by_reason = m.by_label("firsttoken_preemptions_total", "reason")
    o.num_preemptions = sum(o.preemptions_by_reason.values())
    o.waiting_by_lane = m.by_label("firsttoken_requests_queued", "lane")
    o.e2e_total_s = m.total("firsttoken_e2e_request_latency_seconds_sum")
    o.busy_s = m.total("firsttoken_step_busy_seconds_total")
    o.step_prediction = m.ratio_view("firsttoken_step_time_prediction_ratio")
    for cls in CLASSES:
        view = m.ratio_view("firsttoken_ttft_prediction_ratio", images=cls)
        if view is not None:
            o.ttft_prediction[cls] = view
    o.step_time_target_s = m.total("firsttoken_step_time_target_seconds")
    o.itl_target_s = m.total("firsttoken_itl_target_seconds")
    for sized, steps in m.by_label("firsttoken_long_lane_only_steps_total", "sized").items():
        o.long_lane_only[sized] = {
            "steps": steps,
            "wall_s": m.total("firsttoken_long_lane_only_seconds_total", sized=sized, part="wall")
            or 0.0,
            "at_throughput_s": m.total(
                "firsttoken_long_lane_only_seconds_total", sized=sized, part="at_throughput"
            )
            or 0.0,
        }
    for labels, seconds in m.by_name.get("firsttoken_first_token_engine_seconds_total", []):
        o.first_token_engine_s.setdefault(labels.get("images", "all"), {})[
            labels.get("part", "")
        ] = seconds
    o.image_budget_lowered = m.total("firsttoken_image_budget_lowered_total")
    if m.has("firsttoken_rejections_total"):
        o.refused_over_slo = m.total("firsttoken_rejections_total", reason="over_slo")


def _classes_from_stats(stats: dict[str, Any]) -> dict[str, ClassTiming]:
    out = {}
    for cls, body in stats.get("classes", {}).items():
        ttft = body.get("ttft_s") or {}
        phases = {p: (body.get(f"{p}_s") or {}).get("mean") or 0.0 for p in PHASES}
        out[cls] = ClassTiming(int(body.get("count", 0)), ttft.get("p50"), ttft.get("p95"), ttft.get("p99"),
                               ttft.get("mean"), phases)  # fmt: skip
    return out


def _classes_from_metrics(m: Samples) -> dict[str, ClassTiming]:
    ttft = "firsttoken_time_to_first_token_seconds"
    out = {}
    for cls in (*CLASSES, "all"):
        match = {} if cls == "all" else {"images": cls}
        n = m.total(f"{ttft}_count", **match) or 0
        if not n:
            continue
        phases = {
            p: (m.total("firsttoken_request_phase_seconds_sum", phase=p, **match) or 0.0) / n
            for p in PHASES
        }
        out[cls] = ClassTiming(int(n), m.quantile(ttft, 0.5, **match), m.quantile(ttft, 0.95, **match),
                               m.quantile(ttft, 0.99, **match), (m.total(f"{ttft}_sum", **match) or 0) / n,
                               phases)  # fmt: skip
    return out


# ---- vLLM ----------------------------------------------------------------------------------------
VLLM_CANNOT_SEE = [
    "vision-encoder time: vLLM counts it inside request_prefill_time (no encode phase)",
    "image preprocessing (decode, resize) time: it sits in TTFT outside queue and prefill ('other')",
    "per-class split (text / 1 image / 2+ images / video): vLLM's histograms carry no image-count label",
    "visual tokens per image: prompt tokens are not split into text and image",
    "short requests delayed by long work (vLLM has one queue; no lane labels)",
    "preemption reasons (num_preemptions_total has none)",
]


def _vllm(m: Samples) -> Observation:
    o = Observation(source="vllm")
    n = m.total("vllm:time_to_first_token_seconds_count") or 0
    if n:
        ttft_sum = m.total("vllm:time_to_first_token_seconds_sum") or 0.0
        queue = (m.total("vllm:request_queue_time_seconds_sum") or 0.0) / n
        prefill = (m.total("vllm:request_prefill_time_seconds_sum") or 0.0) / n
        q = "vllm:time_to_first_token_seconds"
        o.classes["all"] = ClassTiming(
            int(n), m.quantile(q, 0.5), m.quantile(q, 0.95), m.quantile(q, 0.99), ttft_sum / n,
            {"queue": queue, "prefill": prefill, "other": max(0.0, ttft_sum / n - queue - prefill)},
        )  # fmt: skip
    o.num_requests = int(m.total("vllm:request_success_total") or n)
    o.prompt_tokens_total = m.total("vllm:request_prompt_tokens_sum")
    o.prompt_tokens_mean = _ratio(
        o.prompt_tokens_total, m.total("vllm:request_prompt_tokens_count")
    )
    o.output_tokens_mean = _ratio(m.total("vllm:request_generation_tokens_sum"),
                                  m.total("vllm:request_generation_tokens_count"))  # fmt: skip
    usage = m.total("vllm:kv_cache_usage_perc")
    o.kv_usage_ratio = usage if usage is not None else m.total("vllm:gpu_cache_usage_perc")
    o.num_preemptions = m.total("vllm:num_preemptions_total")
    waiting = m.by_label("vllm:num_requests_waiting_by_reason", "reason")
    o.waiting_by_lane = {"all": m.total("vllm:num_requests_waiting") or 0.0}
    o.waiting_for_capacity = waiting.get("capacity")
    o.prefix_hit_tokens = m.total("vllm:prefix_cache_hits_total")
    o.prefix_query_tokens = m.total("vllm:prefix_cache_queries_total")
    o.encoder_cache_hits = m.total("vllm:mm_cache_hits_total")
    o.encoder_cache_queries = m.total("vllm:mm_cache_queries_total")
    o.e2e_total_s = m.total("vllm:e2e_request_latency_seconds_sum")
    info = m.first("vllm:cache_config_info")
    if info is not None:
        labels = info[0]
        o.prefix_cache_enabled = labels.get("enable_prefix_caching") == "True"
        try:
            o.kv_block_size = int(labels["block_size"])
            o.kv_blocks_total = float(labels["num_gpu_blocks"])
            o.kv_bytes_per_block = float(labels["kv_cache_memory_bytes"]) / o.kv_blocks_total
        except (KeyError, ValueError, ZeroDivisionError):
            pass
    o.cannot_see = list(VLLM_CANNOT_SEE)
    if o.encoder_cache_queries is None:
        o.cannot_see.append("multimodal (encoder) cache hits: no vllm:mm_cache_* metrics")
    return o


# ---- llama.cpp (llama-server --metrics) ----------------------------------------------------------
LLAMACPP_CANNOT_SEE = [
    ("TTFT and its percentiles: llama.cpp exports no latency histogram (--probe measures TTFT per class from "
     "the client)"),
    "per-class split (text / 1 image / 2+ images / video): no metric carries an image count",
    "phases (queue, image preprocessing, encode, prefill): only cumulative prompt and generation seconds",
    "vision-encoder time: an image's encode is counted inside prompt_seconds_total with its tokens' prefill",
    "visual tokens per image: prompt tokens are not split into text and image",
    "time queued: requests_deferred is a gauge at scrape time; no wait time is recorded",
    "KV cache usage and preemptions: this llama-server exports neither (its slots hold a fixed context each)",
]
# llama-server prints every value through a default C++ stream: %g, 6 significant digits
_SIGNIFICANT_DIGITS = 6


def _llamacpp(m: Samples) -> Observation:
    o = Observation(source="llamacpp")
    computed = m.total("llamacpp:prompt_tokens_total") or 0.0
    cached = m.total("llamacpp:prompt_tokens_cached_total")
    generated = m.total("llamacpp:tokens_predicted_total") or 0.0
    o.num_requests = _llamacpp_requests(m)
    o.throughput = Throughput(
        computed, m.total("llamacpp:prompt_seconds_total") or 0.0,
        generated, m.total("llamacpp:tokens_predicted_seconds_total") or 0.0,
        m.total("llamacpp:n_decode_total"), m.total("llamacpp:n_busy_slots_per_decode"),
        None if o.num_requests is None else generated - o.num_requests,
    )  # fmt: skip
    o.prompt_tokens_total = computed + (cached or 0.0)
    if o.num_requests:
        o.prompt_tokens_mean = o.prompt_tokens_total / o.num_requests
        o.output_tokens_mean = generated / o.num_requests
    if cached is not None:
        o.prefix_hit_tokens, o.prefix_query_tokens = cached, o.prompt_tokens_total
    o.num_running = m.total("llamacpp:requests_processing")
    deferred = m.total("llamacpp:requests_deferred")
    o.waiting_by_lane = {"all": deferred} if deferred is not None else {}
    o.cannot_see = list(LLAMACPP_CANNOT_SEE)
    if o.num_requests is None:
        o.cannot_see.insert(0, "requests served: llama.cpp exports no request counter, and this scrape's rate "
                               "window does not start at the server's start (another scrape reset it)")  # fmt: skip
    return o


def _llamacpp_requests(m: Samples) -> int | None:
    """Requests finished with at least one token, or None when the page cannot tell.

    llama.cpp counts a request's first generated token as free (it comes from the prompt's logits),
    so generated tokens - generation steps = finished requests. Steps are exported only as a rate,
    steps / seconds over the window since the previous /metrics scrape; when that window covers the
    server's whole life, steps = rate x tokens_predicted_seconds_total. The prompt side proves it:
    there steps == tokens, so prompt rate x prompt_seconds_total must give prompt_tokens_total back.
    Both products carry the rounding of 6 significant digits; an answer is given only when it is
    exact to the request."""
    tokens = m.total("llamacpp:prompt_tokens_total")
    prompt_s = m.total("llamacpp:prompt_seconds_total")
    prompt_rate = m.total("llamacpp:prompt_tokens_seconds")
    generated = m.total("llamacpp:tokens_predicted_total")
    gen_s = m.total("llamacpp:tokens_predicted_seconds_total")
    gen_rate = m.total("llamacpp:predicted_tokens_seconds")
    if None in (tokens, prompt_s, prompt_rate, generated, gen_s, gen_rate):
        return None
    if not generated:
        return 0
    # two rounded factors, each off by <= half a unit of the 6th
    rel = 2 * 0.5 * 10 ** (1 - _SIGNIFICANT_DIGITS)
    if abs(prompt_rate * prompt_s - tokens) > rel * tokens + 0.5:
        return None  # the rate window started after the server did
    steps = gen_rate * gen_s
    if rel * steps >= 0.5:
        return None  # too many steps to round to the exact count
    return round(generated - steps)
