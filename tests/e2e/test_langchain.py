"""LangChain against the real server (issue 41): ChatOpenAI's with_structured_output and bind_tools return parsed
objects (by json_schema response formats and by forced tool calls: valid by construction on the random demo model),
and the legacy OpenAI class completes a batch (one request carrying a list of prompts)."""

from __future__ import annotations

from typing import Literal

import langchain_openai  # the test extra's
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.test_tools import Move


class Receipt(BaseModel):
    """A receipt's summary."""

    currency: Literal["EUR", "USD", "GBP"]
    total: int = Field(ge=0, le=999)
    paid: bool


def get_weather(city: Literal["Paris", "Lima", "Oslo"], unit: Literal["c", "f"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def chat(live, **kw):
    """Sampling for real (the checkpoint's defaults are near greedy); JSON whitespace is at most 16 per gap."""
    return langchain_openai.ChatOpenAI(base_url=f"{live.base_url}/v1", api_key="unused", model=live.model,
                                       max_retries=0, max_tokens=400, top_p=1.0, extra_body={"top_k": 0}, **kw)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output_returns_the_model(live_server, method) -> None:
    # strict: LangChain then closes the schema (additionalProperties false); an open one lets the random demo model
    # write extra keys until max_tokens (a trained model stops; the grammar cannot tell it to)
    kwargs = {"method": method, "strict": True} if method == "function_calling" else {"method": method}
    for seed in range(3):
        llm = chat(live_server, temperature=1.0, seed=seed)
        if method == "json_mode":  # any JSON object: parsed as a dict, not validated against a schema
            out = llm.with_structured_output(None, **kwargs).invoke("Return the receipt as JSON.")
            assert isinstance(out, dict)
            continue
        out = llm.with_structured_output(Receipt, include_raw=True, **kwargs).invoke("Read this receipt: EUR 12.50, paid.")
        assert isinstance(out["parsed"], Receipt) and 0 <= out["parsed"].total <= 999, out


@pytest.mark.parametrize("tool_choice", ["get_weather", "any"])
def test_bind_tools_gives_calls_with_valid_arguments(live_server, tool_choice) -> None:
    for seed in range(3):
        llm = chat(live_server, temperature=1.0, seed=seed).bind_tools([get_weather], tool_choice=tool_choice,
                                                                       strict=True)
        message = llm.invoke("What's the weather in Paris, in celsius?")
        assert message.tool_calls, message
        for call in message.tool_calls:
            assert call["name"] == "get_weather"
            assert call["args"]["city"] in ("Paris", "Lima", "Oslo") and call["args"]["unit"] in ("c", "f")


def test_bind_tools_any_takes_a_tool_whose_schema_has_defs(live_server) -> None:
    """A tool given as its JSON schema (an MCP server's, openai.pydantic_function_tool's) keeps $defs and
    "#/$defs/..." references; tool_choice "any" (OpenAI's "required") holds the calls to it."""
    tool = openai.pydantic_function_tool(Move)
    assert "$defs" in tool["function"]["parameters"]
    for seed in range(2):
        message = chat(live_server, temperature=1.0, seed=seed).bind_tools([tool], tool_choice="any").invoke(
            "I moved to Lima.")
        assert message.tool_calls, message
        for call in message.tool_calls:
            assert call["name"] == "Move"
            Move.model_validate(call["args"])


def test_the_legacy_openai_class_completes_a_batch(live_server) -> None:
    llm = langchain_openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", model=live_server.model,
                                  max_retries=0, max_tokens=5, temperature=0.0)
    prompts = ["Hello there", "Once upon a time", "1, 2, 3,"]
    answers = llm.batch(prompts)
    assert len(answers) == 3 and all(isinstance(a, str) and a for a in answers)
    result = llm.generate(prompts)  # one request with the three prompts (its batch_size is 20)
    assert [g[0].text for g in result.generations] == answers
    live_server.wait_idle()
