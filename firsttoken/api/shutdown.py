"""Graceful shutdown: on SIGTERM (or Ctrl-C) stop taking work, let in-flight requests finish, then
exit 0.

First signal: the engine client starts draining, so new generation requests and /health answer 503
while the listening socket stays open (a load balancer sees the 503 and moves traffic away);
requests already in flight (including those still preprocessing) finish, for up to
``shutdown_timeout_s``. Then uvicorn closes the socket and cancels whatever is left; a cancelled
request's stream aborts it in the engine, so its KV blocks are freed. A second signal skips the
wait.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import uvicorn


class Drainable(Protocol):
    def begin_drain(self) -> None: ...


class InFlight(Protocol):
    in_use: int


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: Drainable, in_flight: InFlight,
                 shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.in_flight = in_flight
        self.shutdown_timeout_s = shutdown_timeout_s
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drainer is not None:  # second signal: stop waiting
            super().handle_exit(sig, frame)
            return
        self.engine.begin_drain()
        self._drainer = threading.Thread(target=self._drain, name="firsttoken-drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout_s
        while self.in_flight.in_use > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True
