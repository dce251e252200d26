"""Cumulative histograms as plain data (bucket upper bounds + counts); the Prometheus exporter reads
them.

Bounds follow Prometheus' convention: a value lands in the first bucket whose upper bound is >= the
value, and the implicit last bucket is +Inf. Observing is a bisect and two adds, cheap enough for
any thread that already holds the owner's lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# Seconds. Resolves 50 ms (text-only TTFT, inter-token latency) and 150 s (a queue behind image
# prefills).
TIME_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 15.0, 25.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 600.0,
)  # fmt: skip
# Token counts per request or per step: powers of two up to 128k (a 4k-visual-token image is ~2^12).
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(0, 18))
# predicted / actual: 1 is a perfect prediction; resolves +-5% around it and 4x either way, with
# edges at +-15% and +-35% (the prediction targets: |predicted - actual| / actual within 15% at the
# median, 35% at P90).
RATIO_BUCKETS: tuple[float, ...] = (
    0.25,
    0.5,
    0.65,
    0.8,
    0.85,
    0.9,
    0.95,
    1.0,
    1.05,
    1.1,
    1.15,
    1.25,
    1.35,
    1.5,
    2.0,
    4.0,
)


class Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("bounds must be strictly increasing")
        self.bounds: tuple[float, ...] = tuple(bounds)
        self.counts: list[int] = [0] * (len(self.bounds) + 1)  # last slot: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper bound, observations <= bound)], ending with (inf, count)."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append((bound, running))
        return out

    def copy(self) -> "Histogram":
        h = Histogram.__new__(Histogram)
        h.bounds, h.counts, h.sum, h.count = self.bounds, list(self.counts), self.sum, self.count
        return h
