"""Tools in the prompt, and the grammar a forced call is held to.

Qwen2.5 and Qwen3 write tool calls the hermes way: the tools listed in the system turn inside
``<tools></tools>``, each call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, each result sent back as a user
turn inside ``<tool_response></tool_response>``. A checkpoint whose chat template renders tools
itself (it mentions ``tools``) gets them through the template; for one that does not (Qwen2-VL's),
``hermes_messages`` writes the same text into the messages, in Qwen2.5's words, so every family sees
tools the same way.

``forced_call_spec``: ``tool_choice`` ``required`` or a named function makes the answer the call
itself, as vLLM does: for a named function, the arguments object (its parameters' schema); for
``required``, a JSON array of one or more ``{"name", "arguments"}`` objects, each name one of the
tools' and its arguments that tool's schema. The answer is then valid by construction
(docs/structured_outputs.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from firsttoken.inputs.prompt import Function, Message, TextPart
from firsttoken.structured.spec import GrammarSpec, canonical_json

DEFAULT_SYSTEM = "You are a helpful assistant."
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tools_block(functions: Sequence[Function]) -> str:
    """The system turn's tool section, as Qwen2.5's chat template writes it."""
    lines = "\n".join(json.dumps(function_json(f), ensure_ascii=False) for f in functions)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def function_json(f: Function) -> dict[str, Any]:
    """A tool as OpenAI's request carries it (what a chat template's ``tools`` expects)."""
    body: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        body["description"] = f.description
    body["parameters"] = f.parameters if f.parameters is not None else ANY_OBJECT
    return {"type": "function", "function": body}


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (arguments: a JSON object's text, kept as sent)."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


def hermes_messages(messages: Sequence[Message], functions: Sequence[Function]) -> list[Message]:
    """The conversation with tools, calls and results written into plain system / user / assistant
    turns, for a chat template that renders no tools of its own."""
    out: list[Message] = []
    if functions:
        first = messages[0] if messages and messages[0].role == "system" else None
        system = _text_of(first) if first is not None else DEFAULT_SYSTEM
        out.append(Message("system", f"{system}\n\n{tools_block(functions)}"))
        messages = messages[1:] if first is not None else messages
    for m in messages:
        if m.role == "tool":
            result = f"<tool_response>\n{m.content or ''}\n</tool_response>"
            if out and out[-1].role == "user" and _is_tool_results(out[-1]):
                # consecutive results: one user turn
                out[-1] = Message("user", f"{out[-1].content}\n{result}")
            else:
                out.append(Message("user", result))
        elif m.tool_calls:
            calls = "\n".join(call_text(c.name, c.arguments) for c in m.tool_calls)
            text = _text_of(m)
            out.append(Message("assistant", f"{text}\n{calls}" if text else calls))
        else:
            out.append(m)
    return out


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]] | None:
    """The calls and results as a tool-aware chat template takes them (None: nothing tool-shaped to
    pass)."""
    if not any(m.tool_calls or m.role == "tool" for m in messages):
        return None
    return [{"tool_calls": [{"id": c.id, "type": "function",
                             "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                            for c in m.tool_calls]} if m.tool_calls else
            {"tool_call_id": m.tool_call_id} if m.role == "tool" else {} for m in messages]


def forced_call_spec(tools: Sequence[tuple[str, dict[str, Any] | None]], named: str | None,
                     parallel: bool) -> GrammarSpec:
    """The grammar of a forced call: ``tools`` as (name, parameters schema); ``named`` the function
    tool_choice names, else any of them (``required``), more than one only when ``parallel``."""
    schemas = {name: params if params is not None else ANY_OBJECT for name, params in tools}
    if named is not None:
        return GrammarSpec("json_schema", canonical_json(schemas[named]), False, "tool_choice")
    # each tool's schema moves under the array's root, at #/$defs/<name>: its own references
    # ("#/$defs/Address", "#" for itself) are rebased there, so they still name its parts (a tool's
    # name is a JSON pointer's token as is)
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{name}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in schemas
        ]
    }
    array: dict[str, Any] = {
        "$defs": {name: rebase_refs(schema, f"#/$defs/{name}") for name, schema in schemas.items()},
        "type": "array",
        "items": call,
        "minItems": 1,
    }
    if not parallel:
        array["maxItems"] = 1
    return GrammarSpec("json_schema", canonical_json(array), False, "tool_choice")


# keywords whose values are data, not schemas: a "$ref" inside them is a value to match, never a
# reference
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# keywords whose values map names (any, "const" included) to schemas
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with every reference into its own document ("#", "#/...") made relative to
    ``base``, the place it is moved to in a larger document; other references (another document's,
    an anchor) are left as they are."""
    if isinstance(schema, list):
        return [rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rebase_refs(sub, base) for name, sub in value.items()}
        else:
            out[key] = rebase_refs(value, base)
    return out


def _text_of(m: Message) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    return "".join(p.text for p in m.content if isinstance(p, TextPart))


def _is_tool_results(m: Message) -> bool:
    return isinstance(m.content, str) and m.content.startswith("<tool_response>")


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
