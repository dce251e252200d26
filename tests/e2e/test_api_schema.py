"""The published schema tells the truth: schemathesis (as a library) generates requests from the real server's
/openapi.json, valid and invalid, for every operation, and checks every answer against it with all its checks:
no server error; every status, media type, header and body is one the schema documents for that operation; a body the
schema refuses is refused (4xx); a body the schema admits is accepted.

One allowance, which the schema states itself: a field marked ``x-firsttoken-checked`` is checked beyond what a JSON
schema can say (an image must decode, a prompt must fit the context, a grammar must compile, a token id must be in
the vocabulary, a rule across fields), so a body the schema admits may be refused with a 400 whose ``param`` names
such a field (``accepted_unless_checked``).

The run is fixed: a seed, a bounded number of examples per operation, no example database. To hunt for more:
``FIRSTTOKEN_SCHEMA_SEED=7 FIRSTTOKEN_SCHEMA_EXAMPLES=200 python -m pytest tests/e2e/test_api_schema.py``, or the
CLI against a running server (docs/api.md). The hypothesis fuzz of the request bodies themselves (what each field's
edges get) is tests/e2e/test_api_fuzz.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.checks import positive_data_acceptance
from schemathesis.core.failures import Failure
from schemathesis.generation.feedback import FeedbackSources
from schemathesis.pytest._test_builder import build_operation_test

from firsttoken.api.protocol import CHECKED
from tests.e2e.conftest import start_server, stop_server

SEED = int(os.environ.get("FIRSTTOKEN_SCHEMA_SEED", "49"))
MAX_EXAMPLES = int(os.environ.get("FIRSTTOKEN_SCHEMA_EXAMPLES", "15"))  # per operation and generation phase
MODEL = "tiny"


def checked_fields(document: dict[str, Any]) -> dict[tuple[str, str], frozenset[str]]:
    """(method, path) -> the top-level body fields its request schema marks ``x-firsttoken-checked``."""
    components = document["components"]["schemas"]
    out = {}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            model = components[body["$ref"].rsplit("/", 1)[-1]] if "$ref" in body else body
            out[(method.upper(), path)] = frozenset(
                name for name, field in model.get("properties", {}).items() if CHECKED in field)
    return out


@dataclass(frozen=True)
class Served:
    base_url: str
    checked: dict[tuple[str, str], frozenset[str]]  # (method, path) -> its body's fields checked beyond the schema


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    live, server, thread = start_server(tiny_model_dir, max_model_len=128, max_image_pixels=64 * 64)
    yield Served(live.base_url, checked_fields(httpx.get(f"{live.base_url}/openapi.json").json()))
    stop_server(server, thread, live.engine)


@pytest.fixture(scope="module")
def api_schema(served: Served) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{served.base_url}/openapi.json")
    schema.config.seed = SEED
    schema.config.generation.update(max_examples=MAX_EXAMPLES, database="none")
    schema.config.update(request_timeout=60)

    @schema.hook("map_body")
    def served_model(_: Any, body: Any) -> Any:
        """A body's ``model``, when a string, names the served model: any string is valid, and the unknown ones are
        all the same 404 (documented), so bodies reach the engine. A model that is not a string stays as drawn."""
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            return {**body, "model": MODEL}
        return body

    return schema


def accepted_unless_checked(served: Served) -> schemathesis.CheckFunction:
    """positive_data_acceptance, except for a 400 naming a field the operation marks checked beyond its schema."""

    def check(ctx: Any, response: Any, case: schemathesis.Case) -> bool | None:
        try:
            return positive_data_acceptance(ctx, response, case)
        except Failure:
            param = _error_param(response) if response.status_code == 400 else None
            field = (param or "").split(".", 1)[0].split("[", 1)[0]
            if field in served.checked[(case.method.upper(), case.path)]:
                return None
            raise

    return check


def _error_param(response: Any) -> str | None:
    try:
        return response.json()["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None


def test_every_answer_is_one_the_schema_states(api_schema: schemathesis.BaseSchema, served: Served) -> None:
    """Every operation's test as schemathesis builds it (its examples, coverage and fuzzing phases, positive and
    negative), run here one operation after another; every failure is reported, not only the first. Not through
    schemathesis' pytest plugin: its lazy fixture rewrites pytest's private node ids, which pytest 9.2 dropped."""
    checks = {"excluded_checks": [positive_data_acceptance], "additional_checks": [accepted_unless_checked(served)]}

    def answers_as_documented(case: schemathesis.Case) -> None:
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):  # the coverage phase's cases
            case.body = {**case.body, "model": MODEL}  # skip the map_body hook: named as that hook does
        case.call_and_validate(**checks)

    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10  # every route the server publishes
    failures = []
    for operation in operations:
        test = build_operation_test(config=api_schema.config, operation=operation, test_func=answers_as_documented,
                                    given_kwargs={}, feedback=FeedbackSources())
        try:
            test()
        except Exception as e:  # noqa: BLE001 - a check's failure, reported with its operation
            failures.append(f"{operation.method.upper()} {operation.path}: {e}")
    assert not failures, "\n\n".join(failures)
