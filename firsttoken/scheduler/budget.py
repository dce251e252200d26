"""A step's token budget: a small object you ask, instead of a counter decremented in five places."""

from __future__ import annotations


class TokenBudget:
    def __init__(self, num_tokens: int) -> None:
        self.total = num_tokens
        self.remaining = num_tokens

    def take(self, wanted: int) -> int:
        """Grant up to `wanted` tokens; returns how many were granted (possibly 0)."""
        granted = max(0, min(wanted, self.remaining))
        self.remaining -= granted
        return granted

    @property
    def used(self) -> int:
        return self.total - self.remaining
