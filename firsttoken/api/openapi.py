"""The published schema (``GET /openapi.json``): every answer each operation can send, with its
status, media type and shape, and the request bodies the routes validate.

- Request bodies are the pydantic models the routes validate with (api/body.py ``read_model``), so
  the schema admits what the validation admits; a rule a model enforces in code is stated in its
  schema too (api/protocol.py).
- Each route declares its own answers: its 200 (``answer``, ``body_route``) and the errors its
  handler sends (``errors``). The errors of the layers around every route are added to every
  operation here: the refusals of RequestContextMiddleware (``ANY_REQUEST_ERRORS``;
  ``BODY_READ_ERRORS`` where a route reads a body) and, with ``--api-key``, a 401 on every path the
  key guards.
- Every error is OpenAI's shape, ``ErrorResponse`` (api/errors.py), with what the status means
  there.
- FastAPI's default 422 is not documented: this app answers a schema error with 400 (errors.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from firsttoken.api.errors import ERROR_MEANINGS
from firsttoken.api.middleware import ANY_REQUEST_ERRORS, BODY_READ_ERRORS
from firsttoken.api.protocol import ErrorResponse

SCHEMAS = "#/components/schemas/"
_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# One server-sent event (OpenAPI 3.2's itemSchema, as FastAPI writes it): ``data`` is a JSON chunk
# (chat, completions: then ``[DONE]``) or, with ``event`` naming it, a Responses API event
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
    "retry": {"type": "integer", "minimum": 0}}}


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": SCHEMAS + model.__name__}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries: each status in OpenAI's error shape, with what it means."""
    answers: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        answers[status] = {"description": ERROR_MEANINGS[status],
                           "content": {"application/json": {"schema": ref(ErrorResponse)}}}
        if status == 429:
            answers[status]["headers"] = {
                "Retry-After": {
                    "description": "whole seconds to wait before retrying",
                    "schema": {"type": "integer"},
                }
            }
        if status == 401:
            answers[status]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return answers


def answer(
    media_type: str, schema: dict[str, Any], description: str = "OK"
) -> dict[int | str, dict[str, Any]]:
    """A 200 of ``media_type``; the route's ``response_class`` is ``Response`` (no media type of its
    own), else FastAPI documents its JSON default beside it."""
    return {200: {"description": description, "content": {media_type: {"schema": schema}}}}


def body_route(request: type[BaseModel], response: type[BaseModel] | None = None, *statuses: int,
               stream: bool = False) -> dict[str, Any]:
    """The decorator arguments of a route that reads its body itself (read_model: limits and errors
    of its own): the body's schema, the 200's (JSON, and a server-sent event stream when ``stream``)
    and the errors ``statuses``. ``openapi_schema`` adds the models to the components."""
    body = {
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}}
    }
    responses = errors(400, *BODY_READ_ERRORS, *statuses)
    if response is not None:
        content: dict[str, Any] = {"application/json": {"schema": ref(response)}}
        if stream:
            content["text/event-stream"] = {"itemSchema": SSE_EVENT}
        responses[200] = {
            "description": "OK"
            + (" (a server-sent event stream with stream: true)" if stream else ""),
            "content": content,
        }
    # response_class: one of no media type, so the 200 above is all FastAPI documents
    return {"openapi_extra": body, "responses": responses, "response_class": Response}


def openapi_schema(
    app: FastAPI, models: Iterable[type[BaseModel]], guarded: Callable[[str], bool]
) -> dict[str, Any]:
    """The app's schema, built once: its routes, ``models`` in the components, every operation's
    answers completed with those of the layers around it (``guarded(path)``: the API key guards that
    path, so 401)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (*models, ErrorResponse):
        body = model.model_json_schema(ref_template=SCHEMAS + "{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
    # FastAPI's 422 shape, which never leaves this app
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            if method not in _METHODS:
                continue
            answers = operation.setdefault("responses", {})
            answers.pop("422", None)
            statuses = [
                *ANY_REQUEST_ERRORS,
                *(BODY_READ_ERRORS if "requestBody" in operation else ()),
                *((401,) if guarded(path) else ()),
            ]
            for status, doc in errors(*statuses).items():
                answers.setdefault(str(status), doc)
            operation["responses"] = dict(sorted(answers.items()))
    app.openapi_schema = schema
    return schema
