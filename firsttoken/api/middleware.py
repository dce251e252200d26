"""The outermost layer of the app (plain ASGI, so streaming and disconnects pass through untouched):

- request id: ``X-Request-Id`` taken from the client when it is a short token, else generated; stored in
  ``scope[REQUEST_ID_KEY]`` and returned on every response, errors included;
- body limit: a declared ``Content-Length`` over the limit is answered 413 before any byte is read; a chunked
  body is counted as it streams in and cut off with the same 413;
- last resort: an exception no handler took becomes a generic 500 (no trace, no addresses); the traceback
  goes to the server log with the request id.
"""

from __future__ import annotations

import logging
import re
import uuid

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from firsttoken.api.errors import error_response

logger = logging.getLogger("firsttoken.api")

REQUEST_ID_KEY = "firsttoken.request_id"
REQUEST_ID_HEADER = b"x-request-id"
_CLIENT_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_of(scope: Scope) -> str:
    return scope.get(REQUEST_ID_KEY) or "-"


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

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
                    "headers": [*message.get("headers", []), (REQUEST_ID_HEADER, request_id.encode())],
                }
            await send(message)

        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._reply(413, self._too_large(), scope, receive, send_with_id)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, self._too_large())  # FastAPI passes HTTPException through as is
            return message

        try:
            await self.app(scope, limited_receive, send_with_id)
        except Exception:
            logger.exception(
                "unhandled error in %s %s (request id %s)", scope.get("method"), scope.get("path"), request_id
            )
            if not started:
                await self._reply(500, f"internal server error (request id {request_id})", scope, receive, send_with_id)

    def _too_large(self) -> str:
        return f"request body too large: the limit is {self.max_body_bytes} bytes"

    @staticmethod
    async def _reply(status: int, message: str, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(status, message)(scope, receive, send)
