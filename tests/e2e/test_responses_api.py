"""OpenAI's Responses API (``POST /v1/responses``) through the real server and the official openai client: what a
user of ``client.responses`` notices (texts, token counts, statuses, the order of stream events, refusals)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import LiveServer, image_data_url, make_image
from tests.e2e.test_structured_outputs import RECEIPT


def respond(live: LiveServer, input, **kw):
    kw.setdefault("max_output_tokens", 8)
    kw.setdefault("temperature", 0.0)
    return live.client().responses.create(model=live.model, input=input, **kw)


def chat(live: LiveServer, messages, **kw):
    return live.client().chat.completions.create(model=live.model, messages=messages, max_tokens=8,
                                                 temperature=0.0, **kw)


def test_a_text_input_answers_as_the_chat_route_does(live_server: LiveServer):
    out = respond(live_server, "Tell me a story.")
    twin = chat(live_server, [{"role": "user", "content": "Tell me a story."}])
    assert out.object == "response" and out.id.startswith("resp_") and out.model == live_server.model
    assert out.output_text == twin.choices[0].message.content
    [message] = out.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [c.type for c in message.content] == ["output_text"] and message.content[0].annotations == []
    assert out.usage.input_tokens == twin.usage.prompt_tokens
    assert out.usage.output_tokens == twin.usage.completion_tokens
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.usage.output_tokens_details.reasoning_tokens == 0
    assert out.usage.input_tokens_details.cached_tokens >= 0
    assert "ttft_s" in out.usage.model_extra["firsttoken"]
    assert out.store is False  # nothing is stored, whatever the client asked
    live_server.wait_idle()


def test_an_input_image_counts_the_tokens_the_chat_route_counts(live_server: LiveServer):
    url = image_data_url(make_image(112, 84, seed=3))
    out = respond(live_server, [{"role": "user", "content": [
        {"type": "input_text", "text": "What is in this picture?"},
        {"type": "input_image", "image_url": url, "detail": "auto"}]}])
    twin = chat(live_server, [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}]}])
    text_only = respond(live_server, [{"role": "user", "content": [
        {"type": "input_text", "text": "What is in this picture?"}]}])
    assert out.usage.input_tokens == twin.usage.prompt_tokens
    assert out.usage.input_tokens - text_only.usage.input_tokens == 12 + 2  # 8x6 patches merged 2x2, start, end
    assert out.output_text == twin.choices[0].message.content
    low = respond(live_server, [{"role": "user", "content": [{"type": "input_image", "image_url": url,
                                                               "detail": "low"}]}])
    assert low.usage.input_tokens <= out.usage.input_tokens


def test_instructions_and_history_are_the_chat_conversation(live_server: LiveServer):
    history = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi there."}]},
        {"role": "user", "content": "And now?"},
    ]
    out = respond(live_server, history[1:], instructions="Answer briefly.")
    twin = chat(live_server, [
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there."}, {"role": "user", "content": "And now?"}])
    assert out.instructions == "Answer briefly."
    assert out.output_text == twin.choices[0].message.content
    assert out.usage.input_tokens == twin.usage.prompt_tokens
    as_developer = respond(live_server, history)  # developer is rendered as system, as on chat
    assert as_developer.output_text == out.output_text
    assert as_developer.usage.input_tokens == out.usage.input_tokens
    plain = respond(live_server, "And now?")
    assert plain.usage.input_tokens < out.usage.input_tokens


def test_max_output_tokens_leaves_the_response_incomplete(live_server: LiveServer):
    out = respond(live_server, "Count to a hundred.", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete"
    assert out.usage.output_tokens == 3 and out.max_output_tokens == 3


def test_a_json_schema_text_format_validates_across_seeds_and_temperatures(live_server: LiveServer):
    fmt = {"type": "json_schema", "name": "receipt", "schema": RECEIPT, "strict": True}
    for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
        out = respond(live_server, "Read the receipt.", text={"format": fmt}, temperature=temperature,
                      max_output_tokens=200, extra_body={"seed": seed})
        assert out.status == "completed", out.output_text
        jsonschema.validate(json.loads(out.output_text), RECEIPT)
        assert out.text.format.type == "json_schema"
    obj = respond(live_server, "An object.", text={"format": {"type": "json_object"}}, max_output_tokens=200)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "word": {"type": "string", "maxLength": 8}},
         "required": ["ok", "word"], "additionalProperties": False}


@pytest.mark.parametrize("fmt", [None, {"type": "json_schema", "name": "small", "schema": SMALL, "strict": True}],
                         ids=["text", "json_schema"])
def test_a_stream_reassembles_into_the_greedy_answer(live_server: LiveServer, fmt):
    """Greedy: the deltas make exactly the non-streamed text, in OpenAI's event order. The random model rarely
    stops before the budget (the text case ends incomplete); the schema case ends completed, so the client's
    get_final_response (which wants response.completed) has its answer."""
    input = [{"role": "user", "content": [{"type": "input_text", "text": "Describe it."},
                                          {"type": "input_image", "image_url": image_data_url(make_image(56, 56))}]}]
    kw = dict(max_output_tokens=40 if fmt else 12, **({"text": {"format": fmt}} if fmt else {}))
    whole = respond(live_server, input, **kw)
    client = live_server.client()
    with client.responses.stream(model=live_server.model, input=input, temperature=0.0, **kw) as s:
        events = list(s)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert kinds == head + ["response.output_text.delta"] * len(deltas) + tail
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e for e in events if e.type == "response.output_text.done"][0].text == whole.output_text
    item = events[2].item.id
    assert {e.item_id for e in events if e.type == "response.output_text.delta"} == {item}
    last = events[-1].response
    assert last.id == events[0].response.id and last.output[0].id == item and last.output_text == whole.output_text
    assert last.usage.input_tokens == whole.usage.input_tokens
    assert last.usage.output_tokens == whole.usage.output_tokens
    if fmt:
        assert whole.status == "completed"
        assert s.get_final_response().output_text == whole.output_text
        jsonschema.validate(json.loads(whole.output_text), SMALL)
    else:
        assert whole.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    # create(stream=True) reads the same events
    raw = list(client.responses.create(model=live_server.model, input=input, temperature=0.0, stream=True, **kw))
    assert [e.type for e in raw] == kinds
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == whole.output_text
    live_server.wait_idle()


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(live_server: LiveServer):
    events = list(live_server.client().responses.create(model=live_server.model, input="Go on.", max_output_tokens=2,
                                                        temperature=0.0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 2


REFUSED = [
    ("previous_response_id", {"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ("background", {"input": "hi", "background": True}, "background"),
    ("conversation", {"input": "hi", "conversation": "conv_1"}, "conversation"),
    ("tools", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ("reasoning effort", {"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ("include", {"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ("truncation auto", {"input": "hi", "truncation": "auto"}, "truncation"),
    ("chat's response_format", {"input": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ("a function_call item", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     "input[0].type"),
    ("an input_file part", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "read"}, {"type": "input_file", "file_id": "file-1"}]}]},
     "input[0].content[1].type"),
    ("an input_image by file_id", {"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]}, "input[0].content[0].file_id"),
    ("a text.format of an unknown type", {"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ("a json_schema that cannot compile", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "strnig"}}}}, "text.format"),
    ("max_output_tokens past the context", {"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens"),
    ("a tool role", {"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ("an image detail that is none of auto, low, high", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "data:,", "detail": "ultra"}]}]},
     "input[0].content[1].detail"),
    ("an empty input list", {"input": []}, "input"),
]


@pytest.mark.parametrize("body,param", [(b, p) for _, b, p in REFUSED], ids=[n for n, _, _ in REFUSED])
def test_what_is_not_served_is_a_400_naming_the_field(live_server: LiveServer, body, param):
    before = live_server.stats()
    r = httpx.post(f"{live_server.base_url}/v1/responses", json={"model": live_server.model, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    if param is not None:
        assert error["param"] == param, error
        assert param.split(".")[0].split("[")[0] in error["message"], error
    assert live_server.stats()["num_waiting"] == before["num_waiting"] == 0  # refused before it queued


def test_the_official_client_raises_on_a_refusal(live_server: LiveServer):
    with pytest.raises(openai.BadRequestError) as err:
        respond(live_server, "hi", previous_response_id="resp_abc")
    assert "previous_response_id" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        respond(live_server, "hi", background=True)
    with pytest.raises(openai.NotFoundError):
        live_server.client().responses.create(model="gpt-5", input="hi")
    stored = respond(live_server, "hi", store=True, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError) as err:
        live_server.client().responses.retrieve(stored.id)  # nothing is stored
    assert "not stored" in str(err.value)


def test_harmless_fields_are_accepted_and_echoed(live_server: LiveServer):
    out = respond(live_server, "hi", metadata={"k": "v"}, user="u-1", store=True, top_p=0.9,
                  text={"format": {"type": "text"}, "verbosity": "medium"}, parallel_tool_calls=True,
                  reasoning={"effort": None}, tool_choice="auto", truncation="disabled", service_tier="auto")
    assert out.metadata == {"k": "v"} and out.user == "u-1" and out.top_p == 0.9
    assert out.store is False and out.status in ("completed", "incomplete")


def test_a_bad_image_is_refused_naming_its_input_path(live_server: LiveServer):
    r = httpx.post(f"{live_server.base_url}/v1/responses", timeout=30, json={
        "model": live_server.model, "instructions": "Look.", "input": [
            {"role": "user", "content": "first"},
            {"role": "user", "content": [{"type": "input_text", "text": "this"},
                                         {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input[1].content[1].image_url"


def test_a_client_that_leaves_mid_stream_aborts_its_request(live_server: LiveServer):
    body = {"model": live_server.model, "input": "Count to a thousand.", "max_output_tokens": 30_000,
            "temperature": 0.0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{live_server.base_url}/v1/responses",
                                                       json=body) as r:
        deltas, lines = 0, r.iter_lines()  # (held: an iterator dropped mid-loop closes the response)
        for line in lines:
            deltas += line == "event: response.output_text.delta"
            if deltas == 3:
                break
        seen = live_server.stats()
        assert seen["num_running"] == 1
    idle = live_server.wait_idle()
    assert idle["kv_blocks_used"] == 0
    # aborted: run on to its end (greedy, this prompt stops after some 5,900 tokens, one a step) it would take
    # thousands of steps more
    assert idle["num_steps"] - seen["num_steps"] < 2000
    assert respond(live_server, "still there?", max_output_tokens=2).usage.output_tokens == 2


def test_responses_parse_reads_a_pydantic_model(live_server: LiveServer):
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool
        colour: Literal["red", "green", "blue"]

    out = live_server.client().responses.parse(model=live_server.model, input="Judge it.", text_format=Verdict,
                                               max_output_tokens=60, temperature=1.0, extra_body={"seed": 4})
    assert out.status == "completed"
    assert isinstance(out.output_parsed, Verdict)
    assert out.output_parsed == Verdict.model_validate_json(out.output_text)
