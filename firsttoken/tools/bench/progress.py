"""A one-line progress bar on stderr (redrawn at most 10x/s on a terminal, every 10% otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self,
        total: int | None,
        label: str,
        enabled: bool = True,
        stream: TextIO | None = None,
        duration_s: float | None = None,
    ) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream or sys.stderr
        self.duration_s = duration_s
        self.done = self.errors = 0
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        if not self.enabled:
            return
        now = time.monotonic()
        frac = self._fraction(now)
        if self._tty:
            if now - self._last_draw >= 0.1 or frac >= 1.0:
                self._last_draw = now
                self.stream.write("\r" + self._line(now, frac))
                self.stream.flush()
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(self._line(now, frac) + "\n")

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write(
                "\r" + self._line(time.monotonic(), self._fraction(time.monotonic())) + "\n"
            )
            self.stream.flush()

    def _fraction(self, now: float) -> float:
        if self.total:
            return min(1.0, self.done / self.total)
        if self.duration_s:
            return min(1.0, (now - self._start) / self.duration_s)
        return 0.0

    def _line(self, now: float, frac: float) -> str:
        width = 30
        filled = int(frac * width)
        total = f"/{self.total}" if self.total else ""
        return (
            f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}{total} requests, "
            f"{self.errors} errors, {now - self._start:.1f}s"
        )
