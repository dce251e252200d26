"""uvicorn's h11 protocol with a deadline on request headers and a lingering close.

uvicorn closes a connection idle between requests after ``timeout_keep_alive``, but a client that
opens a connection and sends its request line and headers a byte at a time (or never finishes them)
holds it, and a file descriptor, forever: the app is not called until the headers are complete, so
no middleware can see it. ``header_timeout_protocol(seconds)`` returns the protocol class to give
``uvicorn.Config(http=...)``: from the moment a connection opens or finishes a response, the next
request's headers must be complete within ``seconds``, else the connection is closed without a
response (there is no request to answer). The body's own deadline is the middleware's
(``--request-body-timeout``, api/middleware.py).

Lingering close (as nginx does it). A refusal decided before the body is read (413 by
Content-Length, 415, 400 for ambiguous framing; api/middleware.py) or in the middle of it (413 for a
chunked body over the limit,
408) is a complete response with ``Connection: close`` while the client is still sending. uvicorn
     then closes
the socket at once, and a socket closed with bytes unread (or bytes still arriving) makes the kernel
reset the connection: a client that writes its whole body before reading (Python's ``http.client``)
gets ``ConnectionResetError`` instead of the answer. So when uvicorn closes a connection after a
complete response (the app's, or uvicorn's own 400 for a request h11 cannot parse) while the request
has not ended, this protocol instead sends FIN after the response (``write_eof``: a client reading
to the end of the connection sees it end) and goes on reading and discarding what arrives, unparsed,
until the client closes its side or ``LingerBounds`` runs out (bytes discarded, seconds in all,
seconds without a byte); then it closes. A client that sends past the bounds is reset, as before; so
is one still sending when the server shuts down. The hook is the transport uvicorn is given
(``_LingeringTransport``): uvicorn calls its ``close()`` from several places, among them its request
cycle, which a protocol subclass cannot override.

It also caps each connection's kernel send buffer (``SEND_BUFFER_BYTES``). Linux grows a loopback or
LAN socket's send buffer up to 4 MiB, ~20,000 streamed token chunks: a client that stops reading
would have the server generate all of them before its writes block and ``--max-unread-outputs`` can
notice (api/ takes outputs only as fast as the socket accepts them). A token stream needs a few
KB/s, so a small buffer costs nothing and bounds what a stalled reader can make the server produce.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# per connection; the kernel doubles it for bookkeeping (128 KiB in effect)
SEND_BUFFER_BYTES = 64 * 1024


@dataclass(frozen=True)
class LingerBounds:
    """How long a connection answered before its request body ended goes on reading (and discarding)
    that body.

    The defaults are nginx's ``lingering_time`` and ``lingering_timeout``; ``max_bytes`` is four
    times the default ``--max-request-bytes``, so a body well over the limit still gets its 413
    while a client cannot make the server read without end (it is reset once the bound is
    passed)."""

    max_bytes: int = 256 * 2**20  # bytes discarded after the response, at most
    total_s: float = 30.0  # seconds from the response to the close, at most
    # seconds without a byte after which the client is taken to be done (or gone)
    idle_s: float = 5.0

    @classmethod
    def for_body_limit(cls, max_request_bytes: int) -> LingerBounds:
        """The default bounds, reading at least four times a server's ``--max-request-bytes`` after
        a refusal."""
        return cls(max_bytes=max(cls.max_bytes, 4 * max_request_bytes))

    def __post_init__(self) -> None:
        if not self.max_bytes >= 0:
            raise ValueError("LingerBounds.max_bytes must be >= 0")
        for name in ("total_s", "idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LingerBounds.{name} must be > 0 seconds")


class _LingeringTransport:
    """The transport uvicorn is given: ``close()`` and ``is_closing()`` ask the protocol (which may
    linger instead of closing, and reports a lingering connection as closing so uvicorn writes
    nothing more); every other attribute is the real transport's."""

    def __init__(self, transport: asyncio.Transport, protocol: _HeaderDeadlineProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        self._protocol._close_or_linger()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _HeaderDeadlineProtocol(H11Protocol):
    header_timeout_s: float = 30.0  # set per server by header_timeout_protocol
    linger: LingerBounds = LingerBounds()  # likewise

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._raw_transport = transport
        self._may_linger = True
        self._lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None
        super().connection_made(cast(asyncio.Transport, _LingeringTransport(transport, self)))
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        # uvicorn's own close() of a lost connection must not start lingering
        self._may_linger = False
        self._cancel_header_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._lingering:
            super().data_received(data)
            return
        self._discarded_bytes += len(data)  # the rest of a request already answered: never parsed
        self._last_byte_at = self.loop.time()
        if self._discarded_bytes > self.linger.max_bytes:
            self._raw_transport.close()  # bytes left unread: the kernel resets the connection

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # waiting for the next request
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()

    # ------------------------------------------------------------------------------ lingering close

    def shutdown(self) -> None:
        # the server is stopping: a connection it closes now closes at once
        self._may_linger = False
        if self._lingering:
            self._raw_transport.close()
            return
        super().shutdown()

    def _close_or_linger(self) -> None:
        """uvicorn's ``transport.close()``: linger when we have sent a whole response (the app's, or
        uvicorn's own 400 for a request h11 could not parse) but the client's request has not ended;
        otherwise (and when asked again while lingering, e.g. at shutdown) close."""
        answered = self.conn.our_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)
        still_sending = self.conn.their_state in (h11.SEND_BODY, h11.ERROR)
        if (self._lingering or not self._may_linger or not (answered and still_sending)
                or self._raw_transport.is_closing()):
            self._raw_transport.close()
            return
        self._lingering = True
        # to the app the client is gone: uvicorn drops what it sends, and a read
        if self.cycle is not None:
            self.cycle.disconnected = True  # of the body wakes to http.disconnect
            self.cycle.message_event.set()
        self._discarded_bytes = 0
        self._started_at = self._last_byte_at = self.loop.time()
        self._raw_transport.write_eof()  # FIN once the response is flushed; reading goes on
        self.flow.resume_reading()  # uvicorn pauses reading when the app leaves body bytes unread
        self._linger_timer = self.loop.call_later(
            min(self.linger.idle_s, self.linger.total_s), self._on_linger_timer
        )

    def _on_linger_timer(self) -> None:
        """Close once idle for ``idle_s`` or lingering for ``total_s``; else look again when the
        first may be due."""
        now = self.loop.time()
        idle_until = self._last_byte_at + self.linger.idle_s
        total_until = self._started_at + self.linger.total_s
        if now >= min(idle_until, total_until):
            self._linger_timer = None
            self._raw_transport.close()
        else:
            self._linger_timer = self.loop.call_at(
                min(idle_until, total_until), self._on_linger_timer
            )

    # ------------------------------------------------------------------------------ header deadline

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
            self.logger.info(
                "closing a connection whose request headers did not arrive within %g s",
                self.header_timeout_s,
            )
            self.transport.close()


def header_timeout_protocol(
    header_timeout_s: float, linger: LingerBounds = LingerBounds()
) -> type[H11Protocol]:
    """The h11 protocol class for ``uvicorn.Config(http=...)`` with this header deadline (seconds)
    and these bounds on a lingering close (tests pass small ones; ``serve`` uses the defaults)."""
    if not header_timeout_s > 0:
        raise ValueError("the request header timeout must be > 0 seconds")
    return type("H11HeaderDeadlineProtocol", (_HeaderDeadlineProtocol,),
                {"header_timeout_s": header_timeout_s, "linger": linger})
