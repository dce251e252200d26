"""The one sink for metrics data: the engine's StatsObserver plus the HTTP layer's completion of
each request.

Two threads feed it, and both only append under one lock:

- the engine thread calls ``on_step`` (aggregated at once: a few adds and two bisects) and
  ``on_finished`` (parked in ``_pending``, nothing else);
- the HTTP layer calls ``complete(request_id, timeline, ...)`` once the response has been handed to
  the transport. Only then is ``first_byte_s`` marked (a non-streaming response is built after the
  engine finished it), so a request's record, with TTFT up to the first byte and its ``send`` phase,
  is made here from the live timeline and the parked FinishedRequest (outcome, lane, sizes).

A parked request the HTTP layer never completes is recorded from the engine's own timings (TTFT up
to the first token, send = 0) by ``flush``: aborts and errors at once, stop/length after ``grace_s``
(a client that vanished after the last token). ``flush`` runs on every completion, scrape and /stats
read.

Each record updates the histograms and counters the exporter reads, the /stats window and the
request log.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from firsttoken.metrics.histogram import RATIO_BUCKETS, TIME_BUCKETS_S, TOKEN_BUCKETS, Histogram
from firsttoken.metrics.stats import FinishedRequest, StepStats
from firsttoken.metrics.window import (
    IMAGE_CLASSES,
    LATENCY_KEYS,
    PHASES,
    SlidingWindow,
    WindowEntry,
    image_class,
)

DEFAULT_LANE = "default"
# Where a client left before its answer was complete: while sending its request body | while its
# answer was made or streamed (the HTTP layer tells: api/middleware.py client_left)
DISCONNECT_STAGES = ("body", "answer")
# Outcomes whose record cannot gain anything from the HTTP layer: recorded at the next flush.
_FINAL_AT_ENGINE = frozenset({"abort", "error"})


@dataclass(frozen=True)
class RequestRecord:
    """One finished request as the request log writes it (no prompt text, no image bytes)."""

    request_id: str
    # X-Request-Id of the HTTP exchange, when the HTTP layer completed it
    http_request_id: str | None
    finished_unix_s: float
    outcome: str  # stop | length | abort | error
    lane: str
    images: str  # request class (window.IMAGE_CLASSES): 0 | 1 | 2+ images, or video (any video)
    num_images: int  # vision items: images and video grids
    num_prompt_tokens: int
    num_image_tokens: int
    num_output_tokens: int
    timings: Mapping[str, float | int | None]  # Timeline.to_dict()
    # seconds between consecutive output tokens (inter-token latency)
    token_gaps_s: tuple[float, ...] = ()
    num_videos: int = 0

    @property
    def itl_mean_s(self) -> float | None:
        """Its time per output token after the first (the mean gap between its streamed tokens)."""
        return sum(self.token_gaps_s) / len(self.token_gaps_s) if self.token_gaps_s else None

    def log_line(self) -> dict:
        return {
            "request_id": self.request_id,
            "http_request_id": self.http_request_id,
            "finished_unix_s": self.finished_unix_s,
            "outcome": self.outcome,
            "lane": self.lane,
            "images": self.images,
            "num_images": self.num_images,
            "num_videos": self.num_videos,
            "prompt_tokens": self.num_prompt_tokens,
            "visual_tokens": self.num_image_tokens,
            "output_tokens": self.num_output_tokens,
            "itl_mean_s": self.itl_mean_s,
            "timings": dict(self.timings),
        }


@dataclass
class LabelledHistograms:
    """Histograms by (lane, images[, phase]) plus the per-request counters, as copies for an
    exporter."""

    ttft_s: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    phase_s: dict[tuple[str, str, str], Histogram] = field(default_factory=dict)
    itl_s: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    e2e_s: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    prompt_tokens: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    visual_tokens: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    output_tokens: dict[tuple[str, str], Histogram] = field(default_factory=dict)


@dataclass
class RecorderSnapshot:
    """Everything an exporter needs, copied under the lock."""

    hist: LabelledHistograms
    requests: dict[tuple[str, str, str], int]  # (lane, images, outcome) -> count
    rejections: dict[str, int]  # reason -> count
    # reason -> count: requests the server aborted mid-generation (e.g. client_not_reading)
    aborts: dict[str, int]
    # stage (body | answer) -> clients that left before their answer was complete
    client_disconnects: dict[str, int]
    counters: dict[str, float]  # name -> value (tokens, steps, encoder work)
    step_tokens: Histogram
    step_duration_s: Histogram
    last_step: StepStats | None
    step_prediction_ratio: Histogram  # the step-cost model's predicted / actual step time
    ttft_prediction_ratio: dict[str, Histogram]  # image class -> predicted / actual TTFT
    # (image class, part) -> seconds, over answered requests
    first_token_engine_s: dict[tuple[str, str], float]
    # constrained requests' output-grammar compiles (a cached grammar: 0)
    grammar_compile_s: Histogram


class Recorder:
    """Implements StatsObserver (engine thread) and the HTTP layer's side (``complete``,
    ``on_rejected``, ``on_client_disconnect``)."""

    def __init__(
        self,
        window_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        sink: Callable[[RequestRecord], None] | None = None,
        grace_s: float = 30.0,
        max_pending: int = 10_000,
    ) -> None:
        self.clock = clock
        self.window = SlidingWindow(window_s, clock)
        self.sink = sink
        self.grace_s = grace_s
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, tuple[FinishedRequest, float]] = OrderedDict()
        self._hist = LabelledHistograms()
        self._requests: dict[tuple[str, str, str], int] = {}
        self._rejections: dict[str, int] = {}
        self._aborts: dict[str, int] = {}
        self._client_disconnects: dict[str, int] = {}
        self._counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._step_tokens = Histogram(TOKEN_BUCKETS)
        self._step_duration_s = Histogram(TIME_BUCKETS_S)
        self._last_step: StepStats | None = None
        self._step_ratio = Histogram(RATIO_BUCKETS)
        self._grammar_compile_s = Histogram(TIME_BUCKETS_S)
        self._ttft_ratio: dict[str, Histogram] = {
            c: Histogram(RATIO_BUCKETS) for c in IMAGE_CLASSES
        }
        self._first_token_engine_s = {(c, p): 0.0 for c in IMAGE_CLASSES for p in FIRST_TOKEN_PARTS}

    # ---- engine thread ---------------------------------------------------------------------------
    def on_step(self, stats: StepStats) -> None:
        with self._lock:
            c = self._counters
            c["steps"] += 1
            c["scheduled_prefill_tokens"] += stats.num_prefill_tokens
            c["scheduled_decode_tokens"] += stats.num_decode_tokens
            c["encoder_images"] += stats.num_images_encoded
            c["encoder_seconds"] += stats.encoder_s
            c["step_seconds"] += stats.duration_s
            self._step_tokens.observe(stats.num_prefill_tokens + stats.num_decode_tokens)
            self._step_duration_s.observe(stats.duration_s)
            if stats.predicted_s is not None and stats.duration_s > 0:
                self._step_ratio.observe(stats.predicted_s / stats.duration_s)
            self._last_step = stats

    def on_finished(self, request: FinishedRequest) -> None:
        with self._lock:
            self._pending[request.request_id] = (request, self.clock())

    # ---- HTTP layer ------------------------------------------------------------------------------
    def complete(
        self,
        request_id: str,
        timings: Mapping[str, float | int | None],
        token_gaps_s: Sequence[float] = (),
        http_request_id: str | None = None,
    ) -> RequestRecord | None:
        """The response for ``request_id`` has been sent: record it with the final ``timings``.
        Returns None when the engine has not finished the request (it will be flushed from its own
        data)."""
        with self._lock:
            parked = self._pending.pop(request_id, None)
            if parked is not None:
                record = _record_of(parked[0], timings, tuple(token_gaps_s), http_request_id)
                self._record(record)
            else:
                record = None
            self._flush_locked()
        return record

    def on_rejected(self, reason: str) -> None:
        with self._lock:
            self._rejections[reason] = self._rejections.get(reason, 0) + 1

    def on_aborted(self, request_id: str, reason: str) -> None:
        """The server aborted a running request for ``reason`` (its outcome is recorded as "abort"
        as usual)."""
        with self._lock:
            self._aborts[reason] = self._aborts.get(reason, 0) + 1

    def on_client_disconnect(self, stage: str) -> None:
        """A client left at ``stage`` (DISCONNECT_STAGES) before its answer was complete."""
        with self._lock:
            self._client_disconnects[stage] = self._client_disconnects.get(stage, 0) + 1

    # ---- readers ---------------------------------------------------------------------------------
    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def window_snapshot(self) -> dict:
        with self._lock:
            self._flush_locked()
            return self.window.snapshot()

    def snapshot(self) -> RecorderSnapshot:
        with self._lock:
            self._flush_locked()
            h = self._hist
            hist = LabelledHistograms(
                **{
                    name: {k: v.copy() for k, v in getattr(h, name).items()}
                    for name in h.__dataclass_fields__
                }
            )
            return RecorderSnapshot(
                hist=hist,
                requests=dict(self._requests),
                rejections=dict(self._rejections),
                aborts=dict(self._aborts),
                client_disconnects=dict(self._client_disconnects),
                counters=dict(self._counters),
                step_tokens=self._step_tokens.copy(),
                step_duration_s=self._step_duration_s.copy(),
                last_step=self._last_step,
                step_prediction_ratio=self._step_ratio.copy(),
                ttft_prediction_ratio={c: h.copy() for c, h in self._ttft_ratio.items()},
                first_token_engine_s=dict(self._first_token_engine_s),
                grammar_compile_s=self._grammar_compile_s.copy(),
            )

    # ---- internals (lock held) -------------------------------------------------------------------
    def _flush_locked(self) -> None:
        now = self.clock()
        for rid in list(self._pending):
            fr, parked_at = self._pending[rid]
            overflow = len(self._pending) > self.max_pending
            if fr.outcome in _FINAL_AT_ENGINE or now - parked_at >= self.grace_s or overflow:
                del self._pending[rid]
                self._record(_record_of(fr, fr.timings, (), None))

    def _histograms_for(self, lane: str, images: str) -> tuple[Histogram, ...]:
        h = self._hist
        key = (lane, images)
        if key not in h.ttft_s:
            h.ttft_s[key] = Histogram(TIME_BUCKETS_S)
            h.itl_s[key] = Histogram(TIME_BUCKETS_S)
            h.e2e_s[key] = Histogram(TIME_BUCKETS_S)
            h.prompt_tokens[key] = Histogram(TOKEN_BUCKETS)
            h.visual_tokens[key] = Histogram(TOKEN_BUCKETS)
            h.output_tokens[key] = Histogram(TOKEN_BUCKETS)
            for p in PHASES:
                h.phase_s[(lane, images, p)] = Histogram(TIME_BUCKETS_S)
            # once a lane is seen, all its classes show 0 rather than "no data"
            for c in IMAGE_CLASSES:
                if c != images:
                    self._histograms_for(lane, c)
            for outcome in ("stop", "length", "abort", "error"):
                self._requests.setdefault((lane, images, outcome), 0)
        return h.ttft_s[key], h.itl_s[key], h.e2e_s[key], h.prompt_tokens[key], h.visual_tokens[key]

    def _record(self, r: RequestRecord) -> None:
        ttft, itl, e2e, prompt, visual = self._histograms_for(r.lane, r.images)
        t = r.timings
        answered = t.get("ttft_s") is not None
        if answered:
            ttft.observe(float(t["ttft_s"]))  # type: ignore[arg-type]
            for p in PHASES:
                self._hist.phase_s[(r.lane, r.images, p)].observe(float(t.get(f"{p}_s") or 0.0))
        if t.get("e2e_s") is not None:
            e2e.observe(float(t["e2e_s"]))  # type: ignore[arg-type]
        for gap in r.token_gaps_s:
            itl.observe(gap)
        prompt.observe(r.num_prompt_tokens)
        visual.observe(r.num_image_tokens)
        self._hist.output_tokens[(r.lane, r.images)].observe(r.num_output_tokens)
        key = (r.lane, r.images, r.outcome)
        self._requests[key] = self._requests.get(key, 0) + 1
        predicted = t.get("predicted_ttft_s")
        error = None
        if answered and isinstance(predicted, (int, float)) and float(t["ttft_s"]) > 0:  # type: ignore[arg-type]
            measured = float(t["ttft_s"])  # type: ignore[arg-type]
            self._ttft_ratio[r.images].observe(float(predicted) / measured)
            error = abs(float(predicted) - measured) / measured
        if answered:
            for part, key in FIRST_TOKEN_PARTS.items():
                self._first_token_engine_s[(r.images, part)] += float(t.get(key) or 0.0)  # type: ignore[arg-type]
        c = self._counters
        c["image_budget_lowered"] += int("image_budget" in t)
        if t.get("grammar_compile_s") is not None:
            self._grammar_compile_s.observe(float(t["grammar_compile_s"]))  # type: ignore[arg-type]
            c["constrained_requests"] += 1
            c["grammar_cache_hits"] += int(float(t["grammar_compile_s"]) == 0.0)  # type: ignore[arg-type]
        c["prompt_tokens"] += r.num_prompt_tokens
        c["generation_tokens"] += r.num_output_tokens
        latencies = {k: float(t[k]) for k in LATENCY_KEYS if t.get(k) is not None}  # type: ignore[arg-type]
        if r.token_gaps_s:
            latencies["tpot_s"] = r.itl_mean_s  # type: ignore[assignment]
        self.window.add(
            WindowEntry(
                t_s=self.clock(),
                image_class=r.images,
                latencies_s=latencies
                if answered
                else {k: v for k, v in latencies.items() if k == "e2e_s"},
                num_prompt_tokens=r.num_prompt_tokens,
                num_cached_prompt_tokens=int(t.get("cached_prompt_tokens") or 0),
                num_encoder_cache_hits=int(t.get("encoder_cache_hits") or 0),
                num_images_encoded=int(t.get("images_encoded") or 0),
                ttft_prediction_error=error,
                image_budget_lowered="image_budget" in t,
            )
        )
        if self.sink is not None:
            # same lock as the window: the log's first `seq` lines are the window's first entries
            self.sink(r)


# where the engine's time went before each first token (Timeline.to_dict's accounting): part ->
# timing key
FIRST_TOKEN_PARTS: dict[str, str] = {
    "handoff": "handoff_s",
    "encoder": "encoder_compute_s",
    "forward": "forward_s",
    "step_overhead": "step_overhead_s",
    "other_steps": "other_steps_s",
    "idle": "engine_idle_s",
}

COUNTERS: tuple[str, ...] = (
    "steps",
    "scheduled_prefill_tokens",
    "scheduled_decode_tokens",
    "encoder_images",
    "encoder_seconds",
    "step_seconds",
    "prompt_tokens",
    "generation_tokens",
    "image_budget_lowered",
    "constrained_requests",
    "grammar_cache_hits",
)


def ratio_summary(h: Histogram) -> dict[str, float | int | None]:
    """A predicted/actual histogram as {n, share within 15% of actual, share within 35%}: the share
    of observations in (0.85, 1.15] and (0.65, 1.35], both bucket edges, so the shares are exact."""
    total = h.count
    if not total:
        return {"n": 0, "within_15pct": None, "within_35pct": None}
    cum = dict(h.cumulative())

    def share(lo: float, hi: float) -> float:
        return (cum[hi] - cum[lo]) / total

    return {
        "n": total,
        "within_15pct": round(share(0.85, 1.15), 3),
        "within_35pct": round(share(0.65, 1.35), 3),
    }


def _record_of(
    fr: FinishedRequest,
    timings: Mapping[str, float | int | None],
    gaps: tuple[float, ...],
    http_request_id: str | None,
) -> RequestRecord:
    return RequestRecord(
        request_id=fr.request_id,
        http_request_id=http_request_id,
        finished_unix_s=time.time(),
        outcome=fr.outcome,
        lane=fr.lane,
        images=image_class(fr.num_images, fr.num_videos),
        num_images=fr.num_images,
        num_prompt_tokens=fr.num_prompt_tokens,
        num_image_tokens=fr.num_image_tokens,
        num_output_tokens=fr.num_output_tokens,
        timings=dict(timings),
        token_gaps_s=gaps,
        num_videos=fr.num_videos,
    )
