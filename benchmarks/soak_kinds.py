"""What the soak sends, kind by kind, and the rule each kind's answers must keep.

A kind is a list of cases (one request body each) made by its own generator, and a rule (``Rule``: an answer in,
the broken promise out, or None) that every answer to its cases must keep. Good cases are greedy: besides its rule,
each answer must equal its *alone* answer (the same request sent alone before the load; for ``n`` > 1, ``n`` copies
of the one-choice answer; for the Responses route, the chat twin's answer). Bad cases must be refused with a 4xx in
OpenAI's error shape. The adversarial cases (``--adversarial``) are inputs that a correct server refuses or ends with
an error finish, and never answers with a 5xx.

Every answer a good case's rule accepts ends the way its kind promises: constrained kinds are sized (max_tokens,
schemas with bounded fields) so that the greedy answer finishes with ``stop`` on the tiny checkpoint, and the rule
requires it, so that validity is checked on whole answers, not on answers cut by ``max_tokens``.
"""

from __future__ import annotations

import base64
import io
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jsonschema

from soak_answers import CHAT, RESPONSES, Answer, Choice, Route

Rule = Callable[[Answer], "str | None"]  # the promise an answer broke, or None


class Request(NamedTuple):
    route: Route
    body: dict


@dataclass(frozen=True, eq=False)  # a case is its own identity (a key for its alone answer)
class Case:
    kind: str
    body: dict  # without model, temperature and stream: the driver adds them
    rule: Rule
    route: Route = CHAT
    copies: int = 1  # choices asked for (n): the expected answer is the alone answer's one choice this many times
    alone_route: Route | None = None  # the request whose answer this one must equal: by default the same
    alone_body: dict | None = None

    @property
    def alone(self) -> Request:
        return Request(self.alone_route or self.route, self.body if self.alone_body is None else self.alone_body)


# ------------------------------------------------------------------------------------------- rules


def delivered(answer: Answer) -> str | None:
    """A 200 that carries choices and no error (event)."""
    if answer.status != 200 or answer.error is not None or not answer.choices:
        return f"status {answer.status}, error {answer.error!r}, {len(answer.choices)} choices"
    return None


def answered(answer: Answer) -> str | None:
    """A complete answer: delivered, each choice ended by a stop or the token budget."""
    ends = [c.finish_reason for c in answer.choices]
    return delivered(answer) or (None if all(end in ("stop", "length") for end in ends) else f"finish reasons {ends}")


def each_choice(check: Callable[[str], str | None]) -> Rule:
    """Every choice ends with "stop" (a whole answer, not one cut by max_tokens) and its text passes ``check``."""

    def rule(answer: Answer) -> str | None:
        problems = [f"finish {c.finish_reason!r}, not 'stop': {c.text!r}" if c.finish_reason != "stop"
                    else check(c.text) for c in answer.choices]
        return delivered(answer) or next((p for p in problems if p), None)

    return rule


def json_valid(schema: dict) -> Callable[[str], str | None]:
    def check(text: str) -> str | None:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as err:
            return f"{text!r} is not valid for the schema: {str(err).splitlines()[0]}"
        return None

    return check


def fullmatch(pattern: str) -> Callable[[str], str | None]:
    return lambda text: None if re.fullmatch(pattern, text) else f"{text!r} does not fullmatch {pattern!r}"


def one_of(options: list[str]) -> Callable[[str], str | None]:
    return lambda text: None if text in options else f"{text!r} is none of {options}"


def tool_calls(schemas: dict[str, dict], finish: str, named: str | None = None) -> Rule:
    """Tool calls only (no content), each to a listed function (``named``: exactly one, to it) with arguments valid
    for its parameters schema, every choice ended by ``finish``."""

    def calls_problem(choice: Choice) -> str | None:
        names = [call.name for call in choice.tool_calls]
        if choice.finish_reason != finish or choice.text or not names:
            return f"finish {choice.finish_reason!r} (want {finish!r}), content {choice.text!r}, calls {names}"
        if named is not None and names != [named]:
            return f"calls {names}, not one to {named}"
        unknown = [name for name in names if name not in schemas]
        if unknown:
            return f"calls to {unknown}, which are no listed tools"
        return next((p for p in (json_valid(schemas[c.name])(c.arguments) for c in choice.tool_calls) if p), None)

    def rule(answer: Answer) -> str | None:
        return delivered(answer) or next((p for p in map(calls_problem, answer.choices) if p), None)

    return rule


def logprobs_per_token(num_alternatives: int) -> Rule:
    """One logprob entry per generated token, each with the asked number of alternatives (one choice)."""

    def rule(answer: Answer) -> str | None:
        problem = answered(answer)
        if problem is not None:
            return problem
        if len(answer.choices) != 1:
            return f"{len(answer.choices)} choices, not 1"
        (c,) = answer.choices
        if c.logprobs is None or len(c.logprobs) != answer.completion_tokens:
            return (f"{'no' if c.logprobs is None else len(c.logprobs)} logprob entries for "
                    f"{answer.completion_tokens} tokens")
        if any(e.num_alternatives != num_alternatives for e in c.logprobs):
            return f"alternatives {[e.num_alternatives for e in c.logprobs]}, not {num_alternatives} each"
        return None

    return rule


def refused(answer: Answer) -> str | None:
    """A 4xx whose body is OpenAI's error shape (a message the client can show)."""
    if 400 <= answer.status < 500 and answer.error:
        return None
    return f"status {answer.status} (error {answer.error!r}), not a 4xx with an error body"


def refused_or_error_finish(answer: Answer) -> str | None:
    """A clear refusal (a 4xx with an error body) or an answer whose every choice ends with finish reason "error";
    a 5xx, a hang or a normal finish all break it."""
    if refused(answer) is None:
        return None
    ends = [c.finish_reason for c in answer.choices]
    if answer.status == 200 and ends and all(end == "error" for end in ends):
        return None
    return f"status {answer.status}, finish reasons {ends}, error {answer.error!r}"


# ------------------------------------------------------------------------------------------- a lark grammar


# A list of one to four items, each a number or a parenthesised operation: unambiguous, and every sentence ends
# (after the fourth item only "]" then EOS are allowed), so a greedy answer finishes by construction.
LIST_GRAMMAR = r"""start: "[" item ("," item)~0..3 "]"
item: NUM | "(" NUM OP NUM ")"
OP: "+" | "-" | "*"
NUM: /[0-9]{1,2}/
"""


def list_grammar_accepts(text: str) -> str | None:
    """LIST_GRAMMAR's recogniser, by recursive descent over its three rules."""
    at = 0

    def expect(chars: str) -> None:
        nonlocal at
        if at >= len(text) or text[at] not in chars:
            raise ValueError(f"expected one of {chars!r} at {at}")
        at += 1

    def num() -> None:
        nonlocal at
        expect("0123456789")
        if at < len(text) and text[at].isdigit():
            at += 1

    def item() -> None:
        if text[at:at + 1] == "(":
            expect("(")
            num()
            expect("+-*")
            num()
            expect(")")
        else:
            num()

    try:
        expect("[")
        item()
        for _ in range(3):
            if text[at:at + 1] != ",":
                break
            expect(",")
            item()
        expect("]")
    except ValueError as err:
        return f"{text!r} is not in the list grammar: {err}"
    return None if at == len(text) else f"{text!r} is not in the list grammar: text after the list at {at}"


# ------------------------------------------------------------------------------------------- inputs


def png_data_url(width: int, height: int, seed: int) -> str:
    from PIL import Image

    img = Image.new("RGB", (width, height), (seed * 53 % 256, 120, 200 - seed * 31 % 200))
    for x in range(0, width, 7):  # a little structure, so images differ beyond their colour
        for y in range(0, height, 5):
            img.putpixel((x, y), ((x * 13 + seed) % 256, (y * 7) % 256, (x + y) % 256))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def mp4_data_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def clip(seconds: float) -> bytes:
    """A small synthetic h264 clip made in this process with PyAV (64x48, 10 fps, a key frame every 5 frames)."""
    from firsttoken.inputs.video_synth import make_clip

    return make_clip(seconds, 64, 48, fps=10, gop=5)


def user(content: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": content}]


def image_turn(url: str, text: str) -> list[dict]:
    return user([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}])


def video_turn(url: str, text: str) -> list[dict]:
    return user([{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}])


# ------------------------------------------------------------------------------------------- good kinds

# max_tokens of the constrained kinds: room for the tiny checkpoint's greedy answers to finish (JSON may carry up to
# 16 whitespace characters between tokens); the rules require a "stop" or "tool_calls" finish
CONSTRAINED_MAX_TOKENS = 64
TOOL_MAX_TOKENS = 96
SEA = "Tell me about the sea."

SMALL_SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "word": {"type": "string", "enum": ["sea", "sky", "sun"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "word", "n"], "additionalProperties": False}
CODE_REGEX = r"[A-Z]{2}-[0-9]{3}"
COLOURS = ["red", "green", "blue"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
         "required": ["zone"], "additionalProperties": False}
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}}
         for name, schema in TOOL_SCHEMAS.items()]
TOP_LOGPROBS = 2


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "soak", "schema": schema, "strict": True}}


def text_cases(max_tokens: int) -> list[Case]:
    texts = [SEA, "def fibonacci(n):", "List three colours and a number: " * 3, "Why is the sky blue? Answer briefly."]
    return [Case("text", {"messages": user(t), "max_tokens": max_tokens}, answered) for t in texts]


def image_cases(max_tokens: int) -> list[Case]:
    return [Case("image", {"messages": image_turn(png_data_url(w, h, i), f"What is in picture {i}?"),
                           "max_tokens": max_tokens}, answered)
            for i, (w, h) in enumerate([(56, 56), (112, 84), (64, 160), (200, 120)])]


def constrained_cases(max_tokens: int) -> list[Case]:
    def constrained(kind: str, messages: list[dict], field: dict, check: Callable[[str], str | None]) -> Case:
        return Case(kind, {"messages": messages, "max_tokens": CONSTRAINED_MAX_TOKENS, **field}, each_choice(check))

    photo = image_turn(png_data_url(96, 64, 7), "Describe the picture as JSON.")
    return [
        constrained("json_schema", user(SEA), {"response_format": schema_format(SMALL_SCHEMA)},
                    json_valid(SMALL_SCHEMA)),
        constrained("json_schema", photo, {"response_format": schema_format(SMALL_SCHEMA)}, json_valid(SMALL_SCHEMA)),
        constrained("regex", user("Give me a code."), {"structured_outputs": {"regex": CODE_REGEX}},
                    fullmatch(CODE_REGEX)),
        constrained("grammar", user("A short list, please."), {"structured_outputs": {"grammar": LIST_GRAMMAR}},
                    list_grammar_accepts),
        constrained("choice", user("Pick a colour."), {"structured_outputs": {"choice": COLOURS}}, one_of(COLOURS)),
    ]


def tool_cases(max_tokens: int) -> list[Case]:
    ask = user("What's the weather in Paris, and the time there?")
    named = {"type": "function", "function": {"name": "get_weather"}}
    return [
        # one call (parallel_tool_calls false): the random model rarely closes an array of calls by itself
        Case("tool_required", {"messages": ask, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                               "max_tokens": TOOL_MAX_TOKENS}, tool_calls(TOOL_SCHEMAS, "tool_calls")),
        Case("tool_named", {"messages": ask, "tools": TOOLS, "tool_choice": named, "max_tokens": TOOL_MAX_TOKENS},
             tool_calls(TOOL_SCHEMAS, "stop", named="get_weather")),
    ]


def video_cases(max_tokens: int) -> list[Case]:
    return [Case("video", {"messages": video_turn(mp4_data_url(clip(2.0)), "What happens in this clip?"),
                           "max_tokens": max_tokens}, answered)]


def n_cases(max_tokens: int) -> list[Case]:
    """n = 2 of a free and a constrained request: every greedy choice is the one-choice answer."""
    free = {"messages": user("Name two rivers."), "max_tokens": max_tokens}
    constrained = {"messages": user("Two receipts."), "max_tokens": CONSTRAINED_MAX_TOKENS,
                   "response_format": schema_format(SMALL_SCHEMA)}
    return [Case("n", {**free, "n": 2}, answered, copies=2, alone_body=free),
            Case("n", {**constrained, "n": 2}, each_choice(json_valid(SMALL_SCHEMA)), copies=2,
                 alone_body=constrained)]


def logprob_cases(max_tokens: int) -> list[Case]:
    return [Case("logprobs", {"messages": user(SEA), "max_tokens": max_tokens, "logprobs": True,
                              "top_logprobs": TOP_LOGPROBS}, logprobs_per_token(TOP_LOGPROBS))]


def responses_cases(max_tokens: int) -> list[Case]:
    """Responses requests, each answering as its chat twin does (same conversation, same token budget)."""
    url = png_data_url(80, 56, 11)
    pairs = [
        ("Why is the sea salty?", user("Why is the sea salty?")),
        ([{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                       {"type": "input_image", "image_url": url}]}],
         user([{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}])),
    ]
    return [Case("responses", {"input": given, "max_output_tokens": max_tokens}, answered, route=RESPONSES,
                 alone_route=CHAT, alone_body={"messages": twin, "max_tokens": max_tokens})
            for given, twin in pairs]


# The good kinds: each generator makes its cases (every one answered greedily) from the free kinds' max_tokens (the
# constrained ones carry their own); the soak cycles through them all.
GOOD_KINDS: tuple[Callable[[int], list[Case]], ...] = (
    text_cases, image_cases, constrained_cases, tool_cases, video_cases, n_cases, logprob_cases, responses_cases)


def good_cases(max_tokens: int) -> list[Case]:
    return [case for kind in GOOD_KINDS for case in kind(max_tokens)]


# ------------------------------------------------------------------------------------------- bad and adversarial


def _bad(kind: str, body: dict, route: Route = CHAT) -> Case:
    return Case(kind, body, refused, route=route)


BAD_MAX_TOKENS = 8  # what a bad input would generate, were it wrongly accepted


def _chat(**fields) -> dict:
    return {"messages": user("hi"), "max_tokens": BAD_MAX_TOKENS, **fields}


def bad_cases() -> list[Case]:
    """Inputs every kind must refuse with a 4xx, before the engine sees them."""
    def image(url: str) -> dict:
        return _chat(messages=image_turn(url, "x"))

    good_clip = clip(2.0)
    return [
        _bad("bad_image", image("data:image/png;base64,@@")),
        _bad("bad_image", image("http://169.254.169.254/")),
        _bad("bad_image", image("/etc/passwd")),
        _bad("bad_field", _chat(max_tokens=-1)),
        _bad("bad_field", _chat(model="not-the-model")),
        _bad("bad_field", _chat(messages=[])),
        _bad("bad_schema", _chat(response_format=schema_format({"type": "integer", "minimum": 5, "maximum": 1}))),
        _bad("bad_schema", _chat(response_format=schema_format({"type": "object", "properties": {
            "a": {"type": "strnig"}}}))),
        _bad("bad_regex", _chat(structured_outputs={"regex": "[a-"})),
        _bad("bad_grammar", _chat(structured_outputs={"grammar": "start: missing_rule\n"})),
        _bad("bad_video", _chat(messages=video_turn(mp4_data_url(random.Random(0).randbytes(2000)), "x"))),
        _bad("bad_video", _chat(messages=video_turn(mp4_data_url(good_clip[:len(good_clip) // 2]), "x"))),
        _bad("bad_tools", _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})),
        _bad("bad_tools", _chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})),
        _bad("bad_field", _chat(n=0)),
        _bad("bad_field", _chat(logprobs=True, top_logprobs=21)),
        _bad("bad_responses", {"input": "hi", "previous_response_id": "resp_0", "max_output_tokens": BAD_MAX_TOKENS},
             route=RESPONSES),
        _bad("bad_responses", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
                               "max_output_tokens": BAD_MAX_TOKENS}, route=RESPONSES),
    ]


# An ambiguous grammar: the number of parses of "a" * k grows exponentially, so an Earley parser's rows grow with
# every token. n = 2 and a long budget.
AMBIGUOUS_GRAMMAR = 'start: x\nx: "a" | x x | x x x\n'
ADVERSARIAL_MAX_TOKENS = 200


def adversarial_cases() -> list[Case]:
    """Inputs a correct server refuses or ends with a clear error, never with a 5xx, and without stalling the
    requests batched with them (those keep their own rules and equalities)."""
    return [
        Case("adversarial_grammar", _chat(structured_outputs={"grammar": AMBIGUOUS_GRAMMAR}, n=2,
                                          max_tokens=ADVERSARIAL_MAX_TOKENS), refused_or_error_finish),
        # a regex no string matches: nothing valid can be generated, so it is refused like an unsatisfiable schema
        _bad("adversarial_empty_regex", _chat(structured_outputs={"regex": "a[^\\s\\S]"})),
    ]
