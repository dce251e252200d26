"""Client text inside our own messages: bounded, and always encodable.

Error messages sometimes name what the client sent (an unknown model, a content-part tag, an
encoding). Two things go wrong when they echo it raw: a 100,000-character value comes back whole,
and a string holding a lone UTF-16 surrogate (valid JSON, ``"\\ud800"``) cannot be encoded as UTF-8,
so rendering the error itself fails. ``quote`` is the only way a message includes client text;
``printable`` makes any message encodable.

A leaf module (re only): the schemas, the error renderer and the input processor all use it.
"""

from __future__ import annotations

import re

QUOTE_MAX_CHARS = 64  # client text a message may repeat; longer values are cut with an ellipsis
# never in valid text: the JSON decoder joins proper pairs
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
ELLIPSIS = "…"


def printable(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD, so it encodes as UTF-8."""
    return LONE_SURROGATE.sub("\ufffd", text)


def quote(value: object, limit: int = QUOTE_MAX_CHARS) -> str:
    """At most ``limit`` characters of ``value`` (ending in an ellipsis when cut), encodable as
    UTF-8."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = text[: limit - 1] + ELLIPSIS
    return printable(text)
