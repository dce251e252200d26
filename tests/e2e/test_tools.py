"""Tool calls through the real server and the official openai client, on the random demo model: a named or required
tool_choice gives calls whose arguments are valid for the function's schema by construction (whole and streamed,
reassembled by the client's own stream helper); auto answers and tool-result turns are served; bad tool
definitions and choices are 400s naming the field."""

from __future__ import annotations

import json

from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def check_calls(calls, names=frozenset(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_tool_choice_gives_that_call_valid_by_construction(live_server) -> None:
    client = live_server.client()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                             max_tokens=60, temperature=1.0, seed=seed)
        message = out.choices[0].message
        assert message.content is None and out.choices[0].finish_reason == "stop"
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]
        check_calls(message.tool_calls)


def test_required_gives_one_or_more_valid_calls_and_parallel_false_gives_one(live_server) -> None:
    client = live_server.client()
    for seed, parallel in ((0, True), (1, True), (2, False), (3, False)):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=parallel, max_tokens=120, temperature=1.0,
                                             seed=seed)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
        check_calls(calls)
        if not parallel:
            assert len(calls) == 1


class Address(BaseModel):
    """An address."""

    city: Literal["Paris", "Lima", "Oslo"]
    zip: int = Field(ge=1, le=99)


class Move(BaseModel):
    """Move house: a nested model, which pydantic writes as $defs and "#/$defs/Address" references."""

    home: Address
    work: Address | None


def test_required_takes_tools_whose_parameters_reference_their_own_defs(live_server) -> None:
    client = live_server.client()
    tools = [openai.pydantic_function_tool(Move), TOOLS[1]]
    assert "$defs" in tools[0]["function"]["parameters"]
    for seed in range(3):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice="required",
                                             max_tokens=200, temperature=1.0, seed=seed)
        assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
        for call in out.choices[0].message.tool_calls:
            if call.function.name == "Move":
                Move.model_validate_json(call.function.arguments)
            else:
                check_calls([call])


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_streamed_tool_calls_reassemble_in_the_client(live_server, tool_choice) -> None:
    client = live_server.client()
    with client.chat.completions.stream(model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                        max_tokens=120, temperature=1.0, seed=7) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    check_calls(calls)
    assert len(deltas) > 1  # a named or required call's arguments stream token by token
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "get_time"


def test_auto_answers_and_a_conversation_with_tool_results_is_served(live_server) -> None:
    client = live_server.client()
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=20)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "developer", "content": "Answer briefly."},
    ]
    for stream in (False, True):
        out = client.chat.completions.create(model="tiny", messages=conversation, tools=TOOLS, tool_choice="auto",
                                             max_tokens=10, stream=stream)
        if stream:
            assert any(c.choices and c.choices[0].finish_reason for c in out)
        else:
            assert out.choices[0].message.content is not None or out.choices[0].message.tool_calls


def test_the_tools_reach_the_model_in_hermes_form(live_server) -> None:
    """The demo template renders no tools itself: they are written into the system turn, calls and results into
    the turns, as Qwen2.5's template writes them."""
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 1}
    with_tools = httpx.post(f"{live_server.base_url}/v1/chat/completions", json=body, timeout=30).json()
    without = httpx.post(f"{live_server.base_url}/v1/chat/completions", json={**body, "tools": None},
                         timeout=30).json()
    added = with_tools["usage"]["prompt_tokens"] - without["usage"]["prompt_tokens"]
    assert added > len(json.dumps(TOOLS)) // 8  # the function signatures are in the prompt


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_are_a_400_naming_the_field(live_server, extra: dict, param: str) -> None:
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 5, **extra}
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
