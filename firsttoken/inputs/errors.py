"""The input layer's refusal: a ValueError whose message is safe to show the client."""

from __future__ import annotations


class InputError(ValueError):
    """A request refused while preparing it. ``str(err)`` is client-safe; ``param`` names the
    request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
