"""The soak's rules and answer readers (benchmarks/soak_kinds.py, soak_answers.py) without a server: each kind's rule
refuses the broken answers a server could send (a rule that accepts anything would make the soak pass on a broken
server), and a streamed answer reads equal to the same answer sent whole."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak_kinds as kinds  # noqa: E402
from soak_answers import CHAT, RESPONSES, Answer, Choice, Logprob, ToolCall  # noqa: E402


def answer(*choices: Choice, tokens: int = 3) -> Answer:
    return Answer(200, choices, tokens)


def stop(text: str) -> Answer:
    return answer(Choice(text, "stop"))


@functools.cache
def rules() -> dict[str, kinds.Rule]:
    return {case.kind: case.rule for case in kinds.good_cases(12)}  # the kinds tested here have one rule each


def rule_of(kind: str) -> kinds.Rule:
    return rules()[kind]


GOOD_JSON = '{"ok": true, "word": "sea", "n": 3}'


@pytest.mark.parametrize("kind, good, bad", [
    ("json_schema", stop(GOOD_JSON), stop('{"ok": true, "word": "moon", "n": 3}')),
    ("json_schema", stop(GOOD_JSON), answer(Choice(GOOD_JSON[:-1], "length"))),  # cut: not a whole answer
    ("regex", stop("AB-123"), stop("AB-1234")),
    ("grammar", stop("[(1+2),34]"), stop("[1,2,3,4,5]")),  # five items: one more than the grammar allows
    ("grammar", stop("[7]"), stop("[123]")),  # a three-digit number
    ("grammar", stop("[(1*2)]"), stop("[(1*2)")),
    ("choice", stop("green"), stop("purple")),
    ("text", answer(Choice("x", "length")), answer(Choice("x", "error"))),
    ("text", answer(Choice("x", "stop")), replace(stop("x"), status=500)),
    ("text", answer(Choice("x", "stop")), replace(stop("x"), error="the request failed")),  # a stream's error event
])
def test_a_rule_accepts_its_kind_and_refuses_a_broken_answer(kind: str, good: Answer, bad: Answer) -> None:
    rule = rule_of(kind)
    assert rule(good) is None
    assert rule(bad) is not None


def test_tool_rules_want_calls_valid_for_their_schema() -> None:
    weather = ToolCall("get_weather", '{"city": "Lima", "unit": "c"}')
    required, named = rule_of("tool_required"), rule_of("tool_named")
    assert required(answer(Choice("", "tool_calls", (weather, ToolCall("get_time", '{"zone": 3}'))))) is None
    assert named(answer(Choice("", "stop", (weather,)))) is None
    for broken in (Choice("", "tool_calls", (ToolCall("get_weather", '{"city": "Rome", "unit": "c"}'),)),
                   Choice("", "tool_calls", (ToolCall("get_time", '{"zone": 99}'),)),
                   Choice("", "tool_calls", (ToolCall("launch", "{}"),)),
                   Choice("", "tool_calls", ()),
                   Choice("some text", "tool_calls", (weather,)),
                   Choice("", "length", (weather,))):
        assert required(answer(broken)) is not None, broken
    assert named(answer(Choice("", "stop", (ToolCall("get_time", '{"zone": 3}'),)))) is not None


def test_logprobs_want_one_entry_per_token_with_the_alternatives_asked() -> None:
    rule = rule_of("logprobs")
    entries = tuple(Logprob(t, kinds.TOP_LOGPROBS) for t in ("a", "b", "c"))
    assert rule(answer(Choice("abc", "length", logprobs=entries), tokens=3)) is None
    assert rule(answer(Choice("abc", "length", logprobs=entries[:2]), tokens=3)) is not None
    assert rule(answer(Choice("abc", "length", logprobs=None), tokens=3)) is not None
    assert rule(answer(Choice("abc", "length", logprobs=(*entries[:2], Logprob("c", 0))), tokens=3)) is not None


def test_bad_inputs_want_a_4xx_with_an_error_and_adversarial_ones_no_5xx() -> None:
    assert kinds.refused(Answer(400, error="n must be from 1 to 128")) is None
    assert kinds.refused(Answer(400)) is not None  # not OpenAI's error shape
    assert kinds.refused(Answer(500, error="internal server error")) is not None
    assert kinds.refused(stop("")) is not None
    adversarial = kinds.refused_or_error_finish
    assert adversarial(Answer(400, error="grammar too ambiguous")) is None
    assert adversarial(answer(Choice("aaa", "error"), Choice("aa", "error"))) is None
    assert adversarial(Answer(500, error="internal server error")) is not None
    assert adversarial(answer(Choice("aaa", "length"), Choice("aa", "error"))) is not None


async def _lines(events: list[dict | str]):
    for event in events:
        yield event if isinstance(event, str) else "data: " + json.dumps(event)


def read_stream(route, events: list[dict | str]) -> Answer:
    return asyncio.run(route.read_stream(_lines(events)))


def test_a_streamed_chat_answer_reads_as_the_same_answer_whole() -> None:
    """Two choices interleaved, a tool call's name then its argument deltas, logprobs per chunk, usage last."""
    lp = {"content": [{"token": "h", "logprob": -1.0, "top_logprobs": [{}, {}]}]}
    whole = {"choices": [
        {"index": 0, "message": {"content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 3}'}}]},
         "finish_reason": "tool_calls", "logprobs": None},
        {"index": 1, "message": {"content": "hi"}, "finish_reason": "length", "logprobs": lp}],
        "usage": {"completion_tokens": 7}}
    chunk = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 1, "delta": {"content": "h"}, "logprobs": lp}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                             "function": {"name": "get_time", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"zone"'}}]}}]},
        {"choices": [{"index": 1, "delta": {"content": "i"}, "finish_reason": "length"}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ': 3}'}}]},
                      "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"completion_tokens": 7}},
        "data: [DONE]",
    ]
    streamed = read_stream(CHAT, chunk)
    assert streamed == CHAT.read_whole(whole)
    assert streamed.choices[1].logprobs == (Logprob("h", 2),)
    failed = read_stream(CHAT, chunk[:3] + [{"error": {"message": "internal server error"}}, "data: [DONE]"])
    assert kinds.answered(failed) is not None


def test_a_streamed_response_reads_as_its_final_response_and_its_chat_twin() -> None:
    final = {"status": "incomplete", "output": [{"type": "message", "content": [{"type": "output_text",
                                                                                  "text": "ab"}]}],
             "usage": {"output_tokens": 2}}
    events = [{"type": "response.created"}, {"type": "response.output_text.delta", "delta": "a"},
              {"type": "response.output_text.delta", "delta": "b"}, {"type": "response.incomplete", "response": final}]
    twin = CHAT.read_whole({"choices": [{"index": 0, "message": {"content": "ab"}, "finish_reason": "length"}],
                            "usage": {"completion_tokens": 2}})
    assert read_stream(RESPONSES, events) == RESPONSES.read_whole(final) == twin
    lying = events[:2] + events[3:]  # a delta lost: the deltas no longer make the final text
    assert kinds.answered(read_stream(RESPONSES, lying)) is not None
    assert kinds.answered(read_stream(RESPONSES, events[:3])) is not None  # no final event
