"""llguidance's messages made fit for a client: one line, bounded (they can carry the grammar and
the parser's state)."""

from __future__ import annotations

MAX_MESSAGE_CHARS = 600


def one_line(message: str) -> str:
    message = message.split("<state>", 1)[0]
    text = " ".join(message.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."
