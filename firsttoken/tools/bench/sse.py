"""Server-sent events as OpenAI-compatible servers frame chat streams, parsed line by line.

An event is the ``data:`` lines up to a blank line (joined with newlines); ``event:`` names it (some
servers send ``event: error``); ``:`` lines are comments (keep-alives). ``data: [DONE]`` ends the
stream. Parsing is incremental so a client can timestamp each event as it arrives.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str = "message"

    @property
    def is_done(self) -> bool:
        return self.data.strip() == "[DONE]"


class SSEParser:
    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = "message"

    def feed_line(self, line: str) -> SSEEvent | None:
        """One line without its terminator; returns the event a blank line completes, if any."""
        line = line.rstrip("\r")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        return None

    def flush(self) -> SSEEvent | None:
        """The last event when the stream ends without its closing blank line."""
        return self._dispatch()

    def _dispatch(self) -> SSEEvent | None:
        if not self._data:
            self._event = "message"
            return None
        event = SSEEvent("\n".join(self._data), self._event)
        self._data, self._event = [], "message"
        return event
