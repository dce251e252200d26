"""The offline API's arguments as the HTTP routes' bodies: ``LLM.chat``'s conversation and
``LLM.complete``'s prompt, with OpenAI-style sampling fields, validated by /v1/chat/completions' and
/v1/completions' own schemas, so every field means, converts and is refused as it is over HTTP (a
refusal is an ``InputError`` with that route's 400 message and param). Two differences: a key that
is no field of the body is refused (HTTP ignores it, for clients that send extras), and so are the
fields that frame an answer rather than sample it (``NOT_SAMPLING``)."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from firsttoken.api.body import validate_model
from firsttoken.api.errors import validation_error_message
from firsttoken.api.protocol import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from firsttoken.inputs.errors import InputError
from firsttoken.inputs.prompt import (
    ChatPrompt,
    ImagePart,
    Message,
    Prompt,
    SamplingRequest,
)
from firsttoken.quoting import quote

M = TypeVar("M", bound=BaseModel)
Conversation = Sequence[Mapping[str, Any]]
Sampling = SamplingRequest | Mapping[str, Any] | None

# the ``model`` of the bodies the offline API validates (it serves the model it loaded)
OFFLINE_MODEL = "offline"

# Request fields that say what to answer or how to frame the answer, not how to sample: the offline
# API takes its prompts as arguments and answers each with one whole RequestResult of text.
NOT_SAMPLING: dict[str, str] = {
    "model": "the LLM serves the model it loaded",
    "messages": "the conversation is chat()'s first argument",
    "prompt": "the prompts are complete()'s first argument",
    "stream": "results come back whole",
    "stream_options": "results come back whole",
    "n": "each prompt gets one result; repeat the prompt (with other seeds) for more",
    "echo": "a result holds the generated text only",
    "tools": "a result holds text, not parsed tool calls",
    "tool_choice": "a result holds text, not parsed tool calls",
    "parallel_tool_calls": "a result holds text, not parsed tool calls",
}


def chat_request(conversation: Conversation, sampling: Sampling) -> tuple[ChatPrompt, SamplingRequest]:
    """The conversation and OpenAI-style sampling fields validated as /v1/chat/completions validates
    its body (a refusal is its 400's message); ``{"type": "image_pil", "image_pil": img}`` parts
    (PIL images, as vLLM's offline API accepts) stand in as empty text parts, then become PNG
    bytes."""
    messages = (
        [_without_pil(m) for m in conversation]
        if isinstance(conversation, Sequence)
        else conversation
    )
    body = {
        **_sampling_fields(sampling, ChatCompletionRequest, "/v1/chat/completions"),
        "model": OFFLINE_MODEL,
        "messages": messages,
    }
    request = _validated(ChatCompletionRequest, body)
    prompt = request.to_prompt()
    prompt = replace(
        prompt,
        messages=tuple(
            _with_pil(m, original) for m, original in zip(prompt.messages, conversation)
        ),
    )
    return prompt, sampling if isinstance(sampling, SamplingRequest) else request.to_sampling()


def completion_request(text: str, sampling: Sampling) -> tuple[Prompt, SamplingRequest]:
    """A prompt and OpenAI-style sampling fields validated as /v1/completions validates its body."""
    body = {
        **_sampling_fields(sampling, CompletionRequest, "/v1/completions"),
        "model": OFFLINE_MODEL,
        "prompt": text,
    }
    request = _validated(CompletionRequest, body)
    return request.prompts()[0], sampling if isinstance(
        sampling, SamplingRequest
    ) else request.to_sampling()


def _validated(model: type[M], body: dict[str, Any]) -> M:
    """``body`` as its HTTP route validates it; a refusal raises InputError (a ValueError) with the
    message and param of that route's 400."""
    try:
        return validate_model(body, model)
    except RequestValidationError as err:
        raise InputError(*validation_error_message(err)) from None


def _sampling_fields(sampling: Sampling, model: type[BaseModel], route: str) -> dict[str, Any]:
    """OpenAI-style sampling fields, each a field of ``model`` (or one of UNSUPPORTED_FIELDS, which
    its validation refuses unless "off"), none of NOT_SAMPLING; a SamplingRequest (already the
    processor's value) or None: none."""
    if sampling is None or isinstance(sampling, SamplingRequest):
        return {}
    if not isinstance(sampling, Mapping):
        raise InputError(f"sampling is a mapping of request fields or a SamplingRequest, not a "
                         f"{type(sampling).__name__}")
    for key in sampling:
        if key in NOT_SAMPLING:
            raise InputError(f"'{key}' is not a sampling field: {NOT_SAMPLING[key]}", key)
        if key not in model.model_fields and key not in UNSUPPORTED_FIELDS:
            raise InputError(f"'{quote(str(key))}' is not a field of {route}'s body", str(key))
    return dict(sampling)


def _without_pil(message: Any) -> Any:
    """A message with each PIL image part as an empty text part (the schema knows no PIL images)."""
    content = message.get("content") if isinstance(message, Mapping) else None
    if not isinstance(content, list) or not any(_is_pil_part(p) for p in content):
        return message
    return {
        **message,
        "content": [{"type": "text", "text": ""} if _is_pil_part(p) else p for p in content],
    }


def _with_pil(message: Message, original: Any) -> Message:
    """``message`` with the PIL images of ``original`` (the client's message) back in place of their
    stand-ins."""
    content = original.get("content") if isinstance(original, Mapping) else None
    if not isinstance(content, list) or not any(_is_pil_part(p) for p in content):
        return message
    parts = [
        ImagePart(data=_png(p["image_pil"])) if _is_pil_part(p) else q
        for p, q in zip(content, message.content)
    ]
    return replace(message, content=tuple(parts))


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _is_pil_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image_pil"


