"""P50/P95/P99 of TTFT and each of its phases over a sliding time window, per image class and
overall, with how far the admission-time TTFT prediction was off (|predicted - measured| / measured,
P50 and P90).

The window holds one small entry per finished request (no prompt, no tokens) for ``window_s``
seconds of the injected clock, capped at ``max_entries``. Percentiles are nearest-rank on the
entries present at snapshot time: P99 of 10 values is the largest; no interpolation, so every number
reported is a latency a real request had. ``snapshot()`` is what ``GET /stats`` returns (plus live
engine gauges added by the API layer).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

PHASES: tuple[str, ...] = ("preprocess", "queue", "encode", "prefill", "sample", "send")
# Per-request latencies the window reports; the phases add up to ttft_s. tpot_s: the request's time
# per output token after the first (the mean gap between its streamed tokens: the reading speed it
# got; absent with one token).
LATENCY_KEYS: tuple[str, ...] = ("ttft_s", *(f"{p}_s" for p in PHASES), "e2e_s", "tpot_s")
IMAGE_CLASSES: tuple[str, ...] = ("0", "1", "2+", "video")
QUANTILES: tuple[tuple[str, float], ...] = (("p50", 50.0), ("p95", 95.0), ("p99", 99.0))


def image_class(num_images: int, num_videos: int = 0) -> str:
    """A request's class in metrics: by its images ("0", "1", "2+"), or "video" when it carries any
    video."""
    if num_videos:
        return "video"
    return "0" if num_images == 0 else ("1" if num_images == 1 else "2+")


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of already sorted values; None when there are none."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass(frozen=True)
class WindowEntry:
    t_s: float  # the window clock when the request was recorded
    image_class: str
    # LATENCY_KEYS present for this request (ttft missing if none came)
    latencies_s: Mapping[str, float]
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_encoder_cache_hits: int
    num_images_encoded: int
    # |predicted - measured| / measured TTFT; None: no prediction
    ttft_prediction_error: float | None = None
    # the TTFT objective lowered this request's visual-token budget
    image_budget_lowered: bool = False


class SlidingWindow:
    def __init__(
        self,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 200_000,
    ) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self.clock = clock
        self._entries: deque[WindowEntry] = deque(maxlen=max_entries)
        # ever added: a snapshot's "seq"; the first seq entries of the request log
        self.num_added = 0

    def add(self, entry: WindowEntry) -> None:
        self._entries.append(entry)
        self.num_added += 1

    def _expire(self) -> None:
        horizon = self.clock() - self.window_s
        while self._entries and self._entries[0].t_s < horizon:
            self._entries.popleft()

    def snapshot(self) -> dict:
        self._expire()
        entries = list(self._entries)
        classes = {"all": _summary(entries)}
        for c in IMAGE_CLASSES:
            classes[c] = _summary([e for e in entries if e.image_class == c])
        return {"window_s": self.window_s, "seq": self.num_added, "classes": classes}


def _summary(entries: list[WindowEntry]) -> dict:
    out: dict = {"count": len(entries)}
    for key in LATENCY_KEYS:
        values = sorted(e.latencies_s[key] for e in entries if e.latencies_s.get(key) is not None)
        stats: dict[str, float | None] = {name: percentile(values, q) for name, q in QUANTILES}
        stats["mean"] = sum(values) / len(values) if values else None
        stats["n"] = len(values)
        out[key] = stats
    prompt = sum(e.num_prompt_tokens for e in entries)
    hits = sum(e.num_encoder_cache_hits for e in entries)
    lookups = hits + sum(e.num_images_encoded for e in entries)
    out["prefix_cache_hit_rate"] = (
        sum(e.num_cached_prompt_tokens for e in entries) / prompt if prompt else None
    )
    out["encoder_cache_hit_rate"] = hits / lookups if lookups else None
    errors = sorted(e.ttft_prediction_error for e in entries if e.ttft_prediction_error is not None)
    out["ttft_prediction_error"] = {
        "n": len(errors),
        "p50": percentile(errors, 50.0),
        "p90": percentile(errors, 90.0),
    }
    out["image_budget_lowered"] = sum(e.image_budget_lowered for e in entries)
    return out
