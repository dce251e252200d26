"""What the step being built has collected so far (``StepDraft``), and why a live request got nothing in it.

A draft exists while ``Scheduler.schedule`` builds one step and is kept until the next one, so ``wait_reason`` can
say, for any live request without work in it, which rule held it back. Plain data: ids, ints, predicted seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from firsttoken.batch import EncoderWork, ScheduledChunk
from firsttoken.scheduler.lanes import SHORT

# why a live request got no work in a step (wait_reason); "" is no reason at all: a request that can never progress
WAIT_REASONS = ("preempted", "max_num_seqs", "kv_blocks", "short_lane_first", "step_full", "image_encoding", "in_line")


@dataclass
class StepDraft:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    encoder_work: list[EncoderWork] = field(default_factory=list)
    worked_hashes: set[str] = field(default_factory=set)  # images advanced this step
    finishing_hashes: set[str] = field(default_factory=set)  # images whose last unit runs this step
    scheduled_ids: set[str] = field(default_factory=set)  # requests with a chunk or encoder work in this step
    has_long_work: bool = False
    has_short_prefill: bool = False  # a short request's prefill chunk is in this step
    long_held: bool = False  # the long lane had work but yielded this step to short prefills
    throughput: bool = False  # a lone request: sized for throughput, not bounded in time (pacing.py)
    full: bool = False  # the step's token budget or time bound was used up
    kv_blocked_ids: set[str] = field(default_factory=set)  # admissions refused for want of KV blocks
    preempted_ids: frozenset[str] = frozenset()
    decode_s: float = 0.0  # predicted seconds of this step's decodes, short prefills, long work (lane shares)
    short_s: float = 0.0
    long_s: float = 0.0
    # the interruptible encoder work's predicted seconds and its mean unit's (the runner runs it last in the step)
    cut_span: tuple[float, float] = (0.0, 0.0)
    in_flight_s: dict[str, float] = field(default_factory=dict)  # per request: predicted seconds of its work here

    @property
    def has_prefill(self) -> bool:
        return any(not c.is_decode for c in self.chunks)

    @property
    def predicted_s(self) -> float:
        """Its work's predicted seconds (no per-step constant); 0 when nothing priced it."""
        return self.decode_s + self.short_s + self.long_s

    def charge(self, request_id: str, lane: str, is_decode: bool, seconds: float) -> None:
        self.in_flight_s[request_id] = self.in_flight_s.get(request_id, 0.0) + seconds
        if is_decode:
            self.decode_s += seconds
        elif lane == SHORT:
            self.short_s += seconds
        else:
            self.long_s += seconds
