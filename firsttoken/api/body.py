"""A request body, bytes to schema object, with a refusal that says what is wrong.

Each check is cheaper than the next and names the problem: empty → not UTF-8 → not JSON (json's
reason and position, never the text) → nested deeper than ``MAX_JSON_DEPTH`` → not an object → the
schema (pydantic errors become ``RequestValidationError``, rendered by
errors.validation_error_message). The routes read their body here rather than through FastAPI's body
parameter, whose failures all read "There was an error parsing the body".

JSON is parsed by the standard library (it accepts NaN and Infinity, which the range checks then
refuse with the field's name). An integer of more digits than Python converts (4300, a guard against
quadratic parsing) is valid JSON too: it is read as an infinity of its sign, as a float of that many
digits already is, so the field's own check refuses it by name (every integer field is 64-bit) and a
field the schema ignores stays ignored. Its C decoder gives up on nesting deeper than the
interpreter's recursion limit after reading only that far; anything nested deeper than
``MAX_JSON_DEPTH`` (our schemas need 5 levels) is refused as well, by a walk that only runs when the
body holds more brackets than the limit.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from firsttoken.api.errors import APIError

M = TypeVar("M", bound=BaseModel)

MAX_JSON_DEPTH = 64  # objects and arrays inside each other; a chat request needs 5
_TOO_DEEP = f"request body is nested too deeply: JSON objects and arrays may nest at most {MAX_JSON_DEPTH} levels"


async def read_model(request: Request, model: type[M]) -> M:
    return parse_model(await request.body(), model)


def parse_model(body: bytes, model: type[M]) -> M:
    """``model`` validated from a JSON body; APIError(400) or RequestValidationError naming what is
    wrong."""
    return validate_model(parse_json_object(body), model)


def validate_model(value: dict[str, Any], model: type[M]) -> M:
    """``model`` validated from a body's JSON object (the offline API's bodies too, built from
    Python values); RequestValidationError naming what is wrong (errors.validation_error_message
    renders it)."""
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from None


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(
            400, f"request body is not valid UTF-8 (invalid byte at offset {err.start})"
        ) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise APIError(
            400,
            f"request body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}",
        ) from None
    except RecursionError:
        raise APIError(400, _TOO_DEEP) from None
    # an integer of more digits than int() converts: read again, with those as +-inf
    except ValueError:
        value = json.loads(text, parse_int=_json_int)
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and nesting_exceeds(
        value, MAX_JSON_DEPTH
    ):
        raise APIError(400, _TOO_DEEP)
    if not isinstance(value, dict):
        raise APIError(400, "request body must be a JSON object")
    return value


def _json_int(digits: str) -> int | float:
    """A JSON integer; one of more digits than Python's int() converts is past every bound:
    +-inf."""
    try:
        return int(digits)
    except ValueError:
        return -math.inf if digits.startswith("-") else math.inf


def nesting_exceeds(value: Any, limit: int) -> bool:
    """True when containers nest more than ``limit`` deep (the top level is depth 1). Iterative;
    stops early."""
    if not isinstance(value, (dict, list)):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
