"""Every error leaves in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

``type`` names and the integer ``code`` follow vLLM's server (fixtures/vllm-0.32/error-*.txt), so
clients written against vLLM parse ours. Messages are built here or come from exceptions whose text
is client-safe by contract (InputError, ImageInputError, APIError, HTTPRefusal); they never echo the
request payload (client text they name goes through ``quoting.quote``: bounded, encodable), every
message is made encodable and capped at ``MAX_MESSAGE_CHARS`` once more where the body is rendered,
and unexpected exceptions become a generic 500 whose details stay in the server log (see
middleware.py).

Status map: ``ERROR_MEANINGS`` (what /openapi.json says of each status; api/openapi.py).
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from firsttoken.api.intake import AdmissionRefused
from firsttoken.api.protocol import MESSAGE_ROLES, ErrorInfo, ErrorResponse, FieldError
from firsttoken.inputs.errors import InputError
from firsttoken.inputs.image import ImageInputError
from firsttoken.inputs.video import VideoInputError
from firsttoken.quoting import ELLIPSIS, printable, quote

RETRY_AFTER_S = 1  # what a 429 from a full lane queue tells clients to wait, in seconds
MAX_MESSAGE_CHARS = 1000  # the longest message we render; our own longest (context limits) is ~350

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# What each status means, as /openapi.json documents it on every route that can send it
# (api/openapi.py).
ERROR_MEANINGS: dict[int, str] = {
    400: "the body is empty, not UTF-8, not JSON, nested too deeply or not the schema's; a field is unsupported, "
         "out of range or names media that cannot be used; or Content-Length came with Transfer-Encoding. "
         "`param` names the field",
    401: "missing or wrong API key (the server runs with --api-key): send 'Authorization: Bearer <key>'",
    404: "what the request names (model, response, engine) does not exist here; `param` names it",
    405: "the route does not take this method",
    408: "the request body did not arrive within --request-body-timeout",
    413: "the request body is over --max-request-bytes",
    415: "a compressed (Content-Encoding) request body",
    429: "too many requests in flight, or the request's lane queue is full; Retry-After says when to come back",
    500: "an unexpected failure, or one the engine met on this request (details in the server log, by X-Request-Id)",
    503: "the engine is not running, or the server is shutting down: retry on another replica",
    504: "the request ran past --request-timeout",
}


# Handlers leave a rejection reason here for the 4xx counter (api/observability.py); absent: the
# status decides.
REJECT_REASON_KEY = "firsttoken.reject_reason"


class APIError(Exception):
    """Raised by routes to answer with an error; ``message`` must be safe to show the client."""

    def __init__(self, status_code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param


class HTTPRefusal(StarletteHTTPException):
    """Raised below the routes (the body reader, the middleware's receive) to refuse a request;
    ``detail`` is client-safe. FastAPI passes HTTPExceptions through its body reading untouched."""

    def __init__(
        self, status_code: int, detail: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(status_code, detail, headers)


def model_not_found(model: str, served_model_name: str) -> APIError:
    return APIError(
        404,
        f"The model `{quote(model)}` does not exist. Valid aliases: {served_model_name}.",
        "model",
    )


def error_body(status_code: int, message: str, param: str | None = None) -> dict[str, Any]:
    # a safety net: messages quote client text through quote() already
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 1] + ELLIPSIS
    info = ErrorInfo(
        message=printable(message),
        type=ERROR_TYPES.get(status_code, "APIError"),
        param=printable(param) if param else param,
        code=status_code,
    )
    return ErrorResponse(error=info).model_dump()


def error_response(
    status_code: int,
    message: str,
    param: str | None = None,
    retry_after_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error in OpenAI's shape. Every 429 says when to come back (``Retry-After``, whole
    seconds, at least RETRY_AFTER_S): clients that honour it (the openai client does) would
    otherwise guess."""
    response = JSONResponse(
        error_body(status_code, message, param), status_code=status_code, headers=headers
    )
    if status_code == 429 and "retry-after" not in response.headers:
        response.headers["Retry-After"] = str(max(RETRY_AFTER_S, math.ceil(retry_after_s or 0)))
    return response


def validation_error_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for the first schema error. Pydantic's ``input`` (the payload) is never
    included."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    # With unions pydantic reports one error per branch; the deepest location is the most specific,
    # and of equally deep ones a branch whose type matched (its value out of bounds) says more than
    # one of another type.
    first = max(
        errors, key=lambda e: (len(e.get("loc", ())), not str(e.get("type", "")).endswith("_type"))
    )
    kind = first.get("type")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return str(cause), cause.field
    param = _param_path(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    # the tag field is the one at fault: name it
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        ctx = first.get("ctx") or {}
        tag = str(ctx.get("discriminator", "")).strip("'")
        param = f"{param}.{tag}" if param else tag
        if kind == "union_tag_not_found":
            kind = "missing"
        else:  # pydantic's text repeats the client's tag whole
            msg = f"unknown '{tag}' '{quote(str(ctx.get('tag')))}'; expected {ctx.get('expected_tags')}"
    if kind == "missing":
        return f"missing required field '{param}'", param
    bound = _BOUNDS.get(str(kind))
    value = first.get("input")
    if (
        bound is not None
        and param
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    ):
        # as SamplingParams and vLLM word them: "max_tokens must be at least 1, got -1"
        words, key = bound
        return (
            f"{param} must be {words} {(first.get('ctx') or {}).get(key)}, got {quote(value)}",
            param,
        )
    return (f"{param}: {msg}" if param else msg), param


# pydantic's range errors on a number: (the bound in words, its key in the error's ctx)
_BOUNDS = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
           "greater_than": ("greater than", "gt"), "less_than": ("less than", "lt")}


_UNION_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
# discriminated-union tags that are no field name (the Responses API's content parts): left out of
# the path
_PART_TAGS = frozenset({"input_text", "output_text", "input_image"})


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content', 'list[tagged-union[..]]', 1, 'text', 'text') ->
    'messages[0].content[1].text'.

    Pydantic inserts union-branch labels into locations: type names ('str', 'list[...]',
    'function-after[...]', model classes) are dropped; a discriminated union's tag repeats the field
    name in chat's schemas ('text', 'image_url'), so a part equal to the one before it is dropped
    too, and so are the Responses API's part tags (``_PART_TAGS``) and a message's role after its
    index (``MESSAGE_ROLES``: 'messages', 0, 'tool', 'content')."""
    out = ""
    prev: Any = None
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (
            isinstance(part, str)
            and part != prev
            and part not in _UNION_TYPE_LABELS
            and part not in _PART_TAGS
            and not (isinstance(prev, int) and part in MESSAGE_ROLES)
            # a union's branch that is a model: its class name (NamedToolChoice)
            and not part[:1].isupper()
            and not any(c in part for c in "[]-")
        ):
            out += f".{part}" if out else part
        prev = part
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        request.scope[REJECT_REASON_KEY] = "invalid_request"
        message, param = validation_error_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        if exc.status_code == 404 and exc.param == "model":
            request.scope[REJECT_REASON_KEY] = "unknown_model"
        return error_response(exc.status_code, exc.message, exc.param)

    @app.exception_handler(InputError)
    async def _input(request: Request, exc: InputError) -> JSONResponse:
        request.scope[REJECT_REASON_KEY] = "invalid_input"
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(AdmissionRefused)
    async def _admission(request: Request, exc: AdmissionRefused) -> JSONResponse:
        verdict = exc.verdict
        request.scope[REJECT_REASON_KEY] = verdict.reason
        return error_response(
            verdict.status,
            verdict.message,
            exc.param if verdict.status == 400 else None,
            verdict.retry_after_s,
        )

    @app.exception_handler(ImageInputError)
    async def _image(request: Request, exc: ImageInputError) -> JSONResponse:
        noun = "video" if isinstance(exc, VideoInputError) else "image"
        request.scope[REJECT_REASON_KEY] = f"{noun}_{exc.code}"
        return error_response(400, f"invalid {noun} ({exc.code}): {exc}", exc.param or "messages")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        messages = {404: "not found", 405: "method not allowed", 413: "request body too large"}
        detail = exc.detail if isinstance(exc, HTTPRefusal) else None
        message = detail or messages.get(exc.status_code, "request failed")
        return error_response(exc.status_code, message, headers=exc.headers)
