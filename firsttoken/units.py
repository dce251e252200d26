"""Units shared by the server's flags and the operator tools, so `plan`'s advice means what `serve` reads."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B?)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """'24GiB' -> 24 x 2**30, '80G' / '80GB' -> 80 x 10**9, '1073741824' -> bytes as given."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 24GiB, 80G, 1073741824)")
    value, prefix, suffix = float(m.group(1)), m.group(2).upper(), m.group(3).upper()
    power = "KMGT".index(prefix) + 1 if prefix else 0
    base = 1024 if suffix.startswith("I") else 1000
    return int(value * base**power)
