"""What the soak reads back: one request's answer, streamed or not, on the chat or the Responses route, as one
plain value (``Answer``), so that a streamed answer compares equal to the same answer sent whole and a Responses
answer to its chat twin."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the JSON text as sent (whole, or its deltas joined)


@dataclass(frozen=True)
class Logprob:
    token: str
    num_alternatives: int  # entries in its top_logprobs


@dataclass(frozen=True)
class Choice:
    text: str  # "" when the message had no content (a forced tool call)
    finish_reason: str | None  # chat's; a response's status maps onto it (completed: stop, incomplete: length)
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[Logprob, ...] | None = None  # None: none came back


@dataclass(frozen=True)
class Answer:
    """One request's outcome. Two answers to one greedy request are equal when their choices and token counts are:
    ids, timings and Retry-After are not compared."""

    status: int
    choices: tuple[Choice, ...] = ()
    completion_tokens: int | None = None  # usage's (all choices together); streamed chat asks for it with include_usage
    error: str | None = field(default=None, compare=False)  # the error body's message, or a stream's error event
    retry_after: str | None = field(default=None, compare=False)  # a 429's Retry-After header

    def times(self, copies: int) -> Answer:
        """The answer ``copies`` greedy choices of one request make: each one this answer's, tokens summed."""
        tokens = None if self.completion_tokens is None else self.completion_tokens * copies
        return Answer(self.status, self.choices * copies, tokens)


@dataclass(frozen=True)
class Route:
    """An OpenAI route: where it is, what a streamed request adds to its body, and how each form of its answer
    reads into an Answer."""

    path: str
    stream_fields: dict
    read_whole: Callable[[dict], Answer]
    read_stream: Callable[[AsyncIterator[str]], Awaitable[Answer]]


# ------------------------------------------------------------------------------------------- chat


def _logprobs(content: list[dict] | None) -> tuple[Logprob, ...]:
    return tuple(Logprob(e["token"], len(e.get("top_logprobs") or ())) for e in content or ())


def _read_chat(body: dict) -> Answer:
    choices = []
    for c in sorted(body["choices"], key=lambda c: c["index"]):
        message = c["message"]
        calls = tuple(ToolCall(t["function"]["name"], t["function"]["arguments"]) for t in message.get("tool_calls")
                      or ())
        logprobs = None if c.get("logprobs") is None else _logprobs(c["logprobs"].get("content"))
        choices.append(Choice(message.get("content") or "", c["finish_reason"], calls, logprobs))
    return Answer(200, tuple(choices), body["usage"]["completion_tokens"])


@dataclass
class _ChoiceParts:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    calls: dict[int, list[str]] = field(default_factory=dict)  # tool call index -> [name, argument deltas...]
    logprobs: list[Logprob] | None = None

    def add(self, delta_choice: dict) -> None:
        delta = delta_choice.get("delta") or {}
        self.text.append(delta.get("content") or "")
        for call in delta.get("tool_calls") or ():
            parts = self.calls.setdefault(call["index"], [""])
            function = call.get("function") or {}
            parts[0] = function.get("name") or parts[0]
            parts.append(function.get("arguments") or "")
        if delta_choice.get("logprobs") is not None:
            self.logprobs = (self.logprobs or []) + list(_logprobs(delta_choice["logprobs"].get("content")))
        self.finish_reason = delta_choice.get("finish_reason") or self.finish_reason

    def choice(self) -> Choice:
        calls = tuple(ToolCall(p[0], "".join(p[1:])) for _, p in sorted(self.calls.items()))
        return Choice("".join(self.text), self.finish_reason, calls,
                      None if self.logprobs is None else tuple(self.logprobs))


async def _read_chat_stream(lines: AsyncIterator[str]) -> Answer:
    """Chat's SSE: ``data: {chunk}`` lines (choices by index, then a usage chunk), ``data: {"error": ...}`` when the
    request failed mid-stream, ``data: [DONE]`` last."""
    by_index: dict[int, _ChoiceParts] = {}
    tokens, error = None, None
    async for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            error = chunk["error"].get("message", "an error event")
        for c in chunk.get("choices") or ():
            by_index.setdefault(c["index"], _ChoiceParts()).add(c)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    choices = tuple(parts.choice() for _, parts in sorted(by_index.items()))
    return Answer(200, choices, tokens, error=error)


# ------------------------------------------------------------------------------------------- responses


_STATUS_FINISH = {"completed": "stop", "incomplete": "length"}


def _read_response(body: dict) -> Answer:
    text = "".join(part.get("text", "") for item in body["output"] if item["type"] == "message"
                   for part in item["content"])
    usage = body.get("usage") or {}
    return Answer(200, (Choice(text, _STATUS_FINISH.get(body["status"], body["status"])),),
                  usage.get("output_tokens"), error=(body.get("error") or {}).get("message"))


async def _read_response_stream(lines: AsyncIterator[str]) -> Answer:
    """The Responses route's events: ``response.output_text.delta`` pieces, ended by response.completed or
    response.incomplete (the whole response, usage included) or one ``error`` event."""
    deltas: list[str] = []
    final: dict | None = None
    error = None
    async for line in lines:
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        if event["type"] == "response.output_text.delta":
            deltas.append(event["delta"])
        elif event["type"] in ("response.completed", "response.incomplete", "response.failed"):
            final = event["response"]
        elif event["type"] == "error":
            error = event.get("message", "an error event")
    if final is None:
        return Answer(200, (Choice("".join(deltas), None),), error=error or "the stream ended without a response")
    whole = _read_response(final)
    if whole.choices[0].text != "".join(deltas):
        error = error or "the deltas do not make the final response's text"
    return Answer(200, whole.choices, whole.completion_tokens, error=error or whole.error)


CHAT = Route("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": True}}, _read_chat,
             _read_chat_stream)
RESPONSES = Route("/v1/responses", {"stream": True}, _read_response, _read_response_stream)


# ------------------------------------------------------------------------------------------- sending


def _refused(r: httpx.Response) -> Answer:
    try:
        error = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        error = None  # not OpenAI's error shape: a rule that wants one says so
    return Answer(r.status_code, error=error, retry_after=r.headers.get("retry-after"))


async def send(client: httpx.AsyncClient, route: Route, body: dict, stream: bool) -> Answer:
    """One request; a streamed answer is reassembled from its events."""
    if not stream:
        r = await client.post(route.path, json=body)
        return route.read_whole(r.json()) if r.status_code == 200 else _refused(r)
    async with client.stream("POST", route.path, json={**body, **route.stream_fields}) as r:
        if r.status_code != 200:
            await r.aread()
            return _refused(r)
        return await route.read_stream(r.aiter_lines())
