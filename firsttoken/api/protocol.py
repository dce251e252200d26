"""OpenAI-compatible request and response schemas (pydantic v2).

Requests tolerate harmless unknown fields (``user``, ``metadata``, ``store``, vendor extras). Known
fields are validated here, and the published schema (/openapi.json, api/openapi.py) is these models'
own, so it admits what the validation admits. Rules that hold at this boundary for every request
field:

- a value is the JSON type its schema states (strict: no "5" for 5, no true for 1.0; an integral 5.0
  is 5);
- every string is valid Unicode (``Text``): JSON may carry a lone UTF-16 surrogate such as
  ``"\ud800"``, which Python accepts and every tokenizer, encoder and file system later chokes on;
  it is refused here, naming the field;
- every integer fits in 64 bits (``integer()``), so no message ever prints a thousand-digit number;
  the sampling fields' ranges are stated and checked here too (``Temperature`` ...; SamplingParams
  checks the same bounds for in-process callers);
- a rule the schema cannot state (an image must decode, the prompt must fit the context, a grammar
  must compile) marks its field ``checked()``: the schema says so, and a value it admits may still
  get a 400 naming the field;
- a field that asks for something this server does not do (``UNSUPPORTED_FIELDS``) is refused with a
  400 naming it, unless its value means "off": a client that asked for JSON must never get prose
  with a 200.

Responses follow OpenAI's shapes and vLLM's framing (see tests/fixtures/vllm-0.32) with
one extension:

    usage.firsttoken   the request's Timeline.to_dict(): ttft_s, per-phase seconds (preprocess, queue,
                       encode, prefill, sample, send), e2e_s, encoder/prefix-cache counts. Present on
                       non-streaming responses and on the streaming usage chunk.

Requests convert to the input processor's neutral values (``to_prompt``, ``to_sampling``:
inputs/prompt.py); nothing below the api package sees these schemas.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypeVar, Union, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    RootModel,
    field_validator,
    model_serializer,
    model_validator,
)

from firsttoken.inputs import prompt
from firsttoken.quoting import LONE_SURROGATE, quote
from firsttoken.inputs.tool_prompts import forced_call_spec
from firsttoken.inputs.sampling import MAX_STOP_TOKEN_IDS
from firsttoken.structured.spec import GrammarSpec, from_response_format, from_structured_outputs
from firsttoken.types import (
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
)

# -------------------------------------------------------------------------------------- field types


def _valid_unicode(text: str) -> str:
    if LONE_SURROGATE.search(text):
        raise ValueError(
            "must be valid Unicode, but contains a lone UTF-16 surrogate (\\ud800-\\udfff)"
        )
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]  # every request string: encodable as UTF-8


def text(**bounds: int) -> Any:
    """A request string of bounded length (min_length, max_length, as the schema states them); its
    Unicode is checked first, so a lone surrogate is named as such rather than failing the length
    count."""
    return Annotated[
        str,
        Field(**bounds),
        BeforeValidator(lambda v: _valid_unicode(v) if isinstance(v, str) else v),
    ]


def _integral(value: Any) -> Any:
    """JSON's integers include 5.0 (JSON Schema's too): an integral float is that integer; every
    other value is left to the strict check (no "5", no true). An infinity stands for an integer of
    more digits than Python reads (api/body.py), past every bound."""
    if isinstance(value, float) and math.isinf(value):
        raise ValueError(f"must be an integer within 64 bits, got {'-' if value < 0 else ''}inf")
    return int(value) if isinstance(value, float) and value.is_integer() else value


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def integer(ge: int = INT64_MIN, le: int = INT64_MAX) -> Any:
    """A request integer in [ge, le] (64-bit unless narrower: what OpenAI and vLLM accept); the
    bounds sit on the int itself, so the schema states them as minimum and maximum."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


Int64 = integer()
_T = TypeVar("_T")
NonEmpty = Annotated[list[_T], Field(min_length=1)]  # NonEmpty[X]: a list of at least one X
MAX_CHOICES = 128  # choices one request may ask for (prompts x n): each is an engine request

# the schema keyword that marks a field checked beyond its schema (``checked``)
CHECKED = "x-firsttoken-checked"


def checked(what: str, **field: Any) -> Any:
    """A field whose value the server checks beyond what its schema can state (``what``: media that
    must load, a prompt that must fit the context, a grammar that must compile, ids of this model's
    vocabulary, a rule across fields): a value the schema admits may still be refused with a 400
    naming the field. The published schema says so, in the field's description and its
    ``x-firsttoken-checked``. ``field``: the rest of its pydantic Field."""
    return Field(
        description=f"Checked beyond this schema: {what}.",
        json_schema_extra={CHECKED: what},
        **field,
    )


CHECK_FITS = "the rendered prompt must fit the context (max_model_len, GET /v1/models)"
CHECK_MEDIA = ("each image and video part must load and decode within the server's limits (how many per request, "
               f"pixels, duration, the allowed media sources), and {CHECK_FITS}")
CHECK_ROOM = "the prompt plus this many tokens must fit the context (max_model_len)"
CHECK_GRAMMAR = ("the constraint must compile (a JSON schema, regex, choice list or grammar this server supports); "
                 "at most one output constraint per request, and none with a forced tool call")
CHECK_VOCABULARY = "token ids of this model's vocabulary"

# Sampling bounds: stated in the published schema and checked here, before any preprocessing.
# SamplingParams (types.py) checks the same bounds again for in-process callers;
# tests/unit/test_openapi.py pins them equal.
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
TopK = integer(ge=0)  # 0: off
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]  # presence and frequency
RepetitionPenalty = Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)]
MaxTokens = integer(ge=1)  # the context's room decides the rest (beyond the schema)
TopLogprobs = integer(ge=0, le=MAX_TOP_LOGPROBS)
StopString = text(min_length=1, max_length=MAX_STOP_STRING_CHARS)
TokenId = integer(ge=0)  # the vocabulary's size decides the rest (beyond the schema)
# logit_bias keys: token ids written as strings, as OpenAI
TOKEN_ID_KEY = re.compile(r"^[0-9]{1,20}$")
MAX_BIAS = 100  # what logit_bias may add to a logit, either way
LOGIT_BIAS_SCHEMA = {
    "propertyNames": {"pattern": TOKEN_ID_KEY.pattern},
    "additionalProperties": {"type": "number", "minimum": -MAX_BIAS, "maximum": MAX_BIAS},
}


class FieldError(ValueError):
    """A request field's value refused with a message that names it; ``field`` is the error's
    ``param``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedFieldError(FieldError):
    """A request field this server does not implement, set to a value that is not "off"."""


@dataclass(frozen=True)
class Unsupported:
    """A field we refuse unless ``is_off(value)``; ``what`` says what the client asked for."""

    is_off: Callable[[Any], bool]
    what: str
    # the message repeats the value's "type" (response_format: json_object, ...)
    names_type: bool = False


def _absent(value: Any) -> bool:
    """null, false, empty: what clients send when they mean "not used"."""
    return value is None or value is False or value in ("", [], {})


# OpenAI and vLLM request fields that change what is generated but are not implemented here. Fields
# that change nothing a client could notice (user, metadata, store, service_tier,
# parallel_tool_calls, stream_options ...) are tolerated and ignored.
UNSUPPORTED_FIELDS: dict[str, Unsupported] = {
    "functions": Unsupported(_absent, "function calling is not implemented"),
    "function_call": Unsupported(lambda v: _absent(v) or v in ("none", "auto"), "function calling is not implemented"),
    "audio": Unsupported(_absent, "audio output is not implemented"),
    "modalities": Unsupported(lambda v: _absent(v) or v == ["text"], "only text output is implemented"),
    "prediction": Unsupported(_absent, "predicted outputs are not implemented"),
    "web_search_options": Unsupported(_absent, "web search is not implemented"),
    "best_of": Unsupported(lambda v: v is None or v == 1, "best_of above 1 is not implemented"),
    "use_beam_search": Unsupported(_absent, "beam search is not implemented"),
    "suffix": Unsupported(_absent, "suffix (insertion) is not implemented"),
    "min_tokens": Unsupported(lambda v: v is None or v == 0, "min_tokens is not implemented"),
    "min_p": Unsupported(lambda v: v is None or v == 0, "min_p sampling is not implemented"),
    "prompt_logprobs": Unsupported(lambda v: v is None or v == 0, "prompt logprobs are not implemented"),
    "include_stop_str_in_output": Unsupported(_absent, "returning the stop string is not implemented"),
    "continue_final_message": Unsupported(_absent, "continuing the final message is not implemented"),
    "echo": Unsupported(lambda v: v is None or v is False, "echo is implemented for /v1/completions only"),
}  # fmt: skip


def refuse_unsupported(body: Any, implemented: Iterable[str] = (),
                       table: dict[str, Unsupported] = UNSUPPORTED_FIELDS) -> Any:
    """The before-validator of the generation requests: the first unsupported field set to
    something, refused. ``implemented``: the request type's own fields, never refused here (echo is
    one of completions', not chat's). ``table``: the route's unsupported fields (the Responses API
    has its own)."""
    if isinstance(body, dict):
        for name, rule in table.items():
            value = body.get(name)
            if name in body and name not in implemented and not rule.is_off(value):
                kind = value.get("type") if rule.names_type and isinstance(value, dict) else None
                asked = f" {quote(kind)}" if isinstance(kind, str) else ""
                raise UnsupportedFieldError(
                    name, f"'{name}'{asked} is not supported by this server: {rule.what}"
                )
    return body


class _Request(BaseModel):
    # strict: a value is the JSON type the schema states (no "5" for 5, no true for 1.0), so the
    # published schema admits exactly what is accepted
    model_config = ConfigDict(extra="ignore", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------------------- requests


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ImageURL(_Request):
    url: Text
    # "low": a small fixed visual-token budget; "high"/"auto"/None: the server's cap (see
    # inputs/budget.py)
    detail: Literal["auto", "low", "high"] | None = None
    # extension: at most this many visual tokens, <= the server's cap
    max_visual_tokens: integer(ge=1) | None = None  # type: ignore[valid-type]


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Request):
    """vLLM's ``video_url`` part: a container (MP4/MOV, WebM/MKV, AVI) as a data: URL, a file in the allowed media
    directory or a URL of an allowed host. Extensions: ask for less than the server's video budget, never more."""

    url: Text
    fps: float | None = Field(default=None, gt=0)
    max_frames: integer(ge=2) | None = None  # type: ignore[valid-type]
    max_visual_tokens: integer(ge=1) | None = None  # type: ignore[valid-type]


class VideoPart(_Request):
    type: Literal["video_url"]
    video_url: VideoURL


class VideoFramesPart(_Request):
    """Qwen's list form: ``{"type": "video", "video": [frame URLs, in order]}`` (each as an image_url's url)."""

    type: Literal["video"]
    video: list[Text] = Field(min_length=1)
    fps: float | None = Field(default=None, gt=0)
    max_frames: integer(ge=2) | None = None  # type: ignore[valid-type]
    max_visual_tokens: integer(ge=1) | None = None  # type: ignore[valid-type]


ContentPart = Annotated[
    Union[TextPart, ImagePart, VideoPart, VideoFramesPart], Field(discriminator="type")
]


# OpenAI's rule for function names (whole names: fullmatch)
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _tool_name(name: str) -> str:
    if not TOOL_NAME.fullmatch(name):
        raise ValueError(
            f"function names are 1 to 64 of a-z, A-Z, 0-9, _ and - (got {len(name)} characters "
            "that are not one)"
        )
    return name


ToolName = Annotated[
    Text, AfterValidator(_tool_name), Field(json_schema_extra={"pattern": TOOL_NAME.pattern})
]


class FunctionCallIn(_Request):
    name: ToolName
    arguments: Text  # a JSON object, as the model wrote it


class ToolCallIn(_Request):
    """A call an earlier assistant turn made, sent back in the conversation."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallIn


def _no_calls(calls: Any) -> Any:
    if calls:
        raise ValueError("only assistant messages carry tool_calls")
    return calls


# tool_calls on a turn that is not the assistant's: null or empty, as clients send them (the
# schema's maxItems 0, said in words by the validator)
NoCalls = Annotated[
    Annotated[list[ToolCallIn], Field(max_length=0)] | None, BeforeValidator(_no_calls)
]


class _MessageFields(_Request):
    """What a chat message may carry; each role's class below narrows it, so the published schema states per role
    what the validation takes (a tool message without its result is refused by both)."""

    role: str
    content: Text | list[ContentPart] | None = None
    tool_calls: NoCalls = None
    tool_call_id: Text | None = None  # tool turns: the call this result answers

    def texts(self) -> list[str]:
        """Every piece of text the client wrote in this message (what the tokenizer will see)."""
        calls = [c.function.arguments for c in self.tool_calls or ()]
        if self.content is None:
            return calls
        if isinstance(self.content, str):
            return [self.content, *calls]
        return [p.text for p in self.content if isinstance(p, TextPart)] + calls

    @property
    def num_images(self) -> int:
        """Its image and video parts (what makes preprocessing heavy)."""
        visual = (ImagePart, VideoPart, VideoFramesPart)
        return (
            sum(isinstance(p, visual) for p in self.content)
            if isinstance(self.content, list)
            else 0
        )

    def to_message(self) -> prompt.Message:
        role = "system" if self.role == "developer" else self.role
        calls = tuple(
            prompt.ToolCall(c.id, c.function.name, c.function.arguments)
            for c in self.tool_calls or ()
        )
        if not isinstance(self.content, list):
            return prompt.Message(role, self.content, calls, self.tool_call_id)
        return prompt.Message(
            role, tuple(_prompt_part(p) for p in self.content), calls, self.tool_call_id
        )


class SystemMessageIn(_MessageFields):
    # developer: OpenAI's newer name for system, rendered as system
    role: Literal["system", "developer"]


class UserMessageIn(_MessageFields):
    role: Literal["user"]


class AssistantMessageIn(_MessageFields):
    role: Literal["assistant"]
    tool_calls: list[ToolCallIn] | None = None


class ToolMessageIn(_MessageFields):
    role: Literal["tool"]
    content: Text  # the tool's result


# Roles are a closed set: the chat template prints the role verbatim, so free text there would be a
# template-injection channel.
_ROLE_TYPES = (SystemMessageIn, UserMessageIn, AssistantMessageIn, ToolMessageIn)
AnyMessage = Annotated[Union[_ROLE_TYPES], Field(discriminator="role")]  # type: ignore[valid-type]
# the discriminator's values: pydantic puts the one it chose in an error's location (errors.py
# leaves it out)
MESSAGE_ROLES = frozenset(
    role for m in _ROLE_TYPES for role in get_args(m.model_fields["role"].annotation)
)


class ChatMessage(RootModel[AnyMessage]):
    """One message of a conversation, of whichever role it names."""

    def texts(self) -> list[str]:
        return self.root.texts()

    @property
    def num_images(self) -> int:
        return self.root.num_images

    def to_message(self) -> prompt.Message:
        return self.root.to_message()


def _prompt_part(p: ContentPart) -> prompt.TextPart | prompt.ImagePart | prompt.VideoPart:
    if isinstance(p, TextPart):
        return prompt.TextPart(p.text)
    if isinstance(p, ImagePart):
        return prompt.ImagePart(url=p.image_url.url, detail=p.image_url.detail,
                                max_visual_tokens=p.image_url.max_visual_tokens)
    if isinstance(p, VideoPart):
        v = p.video_url
        return prompt.VideoPart(
            url=v.url, fps=v.fps, max_frames=v.max_frames, max_visual_tokens=v.max_visual_tokens
        )
    return prompt.VideoPart(frames=tuple(p.video), fps=p.fps, max_frames=p.max_frames,
                            max_visual_tokens=p.max_visual_tokens)


class FunctionDef(_Request):
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: ToolName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


# one conversation's validation for every route that takes one (chat completions, /tokenize)
Messages = Annotated[list[ChatMessage], Field(min_length=1)]


def to_chat_prompt(messages: list[ChatMessage], add_generation_prompt: bool = True,
                   tools: list[ToolDef] | None = None) -> prompt.ChatPrompt:
    functions = tuple(
        prompt.Function(t.function.name, t.function.description, t.function.parameters)
        for t in tools or ()
    )
    return prompt.ChatPrompt(
        tuple(m.to_message() for m in messages), add_generation_prompt, functions
    )


class ChatPromptFields(_Request):
    """What the chat template renders: the fields of every route that takes a conversation (chat completions and
    /tokenize's chat form), validated and rendered here once, so a field added here is counted by /tokenize as
    the chat route prefills it."""

    messages: Messages = checked(CHECK_MEDIA)
    tools: list[ToolDef] | None = checked(
        "function names distinct; a forced call's parameters a JSON schema this server compiles",
        default=None,
        max_length=128,
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = checked(
        "a named function must be one of tools; required or named needs tools", default=None)
    # false: the prompt ends with the last message (no assistant header)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatPromptFields:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise FieldError("tools", "function names in tools must be distinct")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", "tool_choice names a function that is not in tools")
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and not names:
            raise FieldError("tool_choice", "tool_choice requires tools")
        return self

    def to_prompt(self) -> prompt.ChatPrompt:
        return to_chat_prompt(self.messages, self.add_generation_prompt, self.tools)

    def texts(self) -> list[str]:
        return [t for m in self.messages for t in m.texts()]

    @property
    def num_images(self) -> int:
        return sum(m.num_images for m in self.messages)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far


class _SamplingFields(_Request):
    """Fields shared by chat and text completions. None means "the checkpoint's default"."""

    model: Text
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = checked(CHECK_ROOM, default=None)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Int64 | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = checked(
        CHECK_VOCABULARY, default=None)  # vLLM extension
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    n: integer(ge=1, le=MAX_CHOICES) | None = 1  # type: ignore[valid-type]
    ignore_eos: bool = False
    # token id (as a string, as OpenAI) -> added to its logit
    logit_bias: (
        Annotated[
            dict[Text, float], Field(max_length=MAX_LOGIT_BIAS, json_schema_extra=LOGIT_BIAS_SCHEMA)
        ]
        | None
    ) = checked(CHECK_VOCABULARY, default=None)
    # what the answer must match (docs/structured_outputs.md): OpenAI's, vLLM's, and vLLM's older
    # guided_* names
    response_format: dict[str, Any] | None = checked(CHECK_GRAMMAR, default=None)
    structured_outputs: dict[str, Any] | None = checked(CHECK_GRAMMAR, default=None)
    guided_json: Text | dict[str, Any] | None = checked(CHECK_GRAMMAR, default=None)
    guided_regex: Text | None = checked(CHECK_GRAMMAR, default=None)
    guided_choice: list[Text] | None = checked(CHECK_GRAMMAR, default=None)
    guided_grammar: Text | None = checked(CHECK_GRAMMAR, default=None)
    _output_spec: GrammarSpec | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        return refuse_unsupported(body, cls.model_fields)

    @model_validator(mode="after")
    def _one_output_constraint(self) -> _SamplingFields:
        """At most one of the constraint fields, each well formed (whether its grammar compiles is
        asked later, in the preprocessing pool, before the request queues)."""
        guided = {
            k: v
            for k, v in (
                ("json", self.guided_json),
                ("regex", self.guided_regex),
                ("choice", self.guided_choice),
                ("grammar", self.guided_grammar),
            )
            if v is not None
        }
        given = [
            name
            for name, v in (
                ("response_format", self.response_format),
                ("structured_outputs", self.structured_outputs),
            )
            if v is not None
        ]
        given += [f"guided_{k}" for k in guided]
        if len(given) > 1:
            raise FieldError(
                given[1], f"give at most one output constraint; got {', '.join(given)}"
            )
        try:
            if self.response_format is not None:
                spec = from_response_format(self.response_format)
            else:
                spec = from_structured_outputs(
                    self.structured_outputs
                    if self.structured_outputs is not None
                    else guided or None
                )
        except ValueError as err:
            raise FieldError(
                given[0], str(err).replace("structured_outputs.", "guided_") if guided else str(err)
            ) from None
        if spec is not None and guided:
            spec = replace(spec, origin=given[0])  # compile errors name what the client sent
        self._output_spec = spec
        return self

    @field_validator("n")
    @classmethod
    def _one_choice_by_default(cls, n: int | None) -> int:
        return 1 if n is None else n

    @property
    def _bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        """LOGIT_BIAS_SCHEMA's rules, checked here so the error names the field, not the client's
        key as one."""
        for key, value in (bias or {}).items():
            if not TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"logit_bias keys are token ids; {quote(key[:40])} is not one")
            if not math.isfinite(value) or not -MAX_BIAS <= value <= MAX_BIAS:
                raise ValueError(f"logit_bias values must be between -{MAX_BIAS} and {MAX_BIAS}, got {value!r} for "
                                 f"{key}")
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """As vLLM: only with include_usage too."""
        return (
            self.include_usage
            and self.stream_options is not None
            and self.stream_options.continuous_usage_stats
        )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _sampling(self, max_tokens: tuple[str, int | None], logprobs: bool, top_logprobs: int,
                  top_logprobs_name: str) -> prompt.SamplingRequest:
        field, value = max_tokens
        return prompt.SamplingRequest(
            max_tokens=value,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop_strings,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            structured=self._output_spec,
            logit_bias=self._bias,
            names=(("max_tokens", field), ("top_logprobs", top_logprobs_name)),
        )


class ChatCompletionRequest(ChatPromptFields, _SamplingFields):
    # OpenAI's newer name; wins over max_tokens
    max_completion_tokens: MaxTokens | None = checked(CHECK_ROOM, default=None)
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = checked("needs logprobs: true", default=None)
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _forced_call_or_output_constraint(self) -> ChatCompletionRequest:
        if self.forced_tools and self._output_spec is not None:
            raise FieldError(
                "tool_choice",
                "a required or named tool_choice cannot be combined with an output "
                "constraint (response_format, structured_outputs)",
            )
        return self

    @property
    def tool_mode(self) -> str:
        """none (no tools, or tool_choice none), auto, required or named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def forced_tools(self) -> bool:
        return self.tool_mode in ("required", "named")

    @property
    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(the field the client used, its value): error messages name the field the client sent."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def prompts(self) -> list[prompt.ChatPrompt]:
        return [self.to_prompt()]

    def to_sampling(self) -> prompt.SamplingRequest:
        sampling = self._sampling(
            self.requested_max_tokens, bool(self.logprobs), self.top_logprobs or 0, "top_logprobs"
        )
        # the answer is the call: valid JSON for the function's schema by construction
        if self.forced_tools:
            sampling = replace(
                sampling,
                structured=forced_call_spec(
                    [(t.function.name, t.function.parameters) for t in self.tools or ()],
                    self.tool_choice.function.name
                    if isinstance(self.tool_choice, NamedToolChoice)
                    else None,
                    self.parallel_tool_calls is not False,
                ),
            )
        return sampling


class CompletionRequest(_SamplingFields):
    # one prompt or several, as text or token ids (OpenAI's four forms); each gets n choices, index
    # prompt * n + j
    prompt: Text | NonEmpty[Text] | NonEmpty[Int64] | NonEmpty[NonEmpty[Int64]] = checked(
        f"each prompt must have at least one token, and with max_tokens fit the context; {CHECK_VOCABULARY}, no vision "
        f"placeholders; prompts x n at most {MAX_CHOICES}"
    )
    # number of alternatives per position, as in OpenAI's legacy API
    logprobs: TopLogprobs | None = None
    # the answer starts with the prompt; with logprobs, the prompt's tokens are scored too
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _some_prompt(cls, p: Any) -> Any:
        """The schema's min lengths, said in words before the union's four forms each report their
        own error."""
        if isinstance(p, list):
            if not p:
                raise ValueError("give at least one prompt (an empty list was sent)")
            empty = [i for i, ids in enumerate(p) if ids == []]
            if isinstance(p[0], list) and empty:
                raise ValueError(f"prompt[{empty[0]}] is an empty list of token ids")
        return p

    @model_validator(mode="after")
    def _bounded_choices(self) -> CompletionRequest:
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise FieldError(
                "prompt",
                f"{len(self.prompts())} prompts x n={self.n} is {len(self.prompts()) * self.n} "
                f"choices; at most {MAX_CHOICES} per request",
            )
        return self

    def prompts(self) -> list[prompt.TextPrompt | prompt.TokenPrompt]:
        p = self.prompt
        if isinstance(p, str):
            return [prompt.TextPrompt(p)]
        if all(isinstance(t, int) for t in p):
            return [prompt.TokenPrompt(tuple(p))]  # type: ignore[arg-type]
        if all(isinstance(t, str) for t in p):
            return [prompt.TextPrompt(t, f"prompt[{i}]") for i, t in enumerate(p)]  # type: ignore[arg-type]
        return [prompt.TokenPrompt(tuple(ids), f"prompt[{i}]") for i, ids in enumerate(p)]  # type: ignore[arg-type]

    def texts(self) -> list[str]:
        return [t for q in self.prompts() for t in q.texts()]

    @property
    def num_images(self) -> int:
        return 0

    @property
    def requested_max_tokens(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens


    def to_sampling(self) -> prompt.SamplingRequest:
        # the legacy API's logprobs=N means "N alternatives per position"
        sampling = self._sampling(
            self.requested_max_tokens, self.logprobs is not None, self.logprobs or 0, "logprobs"
        )
        if self.echo and self.logprobs is not None:
            sampling = replace(sampling, prompt_logprobs=self.logprobs)
        return sampling


class TokenizeRequest(ChatPromptFields):
    """Either a chat body (``messages`` and every other field the chat route renders: tools, tool_choice,
    add_generation_prompt) or a plain ``prompt``: exactly one of the two, as the schema's ``oneOf`` says too."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            ]
        }
    )

    model: Text | None = None
    # optional here: the prompt form has none
    messages: Messages | None = checked(CHECK_MEDIA, default=None)  # type: ignore[assignment]
    prompt: Text | None = checked(CHECK_FITS, default=None)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        return self

    def texts(self) -> list[str]:
        return [self.prompt] if self.prompt is not None else super().texts()

    @property
    def num_images(self) -> int:
        return 0 if self.messages is None else super().num_images

    def to_prompt(self) -> prompt.Prompt:  # type: ignore[override]
        return prompt.TextPrompt(self.prompt) if self.prompt is not None else super().to_prompt()


# ---------------------------------------------------------------------------------------- responses


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # Timeline.to_dict(); see the module docstring
    firsttoken: dict[str, float | int | str | None] | None = None


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


class FunctionCallOut(_Response):
    name: str
    arguments: str  # a JSON object's text


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None  # left out of the body when None (as vLLM's)

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler: Any) -> dict[str, Any]:
        body = handler(self)
        if body.get("tool_calls") is None:
            body.pop("tool_calls", None)
        return body


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


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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
        """vLLM's framing: delta carries only the keys that are set, and ``usage`` only on the usage
        chunk."""
        body: dict[str, Any] = self.model_dump(exclude={"usage"} if self.usage is None else set())
        for choice, raw in zip(body["choices"], self.choices):
            choice["delta"] = raw.delta.model_dump(exclude_none=True)
        return _dumps(body)


class CompletionLogprobs(_Response):
    tokens: list[str]
    # None: an echoed prompt's first token (nothing before it to predict it)
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
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
    # the budget the image was resized under (server cap, detail=low, or max_visual_tokens)
    budget_tokens: int
    # a tiling family's cut (InternVL): [rows, cols] of the crops, and the tiles the tower encodes
    # (a thumbnail too where there is more than one crop); null for native resolution
    tile_grid: tuple[int, int] | None = None
    num_tiles: int | None = None


class VideoTokenInfo(_Response):
    """A video as planned from its container's header and packets, nothing decoded."""

    original_size: tuple[int, int]  # (width, height)
    resized_size: tuple[int, int]  # (width, height) of every sampled frame
    duration_s: float
    source_frames: int
    num_frames: int  # frames sampled (an even count; two per grid)
    sample_fps: float
    num_tokens: int  # visual tokens: grids x tokens per grid
    # the per-video cap it was planned under (--video-max-tokens or max_visual_tokens)
    budget_tokens: int


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    num_text_tokens: int  # extension: count minus the image- and video-pad tokens
    images: list[ImageTokenInfo] = Field(default_factory=list)  # extension
    videos: list[VideoTokenInfo] = Field(default_factory=list)  # extension
    # extension: the server's prompt limit (text + image + template tokens)
    max_input_tokens: int | None = None
    # extension: seconds to this prompt's first token if it were sent now, from the engine's
    # step-cost model and the work queued ahead of it (None until the model is fitted)
    predicted_ttft_s: float | None = None


class Health(_Response):
    status: Literal["ok"] = "ok"


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Response):
    error: ErrorInfo


class StreamFrames:
    """One stream's token chunks as SSE frames, rendered without the response models: every chunk of
    a stream shares its id, object, created and model, so that head is rendered once, and a chunk
    carrying no logprobs is the head plus its delta (chat) or text (completions) and finish reason.
    The bytes are the models' own (``ChatCompletionChunk.to_json``, ``CompletionResponse.to_json``;
    tests/unit/test_api_protocol.py compares them): the models' cost would be paid on the event loop
    once per token per stream while the engine's step runs on the same cores (why:
    docs/runs/notes/decode-kernels.md#what-serving-adds-to-a-decode-token-session-32). Chunks with
    logprobs and the usage chunk still go through the models."""

    __slots__ = ("_head",)

    def __init__(
        self,
        obj: Literal["chat.completion.chunk", "text_completion"],
        response_id: str,
        created: int,
        model: str,
    ) -> None:
        head = _dumps({"id": response_id, "object": obj, "created": created, "model": model})
        self._head = "data: " + head[:-1] + ',"choices":[{"index":'

    def chat(
        self,
        content: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        index: int = 0,
    ) -> str:
        """``delta`` holds the role when ``role`` and the content unless it is None (the models'
        exclude_none)."""
        delta = '"role":"assistant"' if role else ""
        if content is not None:
            delta += ("," if role else "") + '"content":' + _dumps(content)
        return (
            self._head
            + str(index)
            + ',"delta":{'
            + delta
            + '},"logprobs":null,"finish_reason":'
            + _finish(finish_reason)
        )

    def completion(self, text: str, finish_reason: str | None = None, index: int = 0) -> str:
        return (
            self._head
            + str(index)
            + ',"text":'
            + _dumps(text)
            + ',"logprobs":null,"finish_reason":'
            + _finish(finish_reason)
        )


def _finish(reason: str | None) -> str:
    return ("null" if reason is None else _dumps(reason)) + "}]}\n\n"


def _dumps(body: Any) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))
