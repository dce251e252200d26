"""What the step being built has collected so far (``StepDraft``), and why a live request got
nothing in it.

A draft exists while ``Scheduler.schedule`` builds one step and is kept until the next one, so
``wait_reason`` can say, for any live request without work in it, which rule held it back. Plain
data: ids, ints, predicted seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from firsttoken.batch import EncoderWork, ScheduledChunk
from firsttoken.scheduler.request import LONG, SHORT, Request, RequestStatus

# why a live request got no work in a step (wait_reason); "" is no reason at all: a request that can
# never progress
WAIT_REASONS = (
    "preempted",
    "max_num_seqs",
    "kv_blocks",
    "short_lane_first",
    "step_full",
    "image_encoding",
    "in_line",
)


@dataclass
class StepDraft:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    encoder_work: list[EncoderWork] = field(default_factory=list)
    worked_hashes: set[str] = field(default_factory=set)  # images advanced this step
    finishing_hashes: set[str] = field(default_factory=set)  # images whose last unit runs this step
    # requests with a chunk or encoder work in this step
    scheduled_ids: set[str] = field(default_factory=set)
    has_long_work: bool = False
    has_short_prefill: bool = False  # a short request's prefill chunk is in this step
    long_held: bool = False  # the long lane had work but yielded this step to short prefills
    # long-lane work only: sized for throughput, not bounded in time (pacing.py)
    throughput: bool = False
    # when it was built, the long lane had prefill work and the short lane none
    long_only: bool = False
    long_prefill_left: bool = False  # a long request served in it has prompt tokens left after it
    # the step's token budget or time bound was used up (or what is left fits no prefill chunk)
    full: bool = False
    # admissions refused for want of KV blocks
    kv_blocked_ids: set[str] = field(default_factory=set)
    preempted_ids: frozenset[str] = frozenset()
    # predicted seconds of this step's decodes, short prefills, long work (lane shares)
    decode_s: float = 0.0
    short_s: float = 0.0
    long_s: float = 0.0
    # the interruptible encoder work's predicted seconds and its mean unit's (the runner runs it
    # last in the step)
    cut_span: tuple[float, float] = (0.0, 0.0)
    # per request: predicted seconds of its work here
    in_flight_s: dict[str, float] = field(default_factory=dict)

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

    def wait_reason(self, req: Request, seqs_full: bool, lane_queue: Iterable[Request],
                    lane_of: Callable[[str], str | None]) -> str:
        """Why ``req`` (live) got no work in this step: one of WAIT_REASONS, or "" when it got work
        or nothing explains the wait (a request that can never make progress; the randomized tests
        look for it). ``seqs_full``: the running set is at max_num_seqs; ``lane_queue``: its lane's
        waiting requests; ``lane_of``: a live id's lane."""
        if req.request_id in self.scheduled_ids or req.status == RequestStatus.FINISHED:
            return ""
        if req.request_id in self.preempted_ids:
            return "preempted"  # its blocks went to a decode's growth this step
        if req.status == RequestStatus.WAITING:
            if seqs_full:
                return "max_num_seqs"
            if req.request_id in self.kv_blocked_ids:
                return "kv_blocks"
            if any(other.request_id in self.kv_blocked_ids for other in lane_queue):
                return "in_line"  # its lane's admissions stopped at a request waiting for blocks
        if req.lane == LONG and self.long_held:
            return "short_lane_first"
        if self.full:
            return "step_full"
        if any(im.content_hash in self.worked_hashes for im in req.images):
            return "image_encoding"  # another request advances the image it waits for
        if any(lane_of(rid) == req.lane for rid in self.scheduled_ids):
            return "in_line"  # its lane served others first this step
        return ""


class StepReport(NamedTuple):
    """What one step left behind, for the engine's step stats."""

    # the cost model's seconds for the work the step did (None: not fitted yet)
    predicted_s: float | None
    duration_s: float  # the step's wall time, from its start to its update
    step: int  # steps with work so far
    kv_blocks_used: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
