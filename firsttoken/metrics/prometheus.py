"""The Prometheus exporter: a collector that turns a Recorder snapshot and an EngineSnapshot into
metric families at scrape time. It is the only module that imports prometheus_client; the engine
never sees it.

One registry per app (``make_registry``), so two servers in one process (tests) never share series.
Names are ``firsttoken_*`` with unit suffixes; per-request histograms carry ``lane`` and ``images``,
the request class (window.IMAGE_CLASSES: 0 | 1 | 2+ images, or video for a request with any video).
Beside them, four ``vllm:*`` gauges with vLLM's names and meanings, for gateways that route on them
(``VllmCompatCollector``). The full list with meanings is in docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from firsttoken.metrics.histogram import Histogram
from firsttoken.metrics.recorder import DISCONNECT_STAGES, Recorder, RecorderSnapshot
from firsttoken.metrics.stats import EngineSnapshot

REQUEST_LABELS = ["lane", "images"]
# The scheduler's reasons (scheduler.py _preempt), exported at 0 before the first one so alerts have
# a series.
PREEMPTION_REASONS = ("decode_growth", "prefill_growth")
# Why the server aborted running requests (engine/async_engine.py), exported at 0 before the first
# one.
ABORT_REASONS = ("client_not_reading",)

# (snapshot field, metric name, help) for the per-request histograms labelled by lane and images.
_REQUEST_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("ttft_s", "firsttoken_time_to_first_token_seconds",
     "Arrival to the first content byte handed to the transport (the sum of the phases)."),
    ("itl_s", "firsttoken_inter_token_latency_seconds", "Time between consecutive output tokens of a request."),
    ("e2e_s", "firsttoken_e2e_request_latency_seconds", "Arrival to the engine finishing the request (never before its first byte)."),
    ("prompt_tokens", "firsttoken_request_prompt_tokens", "Prompt tokens per request, visual tokens included."),
    ("visual_tokens", "firsttoken_request_visual_tokens", "Visual (image and video) tokens per request."),
    ("output_tokens", "firsttoken_request_generation_tokens", "Generated tokens per request."),
)  # fmt: skip


def _histogram(
    name: str, doc: str, labels: list[str], series: dict[tuple[str, ...], Histogram]
) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=labels)
    for key, h in sorted(series.items()):
        buckets = [(floatToGoString(bound), n) for bound, n in h.cumulative()]
        family.add_metric(list(key), buckets, h.sum)
    return family


def _counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(name, doc, value=value)


def _gauge_by(
    name: str, documentation: str, label: str, values: dict[str, float]
) -> GaugeMetricFamily:
    """One gauge family with a sample per key of ``values``, labelled ``label``."""
    family = GaugeMetricFamily(name, documentation, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


def _gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(name, doc, value=value)


def _long_lane_only(by_size: dict[str, dict[str, float]]) -> Iterator[Metric]:
    """The steps in which the long lane had prefill work and the short lane none, by how they were
    sized."""
    steps = CounterMetricFamily(
        "firsttoken_long_lane_only_steps",
        "Steps in which the long lane had prefill work and the short lane none, "
        "by sizing: throughput (the lane's speed alone) or bounded (a step-time bound, a pace or token budgets).",
        labels=["sized"],
    )
    seconds = CounterMetricFamily(
        "firsttoken_long_lane_only_seconds",
        "Of those steps: wall seconds (part=wall), and the seconds their work "
        "would take in throughput steps by the step-cost model (part=at_throughput); wall above it is the long lane "
        "running below its throughput.",
        labels=["sized", "part"],
    )
    for sized, v in sorted(by_size.items()):
        steps.add_metric([sized], v["steps"])
        seconds.add_metric([sized, "wall"], v["wall_s"])
        seconds.add_metric([sized, "at_throughput"], v["at_throughput_s"])
    yield steps
    yield seconds


class FirsttokenCollector:
    def __init__(self, recorder: Recorder, engine: Callable[[], EngineSnapshot]) -> None:
        self.recorder = recorder
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families are built at scrape time

    def collect(self) -> Iterator[Metric]:
        s = self.recorder.snapshot()
        yield from _request_families(s)
        yield from _step_families(s)
        yield from _first_token_families(s)
        g = self.engine()
        yield from _engine_gauges(g)
        yield from _engine_learning(g)


class VllmCompatCollector:
    """The gauges a Kubernetes inference gateway reads from vLLM pods, with vLLM's names, labels and
    meanings, so the Gateway API Inference Extension's endpoint picker and llm-d schedule firsttoken
    pods unchanged:

        vllm:num_requests_waiting   requests queued in the scheduler, not yet admitted (every lane; vLLM: waiting)
        vllm:num_requests_running   requests in the running batch, prefilling or decoding (vLLM: running)
        vllm:kv_cache_usage_perc    KV blocks held by live requests / all blocks, 0..1 (cached, unreferenced blocks
                                    are evictable and count as free, as in vLLM's BlockPool.get_usage)
        vllm:gpu_cache_usage_perc   the same value under the name vLLM used before 0.10 (older gateways read it)
        vllm:cache_config_info      1, labelled block_size and num_gpu_blocks (the pool, whatever the device): what a
                                    prefix-cache-aware endpoint picker reads to hash prompts in the server's blocks

    Labels as vLLM's: ``model_name`` (the served model name) and ``engine`` ("0": one engine per
    server)."""

    def __init__(self, engine: Callable[[], EngineSnapshot], model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        g = self.engine()
        labels = ["engine", "model_name"]
        values = ["0", self.model_name]
        for name, doc, value in (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                g.num_running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                sum(g.num_queued_by_lane.values()),
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                g.kv_usage_ratio,
            ),
            (
                "vllm:gpu_cache_usage_perc",
                "KV-cache usage (vLLM's name before 0.10). 1 means 100 percent usage.",
                g.kv_usage_ratio,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "engine", "num_gpu_blocks"],
        )
        info.add_metric([str(g.block_size), "0", str(g.kv_blocks_total)], 1.0)
        yield info


def make_registry(recorder: Recorder, engine: Callable[[], EngineSnapshot],
                  model_name: str = "firsttoken") -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FirsttokenCollector(recorder, engine))
    registry.register(VllmCompatCollector(engine, model_name))
    ProcessCollector(registry=registry)
    return registry


def _request_families(s: RecorderSnapshot) -> Iterator[Metric]:
    """Per request: TTFT and its phases, outcomes, refusals, aborts, disconnects, tokens."""
    for field, name, doc in _REQUEST_HISTOGRAMS:
        yield _histogram(name, doc, REQUEST_LABELS, getattr(s.hist, field))
    yield _histogram(
        "firsttoken_request_phase_seconds",
        "Each TTFT phase (preprocess, queue, encode, prefill, sample, send); per request they add up to TTFT.",
        [*REQUEST_LABELS, "phase"],
        s.hist.phase_s,
    )

    requests = CounterMetricFamily(
        "firsttoken_requests", "Requests the engine finished, by outcome (stop, length, abort, error).",
        labels=[*REQUEST_LABELS, "outcome"],
    )  # fmt: skip
    for key, n in sorted(s.requests.items()):
        requests.add_metric(list(key), n)
    yield requests
    rejections = CounterMetricFamily(
        "firsttoken_rejections",
        "Requests answered with a 4xx before generating, by reason.",
        labels=["reason"],
    )
    # over_slo: alertable from zero
    for reason, n in sorted({"over_slo": 0, **s.rejections}.items()):
        rejections.add_metric([reason], n)
    yield rejections
    aborts = CounterMetricFamily(
        "firsttoken_requests_aborted", "Running requests the server aborted, by reason (client_not_reading: "
        "the client left --max-unread-outputs outputs unread).", labels=["reason"],
    )  # fmt: skip
    for reason, n in sorted({**dict.fromkeys(ABORT_REASONS, 0), **s.aborts}.items()):
        aborts.add_metric([reason], n)
    yield aborts
    disconnects = CounterMetricFamily(
        "firsttoken_client_disconnects", "Clients that left before their answer was complete, by stage (body: "
        "while sending the request body; answer: while it was generated or streamed). Not errors.",
        labels=["stage"],
    )  # fmt: skip
    for stage, n in sorted(
        {**dict.fromkeys(DISCONNECT_STAGES, 0), **s.client_disconnects}.items()
    ):
        disconnects.add_metric([stage], n)
    yield disconnects
    c = s.counters
    yield _counter(
        "firsttoken_prompt_tokens", "Prompt tokens of finished requests.", c["prompt_tokens"]
    )
    yield _counter(
        "firsttoken_generation_tokens",
        "Generated tokens of finished requests.",
        c["generation_tokens"],
    )


def _step_families(s: RecorderSnapshot) -> Iterator[Metric]:
    """Per engine step: counts, tokens, vision-tower work, busy time, durations, the cost model's error."""
    c = s.counters
    yield _counter("firsttoken_engine_steps", "Engine steps run.", c["steps"])
    yield _counter("firsttoken_step_prefill_tokens", "Prefill tokens scheduled across steps.",
                   c["scheduled_prefill_tokens"])  # fmt: skip
    yield _counter("firsttoken_step_decode_tokens", "Decode tokens scheduled across steps.",
                   c["scheduled_decode_tokens"])  # fmt: skip
    yield _counter("firsttoken_step_encoder_images", "Images encoded by the vision tower, summed over steps.",
                   c["encoder_images"])  # fmt: skip
    yield _counter(
        "firsttoken_step_encoder_seconds",
        "Seconds spent in the vision tower.",
        c["encoder_seconds"],
    )
    yield _counter(
        "firsttoken_step_busy_seconds",
        "Seconds the engine spent inside steps.",
        c["step_seconds"],
    )
    yield _histogram("firsttoken_step_scheduled_tokens", "Tokens (prefill + decode) scheduled per step.", [],
                     {(): s.step_tokens})  # fmt: skip
    yield _histogram("firsttoken_step_duration_seconds", "Wall time of one engine step.", [],
                     {(): s.step_duration_s})  # fmt: skip
    yield _histogram("firsttoken_step_time_prediction_ratio", "The step-cost model's predicted / actual step "
                     "time (1 = exact).", [], {(): s.step_prediction_ratio})  # fmt: skip


def _first_token_families(s: RecorderSnapshot) -> Iterator[Metric]:
    """Where first tokens' engine time went, the TTFT prediction's error, budgets lowered, grammars."""
    c = s.counters
    parts = CounterMetricFamily(
        "firsttoken_first_token_engine_seconds", "Seconds from each answered request's end of preprocessing "
        "to its first token, by part: handoff (until the engine thread took it), encoder (its vision-tower "
        "work), forward (forwards carrying its "
        "chunks), step_overhead (the rest of its steps), other_steps (steps without its work), idle (between "
        "steps); per request class (images: 0, 1, 2+ or video).", labels=["images", "part"],
    )  # fmt: skip
    for (images, part), seconds in sorted(s.first_token_engine_s.items()):
        parts.add_metric([images, part], seconds)
    yield parts
    yield _histogram(
        "firsttoken_ttft_prediction_ratio",
        "Predicted TTFT at admission / measured TTFT, per request class (1 = exact).",
        ["images"],
        {(k,): h for k, h in s.ttft_prediction_ratio.items()},
    )
    yield _counter("firsttoken_image_budget_lowered", "Requests whose visual-token budget was lowered to meet "
                   "their TTFT objective (--ttft-slo).", c["image_budget_lowered"])  # fmt: skip
    yield _counter("firsttoken_constrained_requests", "Requests whose output was held to a grammar "
                   "(response_format, structured_outputs).", c["constrained_requests"])  # fmt: skip
    yield _counter("firsttoken_grammar_cache_hits", "Constrained requests whose grammar was compiled "
                   "already (a repeated schema costs nothing).", c["grammar_cache_hits"])  # fmt: skip
    yield _histogram(
        "firsttoken_grammar_compile_seconds",
        "Compiling a constrained request's output grammar, "
        "in preprocessing before it queued (a cached grammar counts 0).",
        [],
        {(): s.grammar_compile_s},
    )


def _engine_gauges(g: EngineSnapshot) -> Iterator[Metric]:
    """The engine now: KV blocks, running and queued requests, the encoder cache, preemptions, lanes."""
    yield _gauge(
        "firsttoken_kv_cache_used_blocks",
        "KV blocks referenced by live requests.",
        g.kv_blocks_used,
    )
    yield _gauge(
        "firsttoken_kv_cache_capacity_blocks", "KV blocks in the pool.", g.kv_blocks_total
    )
    yield _gauge(
        "firsttoken_kv_cache_usage_ratio",
        "Used / capacity KV blocks (1 = full).",
        g.kv_usage_ratio,
    )
    yield _gauge("firsttoken_requests_running", "Requests in the running batch.", g.num_running)
    queued = GaugeMetricFamily("firsttoken_requests_queued", "Requests waiting for admission, per lane.",
                               labels=["lane"])  # fmt: skip
    for lane, n in sorted(g.num_queued_by_lane.items()):
        queued.add_metric([lane], n)
    yield queued
    yield _gauge(
        "firsttoken_encoder_cache_bytes",
        "Bytes of vision-encoder outputs held.",
        g.encoder_cache_bytes,
    )
    preemptions = CounterMetricFamily(
        "firsttoken_preemptions", "Running requests preempted (KV dropped, recomputed later), by reason.",
        labels=["reason"],
    )  # fmt: skip
    for reason, n in sorted(
        {**dict.fromkeys(PREEMPTION_REASONS, 0), **g.preemptions_by_reason}.items()
    ):
        preemptions.add_metric([reason], n)
    yield preemptions
    yield _counter("firsttoken_short_requests_delayed_by_long",
                   "Short-lane requests that sat out a whole step while long work held it (the scheduler "
                   "counts it; sharing a step is normal, waiting behind it is not).",
                   g.num_short_delayed_by_long)  # fmt: skip
    yield _counter("firsttoken_encoder_interrupts",
                   "Steps whose long-lane vision-tower work stopped at an encoder unit because a short request "
                   "arrived (it runs next step; the image resumes after it).",
                   g.num_encoder_interrupts)  # fmt: skip
    yield from _long_lane_only(g.long_lane_only)


def _engine_learning(g: EngineSnapshot) -> Iterator[Metric]:
    """Caches' hits, the step-cost model and TTFT bias as learnt, the step and pace targets."""
    yield _counter("firsttoken_encoder_cache_hits", "Images whose vision-encoder output was reused.",
                   g.encoder_cache_hits)  # fmt: skip
    yield _counter("firsttoken_encoder_cache_misses", "Images that had to go through the vision tower.",
                   g.encoder_cache_misses)  # fmt: skip
    yield _counter("firsttoken_prefix_cache_hit_tokens", "Prompt tokens served from the KV prefix cache.",
                   g.prefix_cache_hit_tokens)  # fmt: skip
    yield _counter("firsttoken_prefix_cache_query_tokens", "Prompt tokens looked up in the KV prefix cache.",
                   g.prefix_cache_query_tokens)  # fmt: skip
    yield _gauge_by(
        "firsttoken_step_cost_coefficient",
        "The step-cost model's seconds per unit of each term "
        "(step, sequences, sampled, prefill_tokens, prefill_attention, decode_tokens, decode_context, "
        "encoder_patches, encoder_attention).",
        "term",
        g.cost_model,
    )
    yield _gauge_by(
        "firsttoken_ttft_prediction_bias",
        "The factor predicted TTFTs of each class (by number of "
        "images: 0, 1, 2+) are multiplied by, learnt online from measured first tokens (1: no "
        "correction).",
        "images",
        g.ttft_bias,
    )
    if g.step_time_target_s is not None:
        yield _gauge(
            "firsttoken_step_time_target_seconds",
            "The step-time bound the scheduler fills steps to.",
            g.step_time_target_s,
        )
    if g.itl_target_s is not None:
        yield _gauge(
            "firsttoken_itl_target_seconds",
            "The pace per output token (--itl-target) the scheduler "
            "bounds steps that carry decodes to.",
            g.itl_target_s,
        )
