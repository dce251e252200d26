"""The tool-call parser (api/tool_calls.py) and the hermes rendering (inputs/tool_prompts.py): calls out of text whole and in any
split, malformed calls kept as text, results and calls written into turns."""

from __future__ import annotations

import json
import random

from firsttoken.api.tool_calls import ToolOutput
from firsttoken.inputs.prompt import Function, Message, ToolCall
from firsttoken.inputs.tool_prompts import forced_call_spec, hermes_messages

NAMES = frozenset({"get_weather", "get_time"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def streamed(mode: str, text: str, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """The text fed in random pieces: (content, [(name, arguments)])."""
    out = ToolOutput(mode, NAMES)
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        pieces += out.feed(text[i:i + n])
        i += n
    pieces += out.finish()
    content = "".join(p.content for p in pieces if p.content is not None)
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if p.index is not None:
            entry = calls.setdefault(p.index, [p.name or "", ""])
            entry[1] += p.arguments or ""
    return content, [tuple(v) for _, v in sorted(calls.items())]


def test_auto_finds_calls_in_any_split_and_keeps_the_text_around_them() -> None:
    text = "Let me check." + CALL + "\n" + CALL.replace("get_weather", "get_time").replace('"city": "Paris"', '')
    whole_content, whole_calls = ToolOutput("auto", NAMES).complete(text)
    assert whole_content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == [("get_weather", {"city": "Paris"}),
                                                                         ("get_time", {})]
    for seed in range(20):
        content, calls = streamed("auto", text, seed)
        assert content.strip() == "Let me check."
        assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_a_malformed_or_unknown_call_stays_text_and_finishes_as_the_model_did() -> None:
    for bad in ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
                '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'):  # cut by max_tokens
        out = ToolOutput("auto", NAMES)
        content, calls = out.complete("Sure. " + bad)
        assert calls == [] and content == "Sure. " + bad and out.finish_reason("stop") == "stop"
        for seed in range(5):
            assert streamed("auto", "Sure. " + bad, seed) == ("Sure. " + bad, [])


def test_text_that_only_looks_like_a_call_start_is_released() -> None:
    for seed in range(10):
        assert streamed("auto", "a < b and <tool> is not <tool_call", seed)[0] == "a < b and <tool> is not <tool_call"


def test_required_parses_the_array_and_named_streams_the_arguments() -> None:
    array = json.dumps([{"name": "get_time", "arguments": {"zone": 3}}, {"name": "get_weather", "arguments": {}}])
    out = ToolOutput("required", NAMES)
    content, calls = out.complete(array)
    assert content in (None, "") and [c.name for c in calls] == ["get_time", "get_weather"]
    assert out.finish_reason("stop") == "tool_calls"
    assert streamed("required", array, 1)[1] == [("get_time", '{"zone": 3}'), ("get_weather", "{}")]
    named = ToolOutput("named", NAMES, named="get_time")
    pieces = named.feed('{"zo') + named.feed('ne": 1}') + named.finish()
    assert pieces[0].name == "get_time" and "".join(p.arguments or "" for p in pieces) == '{"zone": 1}'
    assert named.finish_reason("stop") == "stop"


def test_forced_specs_name_the_tools_and_their_schemas() -> None:
    schema = {"type": "object", "properties": {"zone": {"type": "integer"}}}
    named = forced_call_spec([("get_time", schema), ("get_weather", None)], "get_time", True)
    assert json.loads(named.source) == schema and named.origin == "tool_choice"
    one = json.loads(forced_call_spec([("get_time", schema), ("get_weather", None)], None, False).source)
    assert one["maxItems"] == 1 and [o["properties"]["name"]["const"] for o in one["items"]["anyOf"]] == [
        "get_time", "get_weather"]


def test_hermes_messages_write_tools_calls_and_results_into_turns() -> None:
    functions = (Function("get_time", "Time in a zone", {"type": "object"}),)
    messages = (Message("system", "Be brief."), Message("user", "time?"),
                Message("assistant", None, (ToolCall("call_1", "get_time", '{"zone": 1}'),)),
                Message("tool", "12:00", tool_call_id="call_1"), Message("tool", "13:00", tool_call_id="call_2"))
    out = hermes_messages(messages, functions)
    assert [m.role for m in out] == ["system", "user", "assistant", "user"]
    assert out[0].content.startswith("Be brief.\n\n# Tools") and '"name": "get_time"' in out[0].content
    assert out[2].content == '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
    assert out[3].content == "<tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n</tool_response>"
    assert hermes_messages(messages[1:2], ()) == [messages[1]]  # no tools: the conversation as it was


def test_required_streams_each_calls_arguments_as_they_arrive_in_any_split() -> None:
    tricky = {"city": "Pa}ri\"s{", "list": [1, {"a": "]"}], "n": -2.5e3, "ok": True, "none": None}
    arrays = [
        json.dumps([{"name": "get_weather", "arguments": tricky}, {"name": "get_time", "arguments": {}}]),
        '[ {"arguments" : {"zone": 3} , "name" : "get_time"} ]',  # arguments before the name: held, then sent
        json.dumps([{"name": "get_time", "arguments": {"zone": "\\u00e9\\\\"}}], indent=2),
    ]
    for array in arrays:
        whole = [(c["name"], json.dumps(c["arguments"])) for c in json.loads(array)]
        for seed in range(12):
            content, calls = streamed("required", array, seed)
            assert content == "" and [(n, json.loads(a)) for n, a in calls] == [(n, json.loads(a)) for n, a in whole]
    # the name goes out before the arguments are complete: a client sees the call start early
    out = ToolOutput("required", NAMES)
    first = out.feed('[{"name": "get_weather", "arguments": {"ci')
    assert [p.name for p in first if p.name] == ["get_weather"] and "".join(p.arguments or "" for p in first) == '{"ci'


def test_required_cut_short_keeps_the_calls_begun_and_text_without_one_is_content() -> None:
    out = ToolOutput("required", NAMES)
    content, calls = out.complete('[{"name": "get_time", "arguments": {"zone": 1')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": 1')]
    assert out.finish_reason("length") == "length"
    out = ToolOutput("required", NAMES)
    assert out.complete('[{"na') == ('[{"na', [])


def test_a_template_that_renders_tools_gets_them_with_the_calls_and_results(tiny_model_dir) -> None:
    """Qwen2.5's and Qwen3's templates render tools themselves: the processor hands them the tools as JSON
    schemas, an assistant turn's calls with their arguments as objects, and tool turns, and writes nothing in."""
    from pathlib import Path

    from firsttoken.config import GenerationDefaults
    from firsttoken.inputs.processor import InputProcessor, load_tokenizer
    from firsttoken.inputs.prompt import ChatPrompt, SamplingRequest
    from firsttoken.models.registry import load_model_config

    template = Path(__file__).parents[1] / "fixtures" / "templates" / "hermes_tools.jinja"
    tokenizer = load_tokenizer(tiny_model_dir, chat_template=template)
    processor = InputProcessor(tokenizer, load_model_config(tiny_model_dir),
                               GenerationDefaults.from_pretrained(tiny_model_dir), max_model_len=4096)
    functions = (Function("get_time", "Time in a zone", {"type": "object", "properties": {"zone": {"type": "integer"}}}),)
    messages = (Message("system", "Be brief."), Message("user", "time?"),
                Message("assistant", None, (ToolCall("call_1", "get_time", '{"zone": 1}'),)),
                Message("tool", "12:00", tool_call_id="call_1"))
    request = processor.process(ChatPrompt(messages, tools=functions), SamplingRequest(max_tokens=4), "r", 0.0)
    text = processor.decode(request.prompt_token_ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n")
    tool = json.loads(text.split("<tools>\n")[1].split("\n</tools>")[0])
    assert tool == {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                                      "parameters": functions[0].parameters}}
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert text.count("# Tools") == 1  # nothing written into the turns besides what the template renders
