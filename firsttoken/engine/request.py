"""The values that cross the engine boundary: EngineRequest in, RequestOutput out, and the request timeline.

An EngineRequest is fully preprocessed before it reaches the engine: chat template applied, images decoded,
resized within their budget and turned into pixel patches, M-RoPE positions computed. The engine never parses
or decodes anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from firsttoken.models.interfaces import EncoderUnit
from firsttoken.sampling.params import SamplingParams


@dataclass(frozen=True)
class ImageItem:
    """One image of a prompt. Its tokens are prompt_token_ids[offset : offset + num_tokens]."""

    content_hash: str  # identifies the pixels after resizing + the settings that shape its tokens
    offset: int  # index of the first image-pad token in the prompt
    num_tokens: int  # visual tokens after the 2x2 merge
    grid_thw: tuple[int, int, int]  # patch grid before merging
    encoder_units: tuple[EncoderUnit, ...]  # its vision-tower work, in order (the model family's split)
    pixel_values: torch.Tensor | None  # [num_patches, C * T * P * P]; None when the encoder output is cached

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def images_in(images: tuple[ImageItem, ...], start: int, end: int) -> list[tuple[int, ImageItem]]:
    """(index, image) of the images whose tokens overlap prompt indices [start, end)."""
    return [(i, im) for i, im in enumerate(images) if im.offset < end and im.end > start]


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    images: tuple[ImageItem, ...]
    mrope_positions: torch.Tensor  # [3, num_prompt_tokens] int64 (t, h, w)
    mrope_delta: int  # decode token i >= num_prompt_tokens sits at position i + mrope_delta on all axes
    sampling: SamplingParams
    timeline: "Timeline"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_image_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images)


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client went away, timeout, or shutdown
    ERROR = "error"  # this request failed; others go on


@dataclass
class Timeline:
    """Marks on the monotonic clock (seconds). Phases are the gaps between consecutive marks, so
    preprocess + queue + encode + prefill + sample + send == first_byte - arrival == TTFT exactly."""

    arrival_s: float = field(default_factory=time.monotonic)
    arrival_unix_s: float = field(default_factory=time.time)
    preprocessed_s: float | None = None
    first_scheduled_s: float | None = None
    encoder_done_s: float | None = None
    prefill_done_s: float | None = None
    first_token_s: float | None = None
    first_byte_s: float | None = None
    finished_s: float | None = None
    # Counts that explain the phases.
    num_prefill_steps: int = 0  # engine steps that carried this request's prefill chunks
    num_shared_prefill_steps: int = 0  # of those, steps that also carried other requests' work
    encoder_s: float = 0.0  # time spent in the vision tower for this request's images
    num_images_encoded: int = 0
    num_encoder_cache_hits: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0

    def mark(self, name: str, t: float | None = None) -> None:
        """Set a mark once; later calls keep the first value."""
        if getattr(self, name) is None:
            setattr(self, name, time.monotonic() if t is None else t)

    def phases(self) -> dict[str, float]:
        """Seconds per phase, from arrival to the first byte (missing marks collapse to the previous one)."""
        marks = [
            ("preprocess", self.preprocessed_s),
            ("queue", self.first_scheduled_s),
            ("encode", self.encoder_done_s),
            ("prefill", self.prefill_done_s),
            ("sample", self.first_token_s),
            ("send", self.first_byte_s),
        ]
        out: dict[str, float] = {}
        prev = self.arrival_s
        for name, t in marks:
            t = prev if t is None else max(t, prev)
            out[name] = t - prev
            prev = t
        return out

    def ttft_s(self) -> float | None:
        end = self.first_byte_s or self.first_token_s
        return None if end is None else end - self.arrival_s

    def to_dict(self) -> dict[str, float | int | None]:
        """The per-request timing report returned to clients and written to the request log."""
        phases = self.phases()
        end = self.finished_s
        return {
            "ttft_s": self.ttft_s(),
            **{f"{k}_s": v for k, v in phases.items()},
            "e2e_s": None if end is None else end - self.arrival_s,
            "encoder_compute_s": self.encoder_s,
            "prefill_steps": self.num_prefill_steps,
            "shared_prefill_steps": self.num_shared_prefill_steps,
            "images_encoded": self.num_images_encoded,
            "encoder_cache_hits": self.num_encoder_cache_hits,
            "cached_prompt_tokens": self.num_cached_prompt_tokens,
            "preemptions": self.num_preemptions,
        }


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) alternatives, best first


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
    error: str | None = None  # set with FinishReason.ERROR: a user-safe message
    error_status: int = 500  # the HTTP status that error maps to (504 for a request timeout)
