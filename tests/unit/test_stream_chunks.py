"""Streamed chat chunks carry every output's logprobs, and with continuous usage every chunk its choice's usage, even
where the tool-call parser holds an output's text back (a ``<tool_call>`` arriving over several tokens): a scripted
engine, the app, the official client (the matrix over the real server is tests/e2e/test_stream_extras.py)."""

from __future__ import annotations

import json

from firsttoken.types import FinishReason

from .fake_engine import FakeEngine, Script
from .test_api_protocol import MODEL, asgi_client, openai_client, processor, run  # noqa: F401 (a fixture)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# one token each; the 2nd and 3rd are held by the parser until the call closes
PIECES = ("Sure.", " <tool", "_call>\n", '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def test_held_back_text_still_streams_its_logprobs_and_usage(processor) -> None:
    async def go():
        engine = FakeEngine(Script(pieces=PIECES, logprobs=True, finish_reason=FinishReason.STOP))
        async with asgi_client(engine, processor) as http:
            stream = await openai_client(http).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
                logprobs=True, top_logprobs=2, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
            return [chunk async for chunk in stream]

    chunks = run(go())
    choices = [(c, c.choices[0]) for c in chunks if c.choices]
    assert sum(len(ch.logprobs.content) for _, ch in choices if ch.logprobs) == len(PIECES)
    assert all(c.usage is not None for c, _ in choices)
    assert [c.usage.completion_tokens for c, _ in choices] == [0, *range(1, len(PIECES) + 1)]
    calls = [t for _, ch in choices for t in ch.delta.tool_calls or ()]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_weather", {"city": "Oslo"})]
    assert "".join(ch.delta.content or "" for _, ch in choices).strip() == "Sure."
    assert choices[-1][1].finish_reason == "tool_calls"
