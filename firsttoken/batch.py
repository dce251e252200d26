"""What crosses the scheduler -> runner boundary for one step, and what the runner reports back. A
leaf module (it imports only firsttoken.types): the scheduler builds these, the runner (any
Executor) consumes them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from firsttoken.types import ImageItem, SamplingParams, TokenLogprob


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has not seen: everything it needs to keep for it until the request
    finishes (token history, images and their pixels, positions, sampling). Sent once, on its first
    admission."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    images: tuple[ImageItem, ...]
    mrope_positions: torch.Tensor  # [3, num_prompt_tokens] int64 (t, h, w)
    mrope_delta: int
    sampling: SamplingParams


@dataclass(frozen=True)
class EncoderWork:
    """Run encoder units [start_unit, start_unit + num_units) of image ``image_index`` of a request.
    Unit 0 starts from the pixels; after the last one the image's embeddings exist and chunks may
    cover its tokens.

    ``interruptible``: the runner may stop between this work's units when a short request arrives
    during the step (its ``interrupt`` signal), once the step has done any work (a unit or its
    forward); it reports the units actually run in ``RunnerOutput.encoder_progress``. The scheduler
    sets it only for long-lane work whose image no chunk of the same step covers."""

    request_id: str
    image_index: int
    content_hash: str
    start_unit: int
    num_units: int
    finishes: bool
    interruptible: bool = False


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [context_len, context_len + num_new_tokens) of a request run this step."""

    request_id: str
    # tokens whose KV already exists (the request's num_computed_tokens before this step)
    context_len: int
    num_new_tokens: int
    # physical KV blocks covering at least context_len + num_new_tokens
    block_table: tuple[int, ...]
    sample: bool  # the chunk reaches the last known token: sample the next one
    is_decode: bool  # one token right after the last sampled one (not a prefill chunk)

    @property
    def end(self) -> int:
        return self.context_len + self.num_new_tokens


@dataclass(frozen=True)
class StepFeatures:
    """The work one step holds, in the units the cost model prices."""

    sequences: int = 0  # chunks in the forward (prefill chunks + decodes)
    sampled: int = 0  # rows that reach the lm_head and the sampler
    prefill_tokens: int = 0
    prefill_attention: float = 0.0  # query-key pairs scored by prefill chunks
    decode_tokens: int = 0
    decode_context: int = 0  # cached tokens the decodes read
    encoder_patches: int = 0  # patches through vision-tower units
    encoder_attention: float = 0.0  # query-key pairs scored by those units

    def __add__(self, other: "StepFeatures") -> "StepFeatures":
        return StepFeatures(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: "StepFeatures") -> "StepFeatures":
        return StepFeatures(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def vector(self) -> np.ndarray:
        """[1, sequences, sampled, ...] in FEATURE_NAMES order."""
        return np.array([1.0, *(float(getattr(self, f.name)) for f in fields(self))])

    @property
    def is_empty(self) -> bool:
        return not (self.sequences or self.encoder_patches)


@dataclass(frozen=True)
class ScheduledBatch:
    """One step, as plain data (ids, ints, frozen request data): it could cross a thread, a process
    or a device. The runner applies ``new_requests`` and ``finished_request_ids`` (drop their state)
    before the work."""

    new_requests: tuple[NewRequest, ...]
    chunks: tuple[ScheduledChunk, ...]
    encoder_work: tuple[EncoderWork, ...]  # runs before the chunks, in order
    freed_encoder_hashes: tuple[str, ...]  # encoder outputs the runner may drop now
    preempted_request_ids: tuple[str, ...]
    finished_request_ids: tuple[str, ...] = ()  # finished or aborted since the last batch
    # the work it holds, as priced
    features: StepFeatures = field(default_factory=lambda: StepFeatures())

    @property
    def has_work(self) -> bool:
        return bool(self.chunks or self.encoder_work)

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner: no work and no state to take, drop or forget."""
        return not (
            self.new_requests
            or self.chunks
            or self.encoder_work
            or self.finished_request_ids
            or self.freed_encoder_hashes
            or self.preempted_request_ids
        )

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks if c.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens


@dataclass(frozen=True)
class RunnerOutput:
    """What the runner actually did in one step. The scheduler's bookkeeping follows it
    (``Scheduler.update``); nothing is assumed from what was scheduled.

    A request id appears in at most one of ``failed`` (its work raised: the engine fails that
    request only), ``constraint_failed`` (its output grammar ended it: the client's grammar's fault,
    not an internal error), ``skipped_request_ids`` (its chunk did not run because an input it
    needed is missing, e.g. an image whose encode failed this step for another request; it is
    scheduled again) and ``mask_pending_request_ids`` (its chunk ran, but its output mask was not
    ready in time: it sampled nothing, and its last token runs again next step)."""

    sampled: dict[str, int]  # request_id -> new token id
    logprobs: dict[str, TokenLogprob]
    failed: dict[str, str]  # request_id -> user-safe error message
    skipped_request_ids: frozenset[str] = frozenset()
    # image hash -> units done after this step
    encoder_progress: dict[str, int] = field(default_factory=dict)
    # images the runner holds nothing for any more
    discarded_encoder_hashes: frozenset[str] = frozenset()
    # request_id -> vision-tower seconds this step
    encoder_s: dict[str, float] = field(default_factory=dict)
    num_images_encoded: dict[str, int] = field(default_factory=dict)
    # request_id -> monotonic end of its encodes
    encoder_done_s: dict[str, float] = field(default_factory=dict)
    forward_done_s: float = 0.0  # monotonic time the forward pass finished (before sampling)
    sample_done_s: float = 0.0
    # seconds of the step's batched forward: packing its inputs, the model, logits, sampling
    forward_s: float = 0.0
    # request_id -> the logprobs of the prompt tokens its chunk scored (each position's next token),
    # in order
    prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)
    mask_pending_request_ids: frozenset[str] = frozenset()
    # request_id -> why (client-safe)
    constraint_failed: dict[str, str] = field(default_factory=dict)
    # seconds of the step spent waiting for constrained rows' masks (not model work)
    mask_wait_s: float = 0.0

    def merged(self, late: "RunnerOutput") -> "RunnerOutput":
        """This step's output with what its deferred encoder work (``Executor.finish_step``)
        reported after it."""
        def add(a: dict, b: dict) -> dict:
            return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}

        return replace(
            self,
            failed={**self.failed, **late.failed},
            encoder_progress={**self.encoder_progress, **late.encoder_progress},
            discarded_encoder_hashes=self.discarded_encoder_hashes | late.discarded_encoder_hashes,
            encoder_s=add(self.encoder_s, late.encoder_s),
            num_images_encoded=add(self.num_images_encoded, late.num_images_encoded),
            encoder_done_s={**self.encoder_done_s, **late.encoder_done_s},
        )
