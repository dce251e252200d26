"""Structured outputs through the real server and the official openai client: the answer of a random-weight model
matches the requested schema, regex or choice by construction; a repeated schema compiles once; a spec that cannot
compile is a 400 naming its field before anything queues; constrained and free requests share steps."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import image_message, make_image

RECEIPT = {
    "type": "object",
    "properties": {
        "currency": {"type": "string", "enum": ["EUR", "USD", "CNY"]},
        "paid": {"type": "boolean"},
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 6},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["name", "quantity"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["currency", "paid", "items"],
    "additionalProperties": False,
}


def check_receipt(value: object) -> None:
    jsonschema.validate(value, RECEIPT)


def schema_format(schema: dict, name: str = "receipt") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def ask(client: openai.OpenAI, text: str = "Read the receipt.", **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                          max_tokens=kw.pop("max_tokens", 200), **kw)


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    return values[0] if values else 0.0


def test_a_json_schema_answer_is_valid_by_construction_with_random_weights(live_server) -> None:
    client = live_server.client()
    for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
        out = ask(client, response_format=schema_format(RECEIPT), seed=seed, temperature=temperature)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        check_receipt(json.loads(choice.message.content))
        assert "grammar_compile_s" in out.usage.model_extra["firsttoken"]


def test_json_mode_gives_an_object_and_a_schema_streams(live_server) -> None:
    client = live_server.client()
    for seed in range(3):
        out = ask(client, response_format={"type": "json_object"}, temperature=1.0, seed=seed, max_tokens=400)
        if out.choices[0].finish_reason == "stop":  # (an object may run past max_tokens with random weights)
            assert isinstance(json.loads(out.choices[0].message.content), dict)
    stream = ask(client, response_format=schema_format(RECEIPT), stream=True, temperature=1.0, seed=3)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 1  # streamed token by token, not held back
    check_receipt(json.loads("".join(pieces)))


def test_parse_with_a_pydantic_model_for_text_and_image_prompts(live_server) -> None:
    class Answer(BaseModel):
        animal: Literal["cat", "dog", "bird"]
        count: int = Field(ge=0, le=9)
        indoors: bool

    photo = image_message("What is in the picture?", make_image(64, 48, seed=7))
    for messages in ([{"role": "user", "content": "What is in the picture?"}], photo):
        parsed = live_server.client().beta.chat.completions.parse(
            model="tiny", messages=messages, response_format=Answer, max_tokens=120, temperature=0.0)
        assert isinstance(parsed.choices[0].message.parsed, Answer)


def test_vllm_structured_outputs_regex_and_choice(live_server) -> None:
    client = live_server.client()
    out = ask(client, extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{3}"}}, max_tokens=30,
              temperature=1.0, seed=4)
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out.choices[0].message.content)
    for field in ({"structured_outputs": {"choice": ["positive", "negative", "neutral"]}},
                  {"guided_choice": ["positive", "negative", "neutral"]}):
        out = ask(client, extra_body=field, max_tokens=30, temperature=1.0, seed=5)
        assert out.choices[0].message.content in ("positive", "negative", "neutral")
    completion = client.completions.create(model="tiny", prompt="The code is", max_tokens=30, temperature=1.0,
                                           extra_body={"structured_outputs": {"regex": r"[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{4}", completion.choices[0].text)


def test_a_repeated_schema_compiles_once(live_server) -> None:
    client = live_server.client()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    hits = metric(live_server.base_url, "firsttoken_grammar_cache_hits_total")
    first = ask(client, response_format=schema_format(schema, "ok"), max_tokens=20)
    again = ask(client, response_format=schema_format(schema, "ok"), max_tokens=20)
    jsonschema.validate(json.loads(first.choices[0].message.content), schema)
    assert again.usage.model_extra["firsttoken"]["grammar_compile_s"] == 0.0
    assert metric(live_server.base_url, "firsttoken_grammar_cache_hits_total") == hits + 1


@pytest.mark.parametrize("body, param, says", [
    ({"response_format": schema_format({"type": "object", "properties": {"a": {"type": "strnig"}}})},
     "response_format", "strnig"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_json": {"type": "object"}, "guided_regex": "x"}, "guided_regex", "at most one"),
])
def test_a_spec_that_cannot_compile_is_a_400_naming_it(live_server, body: dict, param: str, says: str) -> None:
    before = live_server.stats()["num_steps"]
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"]
    assert live_server.stats()["num_steps"] == before  # nothing reached the engine


IMPOSSIBLE_TOOL = {"type": "function", "function": {"name": "never", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}}}
# every kind of spec, each matching no output at all
NO_OUTPUT = [
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs"),
    ({"guided_regex": r"id-[^\x00-\x{10FFFF}]"}, "guided_regex"),
    ({"structured_outputs": {"grammar": r"start: /[^\s\S]/"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": 'start: "The answer is " NOTHING\nNOTHING: /[^\\s\\S]/'}},
     "structured_outputs"),
    ({"response_format": schema_format({"type": "integer", "minimum": 5, "maximum": 1})}, "response_format"),
    ({"tools": [IMPOSSIBLE_TOOL], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [IMPOSSIBLE_TOOL], "tool_choice": {"type": "function", "function": {"name": "never"}}}, "tool_choice"),
]


def test_a_spec_no_output_can_match_is_a_400_whatever_its_kind(live_server) -> None:
    """Not an empty answer with finish_reason stop: a regex, a grammar, a schema or tools that nothing can match
    are refused before anything queues, as an unsatisfiable schema always was."""
    before = live_server.stats()["num_steps"]
    for body, param in NO_OUTPUT:
        r = httpx.post(f"{live_server.base_url}/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body})
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and ("no output can match" in error["message"]
                                            or "Unsatisfiable" in error["message"]), (body, error)
    assert live_server.stats()["num_steps"] == before  # nothing reached the engine


def test_a_grammar_that_dead_ends_mid_answer_ends_with_a_400_not_a_stop(live_server) -> None:
    """A grammar nothing can complete once its first word is written: that answer is no match, so the request ends
    with an error naming why (an error event mid-stream), not with the word and finish_reason stop."""
    grammar = {"structured_outputs": {"grammar": 'start: ("yes" | "no") /[^\\s\\S]/'}}
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, **grammar})
    assert r.status_code == 400, r.text
    assert "no token can continue the output" in r.json()["error"]["message"]
    with pytest.raises(openai.APIError, match="no token can continue the output"):
        for _ in ask(live_server.client(), stream=True, max_tokens=10, extra_body=grammar):
            pass
    live_server.wait_idle()


AMBIGUOUS = 'start: x\nx: "a" | x x | x x x'  # every string of a's, in exponentially many parses


def test_an_ambiguous_grammar_ends_itself_with_a_400_and_its_batch_mate_finishes(tiny_model_dir) -> None:
    """The issue's case: an ambiguous grammar's work per token grows with the output. It ends with a 400 naming
    the client's grammar as the cause: over its budget (small here, CPU seconds or twice that waiting for a mask) or,
    on a machine fast enough to reach it first, at the parser's row limit; the unconstrained request beside it
    finishes as asked, and the server goes on serving."""
    import concurrent.futures as cf

    from firsttoken.models.recipe import TOKEN_IDS
    from tests.e2e.conftest import start_server, stop_server

    live, server, thread = start_server(tiny_model_dir, grammar_mask_budget=0.3)
    try:
        client = live.client()
        keep_writing = {str(TOKEN_IDS[t]): -100 for t in ("<|im_end|>", "<|endoftext|>")}
        with cf.ThreadPoolExecutor(2) as pool:
            slow = pool.submit(httpx.post, f"{live.base_url}/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": [{"role": "user", "content": "Write a's."}], "n": 2,
                "max_tokens": 2000, "temperature": 1.0, "logit_bias": keep_writing,
                "structured_outputs": {"grammar": AMBIGUOUS}})
            free = pool.submit(ask, client, max_tokens=30, temperature=1.0, seed=1, extra_body={"ignore_eos": True})
            out = free.result()
            r = slow.result()
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 30
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith("the output constraint failed: "), message
        assert "--grammar-mask-budget" in message or "Parser Error" in message, message
        live.wait_idle()
        after = ask(client, max_tokens=5)
        assert after.choices[0].finish_reason in ("stop", "length") and after.usage.completion_tokens >= 1
    finally:
        stop_server(server, thread, live.engine)


def test_constrained_and_free_requests_share_steps(live_server) -> None:
    import concurrent.futures as cf

    client = live_server.client()
    with cf.ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(ask, client, response_format=schema_format(RECEIPT), temperature=1.0, seed=s)
                       for s in range(2)]
        free = [pool.submit(ask, client, max_tokens=40, temperature=1.0, seed=10 + s) for s in range(2)]
        for f in constrained:
            check_receipt(json.loads(f.result().choices[0].message.content))
        for f in free:
            assert f.result().choices[0].finish_reason in ("stop", "length")
    live_server.wait_idle()
