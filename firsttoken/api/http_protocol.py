"""uvicorn's h11 protocol with a deadline on request headers.

uvicorn closes a connection idle between requests after ``timeout_keep_alive``, but a client that opens a
connection and sends its request line and headers a byte at a time (or never finishes them) holds it, and a
file descriptor, forever: the app is not called until the headers are complete, so no middleware can see it.
``header_timeout_protocol(seconds)`` returns the protocol class to give ``uvicorn.Config(http=...)``: from the
moment a connection opens or finishes a response, the next request's headers must be complete within
``seconds``, else the connection is closed without a response (there is no request to answer). The body's
own deadline is the middleware's (``--request-body-timeout``, api/middleware.py).

It also caps each connection's kernel send buffer (``SEND_BUFFER_BYTES``). Linux grows a loopback or LAN socket's
send buffer up to 4 MiB, ~20,000 streamed token chunks: a client that stops reading would have the server generate
all of them before its writes block and ``--max-unread-outputs`` can notice (api/ takes outputs only as fast as the
socket accepts them). A token stream needs a few KB/s, so a small buffer costs nothing and bounds what a stalled
reader can make the server produce.
"""

from __future__ import annotations

import asyncio
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

SEND_BUFFER_BYTES = 64 * 1024  # per connection; the kernel doubles it for bookkeeping (128 KiB in effect)


class _HeaderDeadlineProtocol(H11Protocol):
    header_timeout_s: float = 30.0  # set per server by header_timeout_protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:  # waiting for the next request
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers did not arrive within %g s",
                             self.header_timeout_s)
            self.transport.close()


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """The h11 protocol class for ``uvicorn.Config(http=...)`` with this header deadline (seconds)."""
    if not header_timeout_s > 0:
        raise ValueError("the request header timeout must be > 0 seconds")
    return type("H11HeaderDeadlineProtocol", (_HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s})
