"""/tokenize counts the prompt the chat route prefills for the same body, whatever of it the chat template renders:
tools, an earlier turn's tool calls and the tool's answer, add_generation_prompt (api/protocol.py ChatPromptFields:
one request type for both routes). Through the real server and the official openai client."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "unit": "C"}'}

BODIES: dict[str, dict[str, Any]] = {
    "tools": {"messages": [ASK], "tools": [WEATHER, CLOCK]},
    "tools, tool_choice auto": {"messages": [ASK], "tools": [WEATHER], "tool_choice": "auto"},
    "a tool call and its answer": {"messages": [ASK, CALLED, ANSWERED], "tools": [WEATHER]},
    "no generation prompt": {"messages": [ASK, {"role": "assistant", "content": "It is"}],
                             "add_generation_prompt": False},
}


def count(live, body: dict[str, Any]) -> int:
    r = httpx.post(f"{live.base_url}/tokenize", json={"model": live.model, **body})
    assert r.status_code == 200, r.text
    return r.json()["count"]


@pytest.mark.parametrize("name", list(BODIES))
def test_tokenize_counts_what_the_chat_route_prefills(live_server, name: str) -> None:
    body = BODIES[name]
    typed = {k: v for k, v in body.items() if k in ("messages", "tools", "tool_choice")}  # the client's own arguments
    extra = {k: v for k, v in body.items() if k not in typed}
    answer = live_server.client().chat.completions.create(model=live_server.model, max_tokens=1, temperature=0.0,
                                                          extra_body=extra, **typed)
    assert count(live_server, body) == answer.usage.prompt_tokens
    live_server.wait_idle()


def test_tools_are_counted(live_server) -> None:
    # what a client sizing its request against max_model_len reads: the tools' schemas are part of the prompt
    assert count(live_server, BODIES["tools"]) > count(live_server, {"messages": [ASK]}) + 20
