"""OpenAI's Responses API, ``POST /v1/responses``, served statelessly as vLLM serves it: a request
is a conversation (``instructions`` + ``input``) turned into the chat route's prompt and sampling,
run through the same preprocessing, admission and engine; the answer is one assistant ``message``
item.

Accepted: ``model``, ``input`` (a string, or message items whose content is a string or
``input_text`` / ``input_image`` / ``output_text`` parts), ``instructions`` (a system message
first), ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``text.format`` (text,
json_object, json_schema: the GrammarSpec chat's ``response_format`` builds), ``metadata``,
``user``, ``store`` (nothing is stored: the answer says ``store: false`` and cannot be retrieved),
and the extensions ``seed`` and ``top_k``.
Refused with a 400 naming the field (``RESPONSES_UNSUPPORTED``, and item / part types other than the
above), before anything is preprocessed: what needs stored state (``previous_response_id``,
``conversation``, ``background``, ``prompt``), ``tools``, ``reasoning`` with an effort or summary,
``include``, ``truncation: auto``.

Streaming sends the events the official client's ``responses.stream`` assembles (``event:`` +
``data:`` frames, numbered by ``sequence_number``): response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta per engine
output with text, response.output_text.done, response.content_part.done, response.output_item.done,
then response.completed or response.incomplete (its usage with the ``firsttoken`` timeline). A
failure mid-stream is one ``error`` event. No ``[DONE]``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal, Union

from pydantic import Field, PrivateAttr, field_validator, model_validator

from firsttoken.api.errors import error_body
from firsttoken.api.protocol import (
    FieldError,
    Int64,
    MaxTokens,
    CHECK_FITS,
    CHECK_GRAMMAR,
    CHECK_MEDIA,
    CHECK_ROOM,
    checked,
    Temperature,
    Text,
    TopK,
    TopP,
    Unsupported,
    UnsupportedFieldError,
    Usage,
    _absent,
    _Request,
    _Response,
    refuse_unsupported,
)
from firsttoken.api.logprobs_usage import usage_of
from firsttoken.api.streaming import StreamContext, guarded_outputs
from firsttoken.engine.client import EngineClient
from firsttoken.inputs import prompt
from firsttoken.quoting import quote
from firsttoken.structured.spec import GrammarSpec, from_text_format
from firsttoken.types import EngineRequest, FinishReason, RequestOutput

_STATELESS = "this server is stateless (nothing is stored); send the whole conversation in 'input'"


def _no_reasoning(value: Any) -> bool:
    return _absent(value) or (isinstance(value, dict) and all(
        value.get(k) in (None, "none") for k in ("effort", "summary", "generate_summary")))


# Responses fields that change what is generated (or promise state) but are not implemented; the
# rest (metadata, user, store, service_tier, parallel_tool_calls, max_tool_calls, top_logprobs,
# stream_options, text.verbosity, ...) change nothing a client could notice and are ignored.
RESPONSES_UNSUPPORTED: dict[str, Unsupported] = {
    "previous_response_id": Unsupported(_absent, f"there is no stored response to continue: {_STATELESS}"),
    "conversation": Unsupported(_absent, f"there are no stored conversations: {_STATELESS}"),
    "background": Unsupported(lambda v: v is None or v is False,
                              "background responses need stored responses to poll; send the request without it"),
    "prompt": Unsupported(_absent, "stored prompt templates are not implemented"),
    "tools": Unsupported(_absent, "tools are not implemented on /v1/responses (/v1/chat/completions has function "
                                  "calling)"),
    "tool_choice": Unsupported(lambda v: v is None or v in ("none", "auto"), "tool_choice needs tools, which are not "
                                                                             "implemented on /v1/responses"),
    "reasoning": Unsupported(_no_reasoning, "reasoning effort and summaries are not implemented (the served model "
                                            "has no reasoning mode)"),
    "include": Unsupported(_absent, "none of the extra outputs 'include' asks for are implemented"),
    "truncation": Unsupported(lambda v: v is None or v == "disabled",
                              "truncation 'auto' is not implemented: a conversation past the context is refused"),
    "response_format": Unsupported(_absent, "on /v1/responses the output format is 'text.format'"),
}  # fmt: skip

ITEM_TYPES = ("message",)
PART_TYPES = ("input_text", "input_image", "output_text")


def _refuse_unknown_items(body: Any) -> None:
    """Input items and content parts of a type this server does not take, refused naming where they
    are (the schema's own message for a closed set of tags would not say what is supported)."""
    items = body.get("input") if isinstance(body, dict) else None
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue  # the schema names it
        kind = item.get("type", "message")
        if kind not in ITEM_TYPES:
            raise UnsupportedFieldError(
                f"input[{i}].type",
                f"input[{i}] is an item of type {_named(kind)}; this "
                "server takes message items only (role and content)",
            )
        content = item.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict):
                continue
            where = f"input[{i}].content[{j}]"
            kind = part.get("type")
            if kind not in PART_TYPES:
                raise UnsupportedFieldError(
                    f"{where}.type",
                    f"{where} is a part of type {_named(kind)}; the parts "
                    f"this server takes are {', '.join(PART_TYPES)}",
                )
            if kind == "input_image" and part.get("file_id") is not None:
                raise UnsupportedFieldError(
                    f"{where}.file_id",
                    f"{where}.file_id: there are no stored files; send "
                    "the image as image_url (a data: URL or an allowed URL)",
                )
            if kind == "input_image" and part.get("image_url") is None:
                raise FieldError(
                    f"{where}.image_url",
                    f"{where}.image_url is required (a data: URL or an allowed URL)",
                )


def _named(kind: Any) -> str:
    return f"'{quote(kind)}'" if isinstance(kind, str) else f"{type(kind).__name__} (no type)"


# ----------------------------------------------------------------------------------------- requests


class InputText(_Request):
    # output_text: an assistant turn's text, sent back as history
    type: Literal["input_text", "output_text"]
    text: Text


class InputImage(_Request):
    type: Literal["input_image"]
    image_url: Text
    detail: Literal["auto", "low", "high"] | None = None


InputPart = Annotated[Union[InputText, InputImage], Field(discriminator="type")]


class InputMessage(_Request):
    type: Literal["message"] = "message"
    # a closed set, as chat's (the template prints the role); developer is rendered as system
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputPart]

    def texts(self) -> list[str]:
        return [self.content] if isinstance(self.content, str) else [
            p.text for p in self.content if isinstance(p, InputText)]

    @property
    def num_images(self) -> int:
        return (
            0
            if isinstance(self.content, str)
            else sum(isinstance(p, InputImage) for p in self.content)
        )

    def to_message(self) -> prompt.Message:
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, str):
            return prompt.Message(role, self.content)
        return prompt.Message(
            role,
            tuple(
                prompt.TextPart(p.text)
                if isinstance(p, InputText)
                else prompt.ImagePart(url=p.image_url, detail=p.detail)
                for p in self.content
            ),
        )


class TextConfig(_Request):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint for OpenAI's models; ignored


class ResponsesRequest(_Request):
    model: Text
    input: Text | list[InputMessage] = checked(CHECK_MEDIA)
    instructions: Text | None = checked(CHECK_FITS, default=None)
    max_output_tokens: MaxTokens | None = checked(CHECK_ROOM, default=None)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # extension (vLLM's)
    seed: Int64 | None = None  # extension (vLLM's)
    stream: bool = False
    text: TextConfig | None = checked(CHECK_GRAMMAR, default=None)
    metadata: dict[str, Any] | None = None  # echoed back
    user: Text | None = None
    store: bool | None = None  # accepted; nothing is stored
    _output_spec: GrammarSpec | None = PrivateAttr(default=None)

    @property
    # what the generation routes' common head reads: one choice, usage at the end
    def n(self) -> int:
        return 1

    @property
    def include_usage(self) -> bool:
        return True

    @property
    def continuous_usage(self) -> bool:
        return False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        refuse_unsupported(body, cls.model_fields, RESPONSES_UNSUPPORTED)
        _refuse_unknown_items(body)
        return body

    @field_validator("input", mode="before")
    @classmethod
    def _some_input(cls, value: Any) -> Any:
        if value == []:
            raise ValueError("give a string or at least one message item (an empty list was sent)")
        return value

    @model_validator(mode="after")
    def _output_format(self) -> ResponsesRequest:
        try:
            self._output_spec = from_text_format(
                self.text.format if self.text is not None else None
            )
        except ValueError as err:
            raise FieldError("text.format", str(err)) from None
        return self

    def texts(self) -> list[str]:
        head = [self.instructions] if self.instructions is not None else []
        return head + (
            [self.input]
            if isinstance(self.input, str)
            else [t for m in self.input for t in m.texts()]
        )

    @property
    def num_images(self) -> int:
        return 0 if isinstance(self.input, str) else sum(m.num_images for m in self.input)

    def to_prompt(self) -> prompt.ChatPrompt:
        """The conversation: instructions as a system message first, then the input's messages;
        errors name each message by its field (``input[2].content[0].image_url``)."""
        messages, fields = [], []
        if self.instructions is not None:
            messages.append(prompt.Message("system", self.instructions))
            fields.append("instructions")
        if isinstance(self.input, str):
            messages.append(prompt.Message("user", self.input))
            fields.append("input")
        else:
            messages += [m.to_message() for m in self.input]
            fields += [f"input[{i}]" for i in range(len(self.input))]
        return prompt.ChatPrompt(tuple(messages), True, (), "input", tuple(fields))

    def prompts(self) -> list[prompt.ChatPrompt]:
        return [self.to_prompt()]

    def to_sampling(self) -> prompt.SamplingRequest:
        return prompt.SamplingRequest(
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            structured=self._output_spec,
            names=(("max_tokens", "max_output_tokens"),),
        )


# ---------------------------------------------------------------------------------------- responses


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(_Response):
    cached_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int
    # the Timeline, as on the chat route
    firsttoken: dict[str, float | int | str | None] | None = None

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            firsttoken=usage.firsttoken,
        )


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"]


Status = Literal["in_progress", "completed", "incomplete"]


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, Any] | None = None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool = False
    previous_response_id: None = None
    reasoning: None = None
    store: bool = False  # nothing is stored, whatever the request said
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Literal["none"] = "none"
    tools: list[Any] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


def status_of(final: RequestOutput) -> Status:
    """A response cut by its token budget (max_output_tokens, or the room the context left) is
    incomplete."""
    return "incomplete" if final.finish_reason is FinishReason.LENGTH else "completed"


def response_object(
    req: ResponsesRequest,
    ctx: StreamContext,
    status: Status,
    output: list[OutputMessage],
    usage: ResponseUsage | None = None,
) -> ResponseObject:
    return ResponseObject(
        id=ctx.response_id,
        created_at=ctx.created,
        status=status,
        model=ctx.model,
        output=output,
        usage=usage,
        incomplete_details=IncompleteDetails(reason="max_output_tokens")
        if status == "incomplete"
        else None,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        metadata=req.metadata,
        temperature=req.temperature,
        top_p=req.top_p,
        user=req.user,
        text={
            "format": req.text.format
            if req.text is not None and req.text.format is not None
            else {"type": "text"}
        },
    )


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def finished_response(req: ResponsesRequest, ctx: StreamContext, text: str, final: RequestOutput,
                      item_id: str | None = None) -> ResponseObject:
    """The whole answer: one assistant message holding the text, and the usage with the request's
    timeline."""
    status = status_of(final)
    message = OutputMessage(
        id=item_id or message_id(), status=status, content=[OutputText(text=text)]
    )
    return response_object(
        req, ctx, status, [message], ResponseUsage.of(usage_of([final], ctx.timeline))
    )


async def responses_sse(engine: EngineClient, request: EngineRequest, req: ResponsesRequest,
                        ctx: StreamContext) -> AsyncIterator[str]:
    """The stream of one response (see the module docstring). Leaving early aborts the request
    (guarded_outputs -> stream_outputs)."""
    sequence = iter(range(1 << 62))

    def event(kind: str, **body: Any) -> str:
        data = json.dumps(
            {"type": kind, "sequence_number": next(sequence), **body},
            ensure_ascii=False,
            separators=(",", ":"),
        )
        return f"event: {kind}\ndata: {data}\n\n"

    def failed(status: int, message: str) -> str:
        # "error" too: the openai client raises on it, as on chat
        error = error_body(status, message)["error"]
        return event("error", code=str(status), message=error["message"], param=None, error=error)

    item_id = message_id()
    started = response_object(req, ctx, "in_progress", []).model_dump()
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield event("response.output_item.added", output_index=0,
                item=OutputMessage(id=item_id, status="in_progress", content=[]).model_dump())
    yield event("response.content_part.added", **where, part=OutputText(text="").model_dump())
    pieces: list[str] = []
    final: RequestOutput | None = None
    async with aclosing(guarded_outputs(engine, [request], (), failed)) as outputs:
        async for item in outputs:
            if isinstance(item, str):  # the error event
                yield item
                return
            _, out = item
            ctx.timeline.observe(out)
            if out.new_text:
                pieces.append(out.new_text)
                yield event("response.output_text.delta", **where, delta=out.new_text, logprobs=[])
                # resumed: the event has been handed to the transport
                ctx.timeline.mark_first_byte()
            if out.finished:
                final = out
    assert final is not None  # fan_in ends after the finished output
    text = "".join(pieces)
    done = finished_response(req, ctx, text, final, item_id)
    yield event("response.output_text.done", **where, text=text, logprobs=[])
    yield event("response.content_part.done", **where, part=OutputText(text=text).model_dump())
    yield event("response.output_item.done", output_index=0, item=done.output[0].model_dump())
    yield event("response.completed" if done.status == "completed" else "response.incomplete",
                response=done.model_dump())

