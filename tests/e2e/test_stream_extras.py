"""A streamed answer carries everything the same request gets unstreamed: per choice the same logprob entries, the
same text or tool calls, and with ``stream_options.continuous_usage_stats`` every chunk its choice's usage so far,
ending at the answer's count. One matrix over every streamed path (plain chat, n > 1, tools in each mode,
structured outputs, completions with and without echo, the Responses API), through the real server and the
official openai client; greedy or seeded, so the two answers are the same tokens."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.e2e.conftest import LiveServer
from tests.e2e.test_tools import ASK, TOOLS

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SEEDED = {"temperature": 1.0, "seed": 11}

CHAT_CASES: dict[str, dict] = {
    "chat": {},
    "chat n=2": {"n": 2, **SEEDED},
    "chat tools auto": {"tools": TOOLS},
    "chat tools required": {"tools": TOOLS, "tool_choice": "required", "max_tokens": 40},
    "chat tools named": {"tools": TOOLS, "tool_choice": NAMED, "max_tokens": 40},
    "chat tools required n=2": {"tools": TOOLS, "tool_choice": "required", "max_tokens": 40, "n": 2, **SEEDED},
    "chat json_object": {"response_format": {"type": "json_object"}, "max_tokens": 30},
}
COMPLETION_CASES: dict[str, dict] = {
    "completions": {},
    "completions n=2": {"n": 2, **SEEDED},
    "completions echo": {"echo": True},
}


@dataclass
class Choice:
    """What a client reads of one choice: its text, its tool calls (name, arguments), its logprob entries."""

    text: str = ""
    calls: dict[int, list[str]] = field(default_factory=dict)
    logprobs: list[tuple[str, float | None]] = field(default_factory=list)
    usages: list[int] = field(default_factory=list)  # completion_tokens of each of its chunks' usage (streamed)
    num_chunks: int = 0


def whole_chat(client, model: str, body: dict) -> tuple[dict[int, Choice], Any]:
    out = client.chat.completions.create(model=model, **body)
    choices = {}
    for c in out.choices:
        calls = {k: [t.function.name, t.function.arguments] for k, t in enumerate(c.message.tool_calls or ())}
        entries = [(e.token, e.logprob) for e in (c.logprobs.content if c.logprobs else [])]
        choices[c.index] = Choice(c.message.content or "", calls, entries)
    return choices, out.usage


def streamed(chunks: Iterable[Any], read: Callable[[Choice, Any], None]) -> tuple[dict[int, Choice], Any]:
    """A stream's choices (each chunk's choice read into its Choice by ``read``) and its last chunk's usage."""
    choices: dict[int, Choice] = defaultdict(Choice)
    usage = None
    for chunk in chunks:
        if not chunk.choices:
            usage = chunk.usage
            continue
        for c in chunk.choices:
            got = choices[c.index]
            got.num_chunks += 1
            read(got, c)
            if chunk.usage is not None:
                got.usages.append(chunk.usage.completion_tokens)
    return dict(choices), usage


def streamed_chat(client, model: str, body: dict) -> tuple[dict[int, Choice], Any]:
    def read(got: Choice, c: Any) -> None:
        got.text += c.delta.content or ""
        for t in c.delta.tool_calls or ():
            name, arguments = got.calls.setdefault(t.index, ["", ""])
            got.calls[t.index] = [name + (t.function.name or ""), arguments + (t.function.arguments or "")]
        got.logprobs += [(e.token, e.logprob) for e in (c.logprobs.content if c.logprobs else [])]

    return streamed(client.chat.completions.create(model=model, stream=True, stream_options=CONTINUOUS, **body), read)


def whole_completion(client, model: str, body: dict) -> tuple[dict[int, Choice], Any]:
    out = client.completions.create(model=model, **body)
    return {c.index: Choice(c.text, {}, list(zip(c.logprobs.tokens, c.logprobs.token_logprobs)))
            for c in out.choices}, out.usage


def streamed_completion(client, model: str, body: dict) -> tuple[dict[int, Choice], Any]:
    def read(got: Choice, c: Any) -> None:
        got.text += c.text
        if c.logprobs is not None:
            got.logprobs += list(zip(c.logprobs.tokens, c.logprobs.token_logprobs))

    return streamed(client.completions.create(model=model, stream=True, stream_options=CONTINUOUS, **body), read)


def whole_response(client, model: str, body: dict) -> tuple[dict[int, Choice], Any]:
    out = client.responses.create(model=model, **body)
    return {0: Choice(out.output_text)}, out.usage


def streamed_response(client, model: str, body: dict) -> tuple[dict[int, Choice], Any]:
    events = list(client.responses.create(model=model, stream=True, **body))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return {0: Choice(text)}, events[-1].response.usage


@dataclass(frozen=True)
class Case:
    whole: Callable[..., tuple[dict[int, Choice], Any]]
    streamed: Callable[..., tuple[dict[int, Choice], Any]]
    body: dict
    scored: bool = True  # logprobs asked for (and continuous usage: the Responses API has neither)
    echo: bool = False  # completions' echo: each choice's logprobs score its prompt too

    def differences(self, client, model: str) -> list[str]:
        """What the streamed answer lacks or gets wrong, compared with the whole one."""
        whole, whole_usage = self.whole(client, model, self.body)
        streamed, usage = self.streamed(client, model, self.body)
        if sorted(streamed) != sorted(whole):
            return [f"choices {sorted(streamed)} streamed, {sorted(whole)} whole"]
        found = []
        if _counts(usage) != _counts(whole_usage):
            found.append(f"final usage {_counts(usage)} != {_counts(whole_usage)} whole")
        for i, w in sorted(whole.items()):
            s = streamed[i]
            if (s.text.strip(), s.calls) != (w.text.strip(), w.calls):
                found.append(f"choice {i}: text and calls {s.text!r} {s.calls} != {w.text!r} {w.calls} whole")
            if not self.scored:
                continue
            if not w.logprobs or [t for t, _ in s.logprobs] != [t for t, _ in w.logprobs]:
                found.append(f"choice {i}: {len(s.logprobs)} logprob entries streamed, {len(w.logprobs)} whole")
            if len(s.usages) != s.num_chunks:
                found.append(f"choice {i}: {len(s.usages)} of its {s.num_chunks} chunks carry usage")
            generated = len(w.logprobs) - (_counts(whole_usage)[0] if self.echo else 0)
            if not s.usages or s.usages != sorted(s.usages) or s.usages[-1] != generated:
                found.append(f"choice {i}: running usage {s.usages} for {generated} tokens generated")
        return found


def _counts(usage: Any) -> tuple[int, int] | None:
    """(prompt, output) tokens of a chat/completions or a Responses usage."""
    if usage is None:
        return None
    if hasattr(usage, "input_tokens"):
        return usage.input_tokens, usage.output_tokens
    return usage.prompt_tokens, usage.completion_tokens


def cases() -> dict[str, Case]:
    chat = {"messages": ASK, "max_tokens": 12, "temperature": 0.0, "logprobs": True, "top_logprobs": 2}
    completion = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.0, "logprobs": 2}
    response = {"input": "Tell me about lighthouses.", "max_output_tokens": 12, "temperature": 0.0}
    return {
        **{name: Case(whole_chat, streamed_chat, {**chat, **extra}) for name, extra in CHAT_CASES.items()},
        **{name: Case(whole_completion, streamed_completion, {**completion, **extra}, echo="echo" in extra)
           for name, extra in COMPLETION_CASES.items()},
        "responses": Case(whole_response, streamed_response, response, scored=False),
    }


def test_every_streamed_path_carries_the_logprobs_and_running_usage_it_asked_for(live_server: LiveServer):
    client, model = live_server.client(), live_server.model
    failures = {name: found for name, case in cases().items() if (found := case.differences(client, model))}
    assert not failures, "\n".join(f"{name}: {found}" for name, found in failures.items())
    live_server.wait_idle()
