"""The engine's mutable view of one request: tokens known vs tokens whose KV is computed.

A request is ``num_computed_tokens`` chasing ``num_tokens`` (prompt + generated). Prefill and decode
are the same thing seen at different distances: the scheduler grants each request a number of new
tokens per step. Scheduling state is ints and lists; the EngineRequest it wraps carries the runner's
tensors untouched (they reach the runner once, as a NewRequest).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from enum import Enum

from firsttoken.batch import NewRequest
from firsttoken.kv.prefix_cache import BlockHash, prompt_block_hashes
from firsttoken.types import (
    EngineRequest,
    FinishReason,
    ImageItem,
    RequestStats,
    images_in,
)


# a request's lane (``Request.lane``): the names a lane policy routes to (lanes.py)
SHORT = "short"
LONG = "long"
FCFS = "fcfs"


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    engine_request: EngineRequest
    arrival_seq: int  # admission order; ties broken by it everywhere
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # prompt's full blocks; computed once on first admission try
    block_hashes: list[BlockHash] | None = None
    # the runner holds its NewRequest (from first admission until it finishes)
    sent_to_runner: bool = False
    # SHORT, LONG or FCFS: set by the scheduler at add(), from its lane policy
    lane: str = "default"
    arrival_step: int = 0  # scheduler steps completed when the request arrived
    delayed_by_long: bool = False  # sat out a whole step while long work ran (counted once)
    queued_s: float = 0.0  # when the scheduler got it, on the scheduler's clock
    # what the engine did for it; outputs carry it
    stats: RequestStats = field(default_factory=RequestStats)
    # the engine's accounting until the first token (LLMEngine): its busy seconds and steps run when
    # the request arrived, then the seconds of the steps that carried its work and of their forwards
    busy_mark_s: float = 0.0
    steps_mark: int = 0
    own_steps_s: float = 0.0
    own_forward_s: float = 0.0

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.engine_request.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.engine_request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def images(self) -> tuple[ImageItem, ...]:
        return self.engine_request.images

    @property
    def is_decoding(self) -> bool:
        """Its next step computes one token: the KV of all but the last token (a generated one) is
        written."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    def for_runner(self) -> NewRequest:
        """What the runner is sent at the request's first admission (its tensors, untouched)."""
        er = self.engine_request
        return NewRequest(
            self.request_id,
            er.prompt_token_ids,
            er.images,
            er.mrope_positions,
            er.mrope_delta,
            er.sampling,
        )

    def stamp(self, name: str, t: float | None = None) -> None:
        """Set one of the stats' time marks once (later calls keep the first value)."""
        if getattr(self.stats, name) is None:
            self.stats = replace(self.stats, **{name: time.monotonic() if t is None else t})

    def count(self, name: str, amount: float = 1) -> None:
        self.stats = replace(self.stats, **{name: getattr(self.stats, name) + amount})

    def images_in(self, start: int, end: int) -> list[tuple[int, ImageItem]]:
        """(index, image) of the images whose tokens overlap prompt indices [start, end)."""
        return images_in(self.images, start, end)

    def ensure_block_hashes(self, block_size: int) -> list[BlockHash]:
        """The prompt's full blocks' hashes (tokens, positions, and an image's blocks its hash and
        offset), computed once."""
        if self.block_hashes is None:
            self.block_hashes = prompt_block_hashes(self.engine_request, block_size)
        return self.block_hashes


# requests that ended, with why
Ended = list[tuple[Request, FinishReason]]
