"""Tool calls out of the answer's text, whole or as it streams (inputs/tool_prompts.py puts the tools in
the prompt).

By ``tool_choice`` (``ChatCompletionRequest.tool_mode``):
- ``auto``: the model may write hermes calls,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, anywhere in its text; each
  well-formed one (JSON, a name among the tools', an object of arguments) becomes a tool call, the
  text outside them the content. A malformed call stays in the content as written: never a 500.
- ``named``: the answer is the arguments object (held to the function's schema by the grammar),
  streamed as the call's argument deltas.
- ``required``: the answer is a JSON array of ``{"name", "arguments"}`` (held to the tools'
  schemas): each call goes out once its name is read, then its arguments text as it arrives
  (``_ArrayScan``). An answer cut short (``length``) keeps the calls begun; one with no call begun
  is the content.
Under ``auto`` a call goes out whole when its ``</tool_call>`` arrives: nothing holds that text to
JSON, and a call once sent cannot be taken back into the content.
- ``none``: no parsing.
A choice with calls finishes with ``tool_calls`` (``stop`` for a named function, as OpenAI does).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class Piece:
    """One thing to send: content text, the start of a call (its id and name), or more of a call's
    arguments."""

    content: str | None = None
    index: int | None = None  # the call's place among this answer's calls
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolOutput:
    mode: str  # auto | named | required
    names: frozenset[str]
    named: str | None = None  # with mode "named"
    calls: list[Call] = field(default_factory=list)
    _buffer: str = ""
    _in_call: bool = False
    _named_id: str = field(default_factory=new_call_id)
    _array: _ArrayScan = field(default_factory=lambda: _ArrayScan())

    # ---- streaming -------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Piece]:
        if self.mode == "named":
            pieces = [] if self.calls else [self._start_named()]
            return pieces + ([Piece(index=0, arguments=text)] if text else [])
        self._buffer += text
        if self.mode == "required":
            return self._array.feed(text, self.calls)
        return self._scan()

    def finish(self) -> list[Piece]:
        """What is left once the answer ends."""
        if self.mode == "named":
            return [] if self.calls else [self._start_named()]
        if self.mode == "required":
            text, self._buffer = self._buffer, ""
            return [] if self.calls or not text else [Piece(content=text)]
        pieces = self._scan()
        rest = (START if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return pieces + ([Piece(content=rest)] if rest.strip() or (rest and not self.calls) else [])

    def finish_reason(self, reason: str | None) -> str | None:
        if self.calls and reason == "stop" and self.mode != "named":
            return "tool_calls"
        return reason

    # ---- a whole answer --------------------------------------------------------------------------
    def complete(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a finished answer."""
        pieces = self.feed(text) + self.finish()
        content = "".join(p.content for p in pieces if p.content is not None)
        if self.mode == "named":
            self.calls = [Call(self._named_id, self.named or "", text)]
            return None, self.calls
        return (content.strip() or None) if self.calls else content, self.calls

    # ---- internals -------------------------------------------------------------------------------
    def _start_named(self) -> Piece:
        self.calls.append(Call(self._named_id, self.named or "", ""))
        return Piece(index=0, call_id=self._named_id, name=self.named, arguments="")

    def _add(self, call: Call) -> list[Piece]:
        self.calls.append(call)
        index = len(self.calls) - 1
        return [Piece(index=index, call_id=call.id, name=call.name, arguments=call.arguments)]

    def _scan(self) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(START)
                if at < 0:
                    # may be the start of a call: held back
                    keep = _partial_suffix(self._buffer, START)
                    text, self._buffer = (
                        self._buffer[: len(self._buffer) - keep],
                        self._buffer[len(self._buffer) - keep :],
                    )
                    if text and (text.strip() or not self.calls):
                        pieces.append(Piece(content=text))
                    return pieces
                before, self._buffer, self._in_call = (
                    self._buffer[:at],
                    self._buffer[at + len(START) :],
                    True,
                )
                if before.strip():
                    pieces.append(Piece(content=before))
            else:
                end = self._buffer.find(END)
                if end < 0:
                    return pieces
                body, self._buffer, self._in_call = (
                    self._buffer[:end],
                    self._buffer[end + len(END) :],
                    False,
                )
                call = _hermes_call(body, self.names)
                pieces += (
                    self._add(call) if call is not None else [Piece(content=START + body + END)]
                )


def _hermes_call(body: str, names: frozenset[str]) -> Call | None:
    return _call_of(_loads(body), names)


def _loads(text: str) -> object:
    """The JSON value of ``text``, or None when it is not JSON (None is never a call, an array or
    arguments)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call_of(item: object, names: frozenset[str]) -> Call | None:
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return Call(new_call_id(), item["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that ``marker`` starts with."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _ArrayScan:
    """Calls out of ``[{"name": ..., "arguments": {...}}, ...]`` as its text arrives, one character
    at a time: the grammar holds the text to that shape, so a call begins once its name's string
    closes, and its arguments are the raw text of its ``arguments`` value. Depth 1 is inside the
    array, 2 inside a call, 3+ inside its arguments."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    key: str = ""  # the call key being read, or whose value is being read
    token: str = ""  # the raw text of the current key or name string
    reading: str = ""  # "key", "name", "arguments" or ""
    name: str | None = None
    # this call's arguments so far (all of them, sent or held until the name is known)
    arguments: str = ""
    sent: int = 0  # how much of ``arguments`` went out

    def feed(self, text: str, calls: list[Call]) -> list[Piece]:
        pieces: list[Piece] = []
        for ch in text:
            self._step(ch, calls, pieces)
        self._flush(calls, pieces)
        return pieces

    def _flush(self, calls: list[Call], pieces: list[Piece]) -> None:
        """This call's arguments not yet sent, out (once its name is known)."""
        if self.name is not None and self.sent < len(self.arguments):
            pieces.append(Piece(index=len(calls) - 1, arguments=self.arguments[self.sent:]))
            self.sent = len(self.arguments)
            calls[-1] = replace(calls[-1], arguments=self.arguments)

    def _step(self, ch: str, calls: list[Call], pieces: list[Piece]) -> None:
        if self.reading == "arguments":
            self.arguments += ch
        if self.in_string:
            if self.reading in ("key", "name"):
                self.token += ch
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 2:
                    self._string_closed(calls, pieces)
            return
        if ch == '"':
            self.in_string = True
            if self.depth == 2 and self.reading == "":
                self.reading, self.token = "key", ch
            elif self.depth == 2 and self.reading == "value" and self.key == "name":
                self.reading, self.token = "name", ch
            elif self.depth == 2 and self.reading == "value":
                self.reading = "other"
        elif ch in "[{":
            if self.depth == 2 and self.reading == "value":
                self.reading = "arguments" if self.key == "arguments" else "other"
                if self.reading == "arguments":
                    self.arguments += ch
            self.depth += 1
            if self.depth == 2:
                self._flush(calls, pieces)
                self.name, self.arguments, self.sent, self.reading = None, "", 0, ""
        elif ch in "]}":
            self.depth -= 1
            if self.depth == 2 and self.reading in ("arguments", "other"):
                self.reading = "done"
        elif ch == ":" and self.depth == 2 and self.reading == "colon":
            self.reading = "value"
        elif ch == "," and self.depth == 2:
            self.reading = ""
        elif not ch.isspace() and self.depth == 2 and self.reading == "value":
            self.reading = "other"  # a number, true, false or null

    def _string_closed(self, calls: list[Call], pieces: list[Piece]) -> None:
        if self.reading == "key":
            self.key, self.reading = str(_loads(self.token)), "colon"
        elif self.reading == "name":
            self.name, self.reading = str(_loads(self.token)), "done"
            calls.append(Call(new_call_id(), self.name, ""))
            pieces.append(
                Piece(index=len(calls) - 1, call_id=calls[-1].id, name=self.name, arguments="")
            )
        elif self.reading == "other":
            self.reading = "done"
