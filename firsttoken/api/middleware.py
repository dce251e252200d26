"""The outermost layer of the app (plain ASGI, so streaming and disconnects pass through untouched):

- request id: ``X-Request-Id`` taken from the client when it is a short token, else generated;
  stored in ``scope[REQUEST_ID_KEY]`` and returned on every response, errors included;
- framing: a request with both ``Content-Length`` and ``Transfer-Encoding`` is refused (400: the two
  disagree on where the body ends, the root of request smuggling), and so is a ``Content-Encoding``
  other than identity (415: we never inflate a compressed body, whose decompressed size the byte
  limit could not bound);
- body limit: a declared ``Content-Length`` over the limit is answered 413 before any byte is read;
  a chunked body is counted as it streams in and cut off with the same 413;
- body deadline: the whole body must arrive within ``body_timeout_s`` of the request's headers, else
  408 and the connection is closed (h11 has no timeout of its own: a chunked body without its
  terminator would hold the connection and its task forever). Only reads of the body are timed;
  waiting for a disconnect is not;
- these refusals (400, 415, 413, 408) go out with ``Connection: close`` while the client may still
  be sending its body; the protocol (api/http_protocol.py) then reads and discards the rest, within
  bounds, before it closes (a lingering close), so a client that writes its whole body before
  reading still reads the answer;
- a client that left: starlette's ``ClientDisconnect`` (raised where the body is read, or a response
  is sent, after the client went away) is no error but a disconnect: ``client_left`` logs it at INFO
  and leaves its stage in the scope for the disconnect counter (api/observability.py), as every
  other place that sees a client leave;
- last resort: an exception no handler took becomes a generic 500 (no trace, no addresses); the
  traceback goes to the server log with the request id.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from firsttoken.api.errors import HTTPRefusal, error_response
from firsttoken.quoting import quote

logger = logging.getLogger("firsttoken.api")

# What this layer may answer any request with (framing 400, 413, 415, the last-resort 500), and a
# request whose route reads its body with (408, the body's deadline): api/openapi.py documents them
# on every operation.
ANY_REQUEST_ERRORS = (400, 413, 415, 500)
BODY_READ_ERRORS = (408,)

REQUEST_ID_KEY = "firsttoken.request_id"
REQUEST_ID_HEADER = b"x-request-id"
_CLIENT_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# the body was not read to its end: this connection cannot carry another request
CLOSE = {"Connection": "close"}


# Where a client left before its answer was complete (recorder.DISCONNECT_STAGES), left in the scope
# by whoever saw it (``client_left``) for the disconnect counter
CLIENT_LEFT_KEY = "firsttoken.client_left"


def request_id_of(scope: Scope) -> str:
    return scope.get(REQUEST_ID_KEY) or "-"


def client_left(scope: Scope, stage: str) -> None:
    """The client went away at ``stage`` (recorder.DISCONNECT_STAGES): a normal event, logged at
    INFO (nothing failed) and left in the scope, where the disconnect counter reads it once the
    request is done."""
    scope[CLIENT_LEFT_KEY] = stage
    logger.info(
        "client disconnected during its %s: %s %s (request id %s)",
        stage,
        scope.get("method"),
        scope.get("path"),
        request_id_of(scope),
    )


class RequestContextMiddleware:
    def __init__(
        self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s  # None: no deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        client_id = headers.get(REQUEST_ID_HEADER, b"").decode("latin-1")
        request_id = client_id if _CLIENT_ID_RE.fullmatch(client_id) else uuid.uuid4().hex
        scope[REQUEST_ID_KEY] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", []),
                        (REQUEST_ID_HEADER, request_id.encode()),
                    ],
                }
            await send(message)

        refusal = self._framing_refusal(headers)
        if refusal is not None:
            await self._reply(*refusal, scope, receive, send_with_id, CLOSE)
            return
        try:
            await self.app(scope, self._guarded(receive), send_with_id)
        except ClientDisconnect:  # nobody to answer
            client_left(scope, "answer" if started else "body")
        except Exception:
            logger.exception(
                "unhandled error in %s %s (request id %s)",
                scope.get("method"),
                scope.get("path"),
                request_id,
            )
            if not started:
                await self._reply(
                    500,
                    f"internal server error (request id {request_id})",
                    scope,
                    receive,
                    send_with_id,
                )

    def _framing_refusal(self, headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        """(status, message) for a request refused from its headers alone, before any body byte is
        read."""
        if b"content-length" in headers and b"transfer-encoding" in headers:
            return (
                400,
                "the request has both Content-Length and Transfer-Encoding headers; send only one",
            )
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
        if encoding not in ("", "identity"):
            return 415, (
                f"Content-Encoding '{quote(encoding)}' is not supported for request bodies; send the body uncompressed"
            )
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return 413, self._too_large()
        return None

    def _guarded(self, receive: Receive) -> Receive:
        """``receive`` with the body's byte limit and deadline; after the last body chunk, plain
        ``receive``."""
        received = 0
        body_done = False
        deadline = (
            None
            if self.body_timeout_s is None
            else asyncio.get_running_loop().time() + self.body_timeout_s
        )

        async def guarded_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()  # e.g. waiting for the client to disconnect: not a body read
            if deadline is None:
                message = await receive()
            else:
                remaining_s = deadline - asyncio.get_running_loop().time()
                try:
                    message = await asyncio.wait_for(receive(), max(remaining_s, 0.0))
                except TimeoutError:
                    raise HTTPRefusal(408, self._too_slow(), CLOSE) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPRefusal(413, self._too_large(), CLOSE)
                body_done = not message.get("more_body", False)
            else:
                body_done = True  # http.disconnect: nothing more will come
            return message

        return guarded_receive

    def _too_large(self) -> str:
        return f"request body too large: the limit is {self.max_body_bytes} bytes"

    def _too_slow(self) -> str:
        return (
            f"the request body did not arrive within {self.body_timeout_s:g} s (the server's --request-body-timeout); "
            "send the whole body at once"
        )

    @staticmethod
    async def _reply(
        status: int,
        message: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: dict[str, str] | None = None,
    ) -> None:
        response = error_response(status, message)
        response.headers.update(headers or {})
        await response(scope, receive, send)
