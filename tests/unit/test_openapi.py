"""The published schema (/openapi.json, api/openapi.py) states every answer each operation can send, in the shape it
has, and request schemas no looser than the validation: a body the server refuses for its shape, the schema refuses
too. In process, with a fake engine (tests/unit/fake_engine.py); the schemathesis run against the real server is
tests/e2e/test_api_schema.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from firsttoken.api.observability import Observability
from firsttoken.api.protocol import INT64_MAX
from firsttoken.api.server import build_app
from firsttoken.api.settings import ServedModel
from firsttoken.inputs.processor import InputProcessor
from firsttoken.metrics.recorder import Recorder
from firsttoken.types import SamplingParams
from tests.helpers import make_processor

from .fake_engine import FakeEngine

MODEL = "tiny"
MAX_MODEL_LEN = 512
# OpenAI's error shape, from every layer: the routes' own, the middleware's framing and limits, the last resort
LAYERS = {400, 413, 415, 500}
BODY = LAYERS | {408}  # a route that reads its body also has its deadline
GENERATION = BODY | {200, 404, 429, 503, 504}


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> InputProcessor:
    return make_processor(tiny_model_dir, MAX_MODEL_LEN)


def app_of(processor: InputProcessor, observability: Observability | None = None):
    return build_app(FakeEngine(), processor, ServedModel(MODEL, MAX_MODEL_LEN), observability=observability)


def document(processor: InputProcessor, observability: Observability | None = None) -> dict[str, Any]:
    app = app_of(processor, observability)

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            key = observability.api_key if observability is not None else None
            return await http.get("/openapi.json", headers={"Authorization": f"Bearer {key}"} if key else {})

    return asyncio.run(get()).json()


def answers(doc: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    return doc["paths"][path][method]["responses"]


@pytest.mark.parametrize(("method", "path", "statuses"), [
    ("post", "/v1/chat/completions", GENERATION),
    ("post", "/v1/completions", GENERATION),
    ("post", "/v1/responses", GENERATION),
    ("post", "/tokenize", BODY | {200, 404}),
    ("get", "/v1/responses/{response_id}", LAYERS | {404}),  # stateless: never a 200
    ("get", "/v1/models", LAYERS | {200}),
    ("get", "/v1/models/{model_id}", LAYERS | {200, 404}),
    ("get", "/health", LAYERS | {200, 503}),
    ("get", "/v1/engine/config", LAYERS | {200, 404}),
])
def test_each_operation_documents_every_status_it_sends(processor, method: str, path: str, statuses: set[int]) -> None:
    doc = document(processor)
    documented = answers(doc, method, path)
    assert set(documented) == {str(s) for s in statuses}  # FastAPI's 422 is not one: schema errors are 400
    for status in statuses - {200}:
        assert documented[str(status)]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    assert {"ErrorResponse", "ErrorInfo"} <= set(doc["components"]["schemas"])
    if "429" in documented:
        assert "Retry-After" in documented["429"]["headers"]


def test_streams_and_operator_pages_document_their_media_types(processor) -> None:
    doc = document(processor, Observability(Recorder()))
    chat = answers(doc, "post", "/v1/chat/completions")["200"]["content"]
    assert set(chat) == {"application/json", "text/event-stream"}
    assert chat["text/event-stream"]["itemSchema"]["required"] == ["data"]  # each event, as FastAPI writes it
    assert list(answers(doc, "get", "/metrics")["200"]["content"]) == ["text/plain; version=1.0.0; charset=utf-8"]
    assert list(answers(doc, "get", "/dashboard")["200"]["content"]) == ["text/html"]


def test_a_401_is_documented_where_the_api_key_guards(processor) -> None:
    open_doc = document(processor, Observability(Recorder()))
    keyed = document(processor, Observability(Recorder(), api_key="k"))
    assert not any("401" in op["responses"] for ops in open_doc["paths"].values() for op in ops.values())
    for path, ops in keyed["paths"].items():
        for op in ops.values():
            assert ("401" in op["responses"]) == (path not in ("/health", "/dashboard")), path


def validator(doc: dict[str, Any], method: str, path: str) -> jsonschema.Draft202012Validator:
    body = doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**body, "components": doc["components"]})


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
REFUSED_BY_SHAPE = [  # (route, body): each a 400 from the validation, for its shape
    ("/tokenize", {}),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
    ("/tokenize", {"messages": [{"role": "tool"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "tool_call_id": "c1"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": [{"type": "text", "text": "x"}]}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "root", "content": "x"}]}),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}),
    ("/v1/chat/completions", {**CHAT, "top_p": True}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "5"}),
    ("/v1/chat/completions", {**CHAT, "temperature": 2.5}),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}),
    ("/v1/chat/completions", {**CHAT, "n": 0}),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 21, "logprobs": True}),
    ("/v1/chat/completions", {**CHAT, "stop": ""}),
    ("/v1/chat/completions", {**CHAT, "stop": ["s"] * 33}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"x": 1}}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}),
    ("/v1/completions", {"model": MODEL, "prompt": [[]]}),
    ("/v1/completions", {"model": MODEL, "prompt": []}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "temperature": -1}),
    # bounds on a type with a validator of its own: stated as JSON Schema's minimum, not pydantic's "ge"
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:,", "max_visual_tokens": 0}}]}]}),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {
        "url": "data:,", "max_frames": 1}}]}]}),
]
ACCEPTED = [  # (route, body): each a 200
    ("/tokenize", {"prompt": "a"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "tools": [TOOL], "add_generation_prompt": False}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []},
                                                   {"role": "assistant", "tool_calls": [CALL]},
                                                   {"role": "tool", "tool_call_id": "c1", "content": "{}"}],
                              "tools": [TOOL], "n": 2.0, "top_p": 1, "stop": ["a"], "logit_bias": {"5": -100}}),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 2}),
    ("/v1/chat/completions", {**CHAT, "add_generation_prompt": False}),
]


def test_the_schema_refuses_what_the_validation_refuses(processor) -> None:
    doc = document(processor)
    for path, body in REFUSED_BY_SHAPE:
        assert post(processor, path, body).status_code == 400, (path, body)
    admitted = [(path, body) for path, body in REFUSED_BY_SHAPE if validator(doc, "post", path).is_valid(body)]
    assert not admitted, f"the schema admits bodies the server refuses: {admitted}"


def test_the_schema_admits_what_the_server_accepts(processor) -> None:
    doc = document(processor)
    for path, body in ACCEPTED:
        assert post(processor, path, body).status_code == 200, (path, body)
    refused = [(path, body, [e.message for e in validator(doc, "post", path).iter_errors(body)])
               for path, body in ACCEPTED if not validator(doc, "post", path).is_valid(body)]
    assert not refused, f"the schema refuses bodies the server accepts: {refused}"


def post(processor: InputProcessor, path: str, body: dict[str, Any]) -> httpx.Response:
    app = app_of(processor)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return await http.post(path, json=body)

    return asyncio.run(go())


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty", "top_logprobs"])
def test_the_schemas_sampling_bounds_are_the_engines(processor, field: str) -> None:
    """Each bound the chat schema states for a sampling field is the one SamplingParams enforces for in-process
    callers: taken at the bound, refused a step past it (a 64-bit integer's own bound aside)."""
    schema = document(processor)["components"]["schemas"]["ChatCompletionRequest"]["properties"][field]["anyOf"][0]
    step = 1 if schema["type"] == "integer" else 1e-6

    def params(value: float) -> SamplingParams:
        return SamplingParams(max_tokens=1, logprobs=True, **{field: value})

    assert {"minimum", "exclusiveMinimum"} & set(schema)
    if "minimum" in schema:
        params(schema["minimum"])
        with pytest.raises(ValueError):
            params(schema["minimum"] - step)
    if "exclusiveMinimum" in schema:
        params(schema["exclusiveMinimum"] + step)
        with pytest.raises(ValueError):
            params(schema["exclusiveMinimum"])
    if schema.get("maximum", INT64_MAX) != INT64_MAX:
        params(schema["maximum"])
        with pytest.raises(ValueError):
            params(schema["maximum"] + step)
