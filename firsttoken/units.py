"""Units shared by the server's flags and the operator tools, so `plan`'s advice means what `serve`
reads."""

from __future__ import annotations

import re

_SIZE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10),
               ("T", 10**12), ("G", 10**9), ("M", 10**6), ("K", 10**3))
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


def format_size(num_bytes: int) -> str:
    """The shortest exact size flag for a byte count: 2**30 -> '1GiB', 80 x 10**9 -> '80G', 1001 ->
    '1001'.

    parse_bytes(format_size(n)) == n for every n >= 0, so a size printed by one tool is a flag
    another reads.
    """
    exact = [
        f"{num_bytes // size}{suffix}"
        for suffix, size in _SIZE_UNITS
        if num_bytes and num_bytes % size == 0
    ]
    # min keeps the first of equal lengths: binary units win ties
    return min([*exact, str(num_bytes)], key=len)


def format_bytes(num_bytes: float) -> str:
    """A byte count for reading (not for flags): 2 decimals in the largest binary unit, '17.00
    GiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{int(num_bytes)} B"
