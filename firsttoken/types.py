"""The values that cross layer boundaries: what the engine receives, what it hands back, and the
verdicts and snapshots it answers with. A leaf module: it imports nothing of firsttoken, so every
layer may use it.

An EngineRequest is fully preprocessed before it reaches the engine: chat template applied, images
decoded, resized within their budget and turned into pixel patches, M-RoPE positions computed,
sampling parameters resolved. The engine never parses or decodes anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import numpy
import torch

# ----------------------------------------------------------------------------------------- sampling

# a temperature below this samples greedily (as vLLM); dividing by it would overflow
SAMPLING_EPS = 1e-5
# What one request may make the engine do per token, and what a seeded generator accepts.
# OpenAI allows 4; generous, and stop matching costs O(new text) however many (stop_strings.py)
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256  # each; text held back waiting for a possible stop is shorter than this
MAX_TOP_LOGPROBS = 20  # alternatives per position, as OpenAI
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
# int64, as vLLM; torch's generator refuses 2**64 and above
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class OutputGrammar(Protocol):
    """A compiled output constraint (firsttoken/structured): what a request's answer must match. The
    runner gives each request its own matcher from it."""

    def matcher(self) -> Any: ...


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 (or anything below SAMPLING_EPS) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # a per-request generator: same seed, same output
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # the request's own: always end the answer
    # the model's EOS ids do not end the answer (the request's stop_token_ids still do)
    ignore_eos: bool = False
    # the checkpoint's (generation_config.json, else config.json)
    eos_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position, 0..20
    # the answer's tokens are masked to what it allows, step by step
    grammar: OutputGrammar | None = None
    # (token id, added to its logit before sampling), -100..100
    logit_bias: tuple[tuple[int, float], ...] = ()
    # each prompt token's logprob and this many alternatives (None: off)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be between -2 and 2")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be between -2 and 2")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError("repetition_penalty must be in (0, 10]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} token ids, got {len(self.logit_bias)}")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be between -100 and 100")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(
                f"seed must be a 64-bit signed integer, between {SEED_MIN} and {SEED_MAX}"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters each, got one of {longest}"
            )

    def finish_after(self, token_id: int, num_output_tokens: int) -> FinishReason | None:
        """The request's own token rule, the one home of it (the engine ends answers by it, the
        runner asks it whether a constrained answer's grammar must take the token): why an answer
        ends with ``token_id``, its ``num_output_tokens``-th token. STOP: one of its stop token ids
        or, unless ``ignore_eos``, an EOS id (the token is not part of the text); LENGTH: its
        ``max_tokens``-th; None: another token may follow. The engine may end an answer where this
        says None (a stop string, the context limit), never the other way round."""
        if token_id in self.stop_token_ids or (
            not self.ignore_eos and token_id in self.eos_token_ids
        ):
            return FinishReason.STOP
        return FinishReason.LENGTH if num_output_tokens >= self.max_tokens else None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


# ------------------------------------------------------------------------------------------- images

@dataclass(frozen=True)
class EncoderUnit:
    """One schedulable piece of an image's vision-tower work: a block, or a slice of a block's query
    rows (models/vision_units.py)."""

    num_patches: int  # rows whose linear work it does
    # query-key pairs its attention scores: full = n^2 per frame, windowed = sum of window^2
    attention_pairs: int
    # what it costs against a step's token budget: visual tokens x (its FLOPs / a full block's)
    cost_tokens: int
    block: int = 0  # the vision block it belongs to
    rows: tuple[int, int] | None = None  # query rows [lo, hi) of that block; None: the whole block


@dataclass(frozen=True)
class ImageItem:
    """One vision item of a prompt: an image, or one temporal grid of a video (``kind`` "video":
    grid (1, h, w), its two frames in each patch row; every family's tower attends within one grid,
    so a video encodes grid by grid). Its tokens are prompt_token_ids[offset : offset +
    num_tokens]."""

    content_hash: str  # identifies the pixels after resizing + the settings that shape its tokens
    offset: int  # index of the first image-pad token in the prompt
    num_tokens: int  # visual tokens after the 2x2 merge
    grid_thw: tuple[int, int, int]  # patch grid before merging
    # its vision-tower work, in order (the model family's split)
    encoder_units: tuple[EncoderUnit, ...]
    # [num_patches, C * T * P * P]; None when the encoder output is cached
    pixel_values: torch.Tensor | None
    kind: str = "image"  # "image" | "video"
    # kind "video": which of the prompt's videos (0, 1, ...) this grid is of
    video_index: int | None = None

    def __post_init__(self) -> None:
        if (self.kind == "video") != (self.video_index is not None):
            raise ValueError(
                f"a {self.kind} item has video_index={self.video_index}: a video grid needs one, "
                "an image none"
            )

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def images_in(images: tuple[ImageItem, ...], start: int, end: int) -> list[tuple[int, ImageItem]]:
    """(index, image) of the images whose tokens overlap prompt indices [start, end)."""
    return [(i, im) for i, im in enumerate(images) if im.offset < end and im.end > start]


# ----------------------------------------------------------------------------------------- requests

@dataclass(frozen=True)
class TokenRecords:
    """Tokens as the prefix cache keys them: one record a token of (id, its position on each of
    ``num_position_rows`` rotary axes), little-endian int64s, in prompt order from token 0."""

    data: bytes  # num_tokens * (1 + num_position_rows) * 8 bytes
    num_position_rows: int  # M-RoPE: 3 (t, h, w)
    num_tokens: int

    @property
    def record_bytes(self) -> int:
        return 8 * (1 + self.num_position_rows)


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    images: tuple[ImageItem, ...]
    mrope_positions: torch.Tensor  # [3, num_prompt_tokens] int64 (t, h, w)
    # decode token i >= num_prompt_tokens sits at position i + mrope_delta on all axes
    mrope_delta: int
    sampling: SamplingParams
    arrival_s: float  # monotonic time the request reached the server (the API stamps it)
    preprocessed_s: float  # monotonic time preprocessing ended (the input processor stamps it)
    # the admission check's prediction, for the timeline beside the measure
    predicted_ttft_s: float | None = None
    # e.g. "degraded 1280->320 tokens per image: predicted TTFT over SLO"
    image_budget_note: str | None = None
    # with --ttft-slo, a long prompt's place in line as its admission decided it
    long_place_s: float | None = None
    # seconds its output grammar took to compile, inside preprocessing (0: cached, none)
    grammar_compile_s: float = 0.0

    def __post_init__(self) -> None:
        # a request with nothing to compute could never sample (never finish)
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_image_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images)

    def token_records(self, num_tokens: int) -> TokenRecords:
        """The first ``num_tokens`` prompt tokens as the prefix cache keys them
        (kv/prefix_cache.py)."""
        rows = self.mrope_positions.shape[0]
        records = numpy.empty((num_tokens, 1 + rows), dtype="<i8")
        records[:, 0] = self.prompt_token_ids[:num_tokens]
        records[:, 1:] = self.mrope_positions[:, :num_tokens].t().numpy()
        return TokenRecords(records.tobytes(), rows, num_tokens)


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client went away, timeout, or shutdown
    ERROR = "error"  # this request failed; others go on


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) alternatives, best first


@dataclass(frozen=True)
class RequestStats:
    """What the engine did for one request so far, stamped on every output it hands on (monotonic
    seconds; None until it happened). The API assembles the request's timeline from these and its
    own stamps (metrics/timeline.py); nothing is shared between the engine thread and the event
    loop."""

    first_scheduled_s: float | None = None
    encoder_done_s: float | None = None
    prefill_done_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    num_prefill_steps: int = 0  # engine steps that carried this request's prefill chunks
    num_shared_prefill_steps: int = 0  # of those, steps that also carried other requests' work
    encoder_s: float = 0.0  # time spent in the vision tower for this request's images
    num_images_encoded: int = 0
    num_encoder_cache_hits: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    # where the time went from the end of preprocessing to the first token (set then), every second
    # of it: handoff_s until the engine thread took the request (the step in flight, the command
    # queue); then encoder_s; forward_s: the forwards that carried its chunks (shared with their
    # other rows); step_overhead_s: the rest of the steps that carried its work (scheduling,
    # bookkeeping, other requests' vision work in those steps); other_steps_s: steps without its
    # work; engine_idle_s: between steps
    num_steps_to_first_token: int = 0
    handoff_s: float = 0.0
    forward_s: float = 0.0
    step_overhead_s: float = 0.0
    other_steps_s: float = 0.0
    engine_idle_s: float = 0.0


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request (a delta, not the whole text)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    # on the first token's output, with SamplingParams.prompt_logprobs: prompt tokens 1.. (token 0
    # has none)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # what the engine did for it so far
    stats: RequestStats = field(default_factory=lambda: RequestStats())
    error: str | None = None  # set with FinishReason.ERROR: a user-safe message
    error_status: int = 500  # the HTTP status that error maps to (504 for a request timeout)


# ------------------------------------------------------------------------------------------ answers

@dataclass(frozen=True)
class PromptWork:
    """What a prompt will cost the engine, known from its token count and image headers before any
    image is decoded: the admission check's input (and /tokenize's, for a predicted TTFT)."""

    num_prompt_tokens: int
    num_images: int = 0  # vision items: images and video grids
    encoder_patches: int = 0  # patches through every encoder unit of every image
    encoder_attention_pairs: float = 0.0
    num_encoder_units: int = 0
    # when it was admitted, on the scheduler's clock, once it has been (a request still
    # preprocessing, counted ahead of later ones): its TTFT objective runs from there
    admitted_s: float | None = None
    # and the place in line its admission gave it (--ttft-slo, deadline order)
    long_place_s: float | None = None
    # videos among them (a video is one vision item per temporal grid); > 0 only if any
    num_videos: int = 0

    @property
    def request_class(self) -> str:
        """The SLO class: "text", "image" or "video" (any video)."""
        return "video" if self.num_videos else "image" if self.num_images else "text"

    @staticmethod
    def of(
        num_prompt_tokens: int, images: "tuple[ImageItem, ...] | list[ImageItem]" = ()
    ) -> "PromptWork":
        units = [u for im in images for u in im.encoder_units]
        return PromptWork(num_prompt_tokens, len(images), sum(u.num_patches for u in units),
                          float(sum(u.attention_pairs for u in units)), len(units),
                          num_videos=count_videos(images))


@dataclass(frozen=True)
class AdmissionVerdict:
    """Whether a new request may queue, and if not why: the reason is a metric label and the
    client's message."""

    admitted: bool
    lane: str
    reason: str = ""  # "queue_full" | "never_fits" | "over_slo"
    message: str = ""
    status: int = 200  # HTTP status the API answers with when refused
    predicted_ttft_s: float | None = None  # from the step-cost model (None before it is fitted)
    retry_after_s: float | None = None  # for a 429: when the predicted wait would allow it
    # admitted, but with --ttft-slo its predicted wait (with the margin) is over the objective: an
    # image request whose budget the server may lower is asked again at a lower one
    lower_budget: bool = False
    # with --ttft-slo, deadline order: the long prompt's place in line its prediction assumed (the
    # scheduler's clock); the request keeps it, so the prediction and the order agree
    long_place_s: float | None = None

    @property
    def asks_lower_budget(self) -> bool:
        """Over the objective, or admitted with a wait over it: a lower image budget is worth asking
        about."""
        return self.reason == "over_slo" or self.lower_budget

    @staticmethod
    def ok(lane: str, predicted_ttft_s: float | None = None, lower_budget: bool = False,
           long_place_s: float | None = None) -> "AdmissionVerdict":
        return AdmissionVerdict(
            True,
            lane,
            predicted_ttft_s=predicted_ttft_s,
            lower_budget=lower_budget,
            long_place_s=long_place_s,
        )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /stats-style endpoints and tests: is memory back, who is waiting."""

    kv_blocks_total: int
    kv_blocks_used: int  # referenced by a live request
    kv_blocks_cached: int  # unreferenced but holding a reusable prefix (evictable, counted as free)
    kv_blocks_free: int  # total - used
    block_size: int
    num_running: int
    num_waiting: int
    num_steps: int
    num_preemptions: int
    max_model_len: int
    num_waiting_by_lane: dict[str, int] = field(default_factory=dict)
    preemptions_by_reason: dict[str, int] = field(default_factory=dict)
    # short requests that sat out a whole step while long work ran
    num_short_delayed_by_long: int = 0
    num_encoder_interrupts: int = 0  # steps whose long-lane encoder work a short arrival cut short
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    encoder_cache_bytes: int = 0
    # images the vision tower ran for since start (encoder cache misses computed)
    num_images_encoded: int = 0
    # step-cost coefficients, seconds per unit of work
    cost_model: dict[str, float] = field(default_factory=dict)
    # term -> steps, max seen
    cost_model_coverage: dict[str, dict[str, float]] = field(default_factory=dict)
    # the step-time bound in force (None: token budgets only)
    step_time_target_s: float | None = None
    itl_target_s: float | None = None  # --itl-target's pace in force (None: off)
    # images "0"/"1"/"2+" -> predicted TTFT's factor
    ttft_bias: dict[str, float] = field(default_factory=dict)
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    # steps with long-lane prefill work and no short one, by sizing ("throughput" | "bounded"):
    # steps, wall_s, and at_throughput_s, the seconds their work would take in throughput steps
    # (scheduler/report.py LongLaneTime)
    long_lane_only: dict[str, dict[str, float]] = field(default_factory=dict)




def count_videos(items: "Sequence[ImageItem]") -> int:
    """Videos among a prompt's vision items: the distinct videos their grids are of."""
    return len({item.video_index for item in items if item.kind == "video"})
