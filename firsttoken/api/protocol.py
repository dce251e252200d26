"""OpenAI-compatible request and response schemas (pydantic v2).

Requests tolerate unknown fields (clients send vendor extras); known fields are type-checked here and
range-checked once, by SamplingParams, in the input processor. Responses follow OpenAI's shapes and vLLM's
framing (see shared/fixtures/vllm-0.32, beside the repository) with one extension:

    usage.firsttoken   the request's Timeline.to_dict(): ttft_s, per-phase seconds (preprocess, queue,
                       encode, prefill, sample, send), e2e_s, encoder/prefix-cache counts. Present on
                       non-streaming responses and on the streaming usage chunk.

This module is a leaf: it imports pydantic only, so both api/ and inputs/ may depend on it.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------------------------- requests


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str
    # "low": a small fixed visual-token budget; "high"/"auto"/None: the server's cap (see inputs/budget.py)
    detail: Literal["auto", "low", "high"] | None = None
    max_visual_tokens: int | None = Field(default=None, ge=1)  # extension: at most this many tokens, <= the cap


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(_Request):
    # Roles are a closed set: the chat template prints the role verbatim, so free text here would be a
    # template-injection channel.
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by chat and text completions. None means "the checkpoint's default"."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    ignore_eos: bool = False

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n must be 1 (this server returns one choice per request), got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stop

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(the field the client used, its value): error messages name the field the client sent."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str
    logprobs: int | None = None  # number of alternatives per position, as in OpenAI's legacy API

    @property
    def requested_max_tokens(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens


class TokenizeRequest(_Request):
    """Either a chat body (``messages``, the same as /v1/chat/completions) or a plain ``prompt``."""

    model: str | None = None
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        return self


# ------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    firsttoken: dict[str, float | int | None] | None = None  # Timeline.to_dict(); see the module docstring


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprobEntry]


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None

    def to_json(self) -> str:
        """vLLM's framing: delta carries only the keys that are set, and ``usage`` only on the usage chunk."""
        body: dict[str, Any] = self.model_dump(exclude={"usage"} if self.usage is None else set())
        for choice, raw in zip(body["choices"], self.choices):
            choice["delta"] = raw.delta.model_dump(exclude_none=True)
        return _dumps(body)


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None

    def to_json(self) -> str:
        return _dumps(self.model_dump(exclude={"usage"} if self.usage is None else set()))


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "firsttoken"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ImageTokenInfo(_Response):
    original_size: tuple[int, int]  # (width, height) as decoded
    resized_size: tuple[int, int]  # (width, height) after the pixel budget
    num_tokens: int  # visual tokens after the 2x2 merge
    budget_tokens: int  # the budget the image was resized under (server cap, detail=low, or max_visual_tokens)


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    num_text_tokens: int  # extension: count minus the image-pad tokens
    images: list[ImageTokenInfo] = Field(default_factory=list)  # extension
    max_input_tokens: int | None = None  # extension: the server's prompt limit (text + image + template tokens)


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Response):
    error: ErrorInfo


def _dumps(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))
