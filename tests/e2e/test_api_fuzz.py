"""Property-based fuzzing of /v1/chat/completions, /v1/completions, /tokenize and /v1/responses through the real
server (issue 37, item 10). Bodies and the oracle that judges them: tests/e2e/fuzz_bodies.py. For each example:

(a) the answer is a 2xx only if no field is BAD; a 4xx in OpenAI's error shape whose ``param`` or message names a
    BAD or MAYBE field; a 404 only for an unknown model; never a 5xx; an all-OK body is never refused;
(b) a 2xx keeps the request's limits (max_tokens, ignore_eos, logprobs, usage adding up, prompt_tokens equal to
    /tokenize's count) and its ``usage.firsttoken`` timings are never negative; a stream is well-formed SSE ending
    in ``data: [DONE]`` (or an error event in OpenAI's shape, then ``[DONE]``), with exactly one usage chunk, last,
    when ``stream_options.include_usage`` asks for it and none otherwise; a Responses stream is ``event:`` +
    ``data:`` frames numbered from 0, in OpenAI's order, its deltas making the final text (or ending in one
    ``error`` event), its usage (input_tokens: /tokenize's count of the chat conversation it stands for) checked
    as chat's;
(c) it is answered within ``REQUEST_TIMEOUT_S``: a hang is a failure;
(d) afterwards the server is back to idle: no KV block used, nothing running or waiting, no engine or runner
    request state, no encoder-cache pin, no half-done encode, no image embedding the scheduler forgot, no
    admission reservation, no request slot; the engine alive and its scheduler's invariants holding.

The committed run is derandomized with fixed example counts and no example database (nothing is written to
.hypothesis/). To hunt for bugs: ``FIRSTTOKEN_FUZZ_SEED=7 FIRSTTOKEN_FUZZ_EXAMPLES=400 python -m pytest
tests/e2e/test_api_fuzz.py --hypothesis-show-statistics``. A failure prints the request as sent (images by
catalog name) and the response.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, example, given, seed, settings

from firsttoken.api.protocol import UNSUPPORTED_FIELDS, ChatPromptFields
from firsttoken.api.responses_api import RESPONSES_UNSUPPORTED
from tests.e2e.conftest import LiveServer, start_server, stop_server
from tests.e2e.fuzz_bodies import (
    CHAT,
    CHAT_SCHEMA,
    CHAT_SPECS,
    COMPLETION_SCHEMA,
    COMPLETION_SPECS,
    COMPLETIONS,
    IMAGE_CATALOG,
    IMAGE_NAMES,
    VIDEO_NAMES,
    MAX_IMAGES,
    MAX_VIDEOS,
    MAX_MODEL_LEN,
    MAX_PIXELS,
    MODEL,
    RESPONSES,
    RESPONSES_SCHEMA,
    RESPONSES_SPECS,
    RESPONSES_UNSUPPORTED_EDGES,
    as_chat_messages,
    input_verdict,
    judge_responses,
    num_choices,
    responses_bodies,
    responses_part_verdict,
    TOKENIZE,
    TOKENIZE_SCHEMA,
    TOKENIZE_SPECS,
    UNSUPPORTED_EDGES,
    AtRoom,
    Expect,
    V,
    chat_bodies,
    completion_bodies,
    content_parts,
    image_urls,
    num_videos,
    judge,
    spec_of,
    lax_true,
    messages_verdict,
    part_verdict,
    text_rule,
    tokenize_bodies,
)

REQUEST_TIMEOUT_S = 60.0  # per request: longer is a hang
IDLE_TIMEOUT_S = 20.0  # for the server to settle after an answer
CHECK_TTFT_WITHIN_E2E = True  # a response's ttft_s <= e2e_s (Timeline: monotone by construction)

FUZZ_SEED = os.environ.get("FIRSTTOKEN_FUZZ_SEED")  # set: random with this seed; unset: derandomized (CI)
FUZZ_EXAMPLES = os.environ.get("FIRSTTOKEN_FUZZ_EXAMPLES")  # set: this many examples per property


def fuzz_settings(max_examples: int) -> Callable[[Callable], Callable]:
    """The committed settings (fixed examples, derandomized, no database, no deadline), or the hunt's."""
    count = int(FUZZ_EXAMPLES) if FUZZ_EXAMPLES else max_examples

    def apply(test: Callable) -> Callable:
        test = settings(max_examples=count, deadline=None, derandomize=FUZZ_SEED is None, database=None,
                        print_blob=False, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                 HealthCheck.filter_too_much])(test)
        return seed(int(FUZZ_SEED))(test) if FUZZ_SEED is not None else test

    return apply


# ------------------------------------------------------------------------------------------- the server


@dataclass
class Fuzzed:
    live: LiveServer
    app: Any  # the FastAPI app, for its request slots
    http: httpx.Client


@pytest.fixture(scope="module")
def fuzzed(tiny_model_dir: Path) -> Iterator[Fuzzed]:
    live, server, thread = start_server(tiny_model_dir, max_model_len=MAX_MODEL_LEN, max_image_pixels=MAX_PIXELS,
                                        max_images_per_request=MAX_IMAGES)
    with httpx.Client(base_url=live.base_url, timeout=REQUEST_TIMEOUT_S) as http:
        yield Fuzzed(live, server.config.app, http)
    stop_server(server, thread, live.engine)


def shown(body: dict | bytes) -> str:
    """The body as sent, images by catalog name and long strings cut (the full body is rebuilt from these)."""
    if isinstance(body, bytes):
        return repr(body[:500])

    def short(value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("url"), str) and value["url"] in IMAGE_NAMES:
            return {**{k: short(v) for k, v in value.items()}, "url": f"<image: {IMAGE_NAMES[value['url']]}>"}
        if isinstance(value, dict) and isinstance(value.get("url"), str) and value["url"] in VIDEO_NAMES:
            return {**{k: short(v) for k, v in value.items()}, "url": f"<video: {VIDEO_NAMES[value['url']]}>"}
        if isinstance(value, str) and value in IMAGE_NAMES:  # a frame of a frame-list video
            return f"<image: {IMAGE_NAMES[value]}>"
        if isinstance(value, dict):
            return {k: short(v) for k, v in value.items()}
        if isinstance(value, list):
            return [short(v) for v in value[:40]] + ([f"... {len(value)} items"] if len(value) > 40 else [])
        if isinstance(value, str) and len(value) > 80:
            return f"{value[:40]!r}... ({len(value)} chars)"
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**40:
            return f"<int of {len(dumps_int(abs(value)))} digits>"
        return value

    return json.dumps(short(body), ensure_ascii=True)


@dataclass
class Exchange:
    route: str
    body: dict | bytes
    response: httpx.Response | None = None

    def fail(self, reason: str) -> None:
        r = self.response
        answer = "no response" if r is None else f"{r.status_code} {r.text[:3000]}"
        raise AssertionError(f"{reason}\nPOST {self.route} {shown(self.body)}\n-> {answer}")

    def check(self, condition: Any, reason: str) -> None:
        if not condition:
            self.fail(reason)


def dumps_int(value: int) -> str:
    """Decimal digits of an int of any size (str() refuses more than 4300 digits)."""
    if abs(value) < 10**4000:
        return str(value)
    digits, rest = [], abs(value)
    chunk = 10**1000
    while rest:
        rest, low = divmod(rest, chunk)
        digits.append(str(low).zfill(1000))
    return ("-" if value < 0 else "") + "".join(reversed(digits)).lstrip("0")


def post(fz: Fuzzed, route: str, body: dict | bytes) -> httpx.Response:
    data = encode_body(body)
    return fz.http.post(route, content=data, headers={"content-type": "application/json"})


def encode_body(body: dict | bytes) -> bytes:
    """JSON as a client library writes it (ASCII, NaN allowed), integers of any length written out."""
    if isinstance(body, bytes):
        return body
    huge: dict[str, int] = {}

    def swap(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**4000:
            token = f"__huge_int_{len(huge)}__"
            huge[token] = value
            return token
        return value

    text = json.dumps(swap(body), ensure_ascii=True, allow_nan=True)
    for token, value in huge.items():
        text = text.replace(json.dumps(token), dumps_int(value))
    return text.encode()


def resolve(fz: Fuzzed, route: str, body: dict | bytes) -> tuple[dict | bytes, int | None]:
    """(the body to send, /tokenize's count of its prompt): AtRoom values become room + delta."""
    if not isinstance(body, dict) or route == TOKENIZE:
        return body, None
    count = None
    key = "messages" if route in (CHAT, RESPONSES) else "prompt"
    if route == RESPONSES:  # counted as the chat conversation it stands for
        instructions = RESPONSES_SPECS["instructions"].rule(body.get("instructions"))
        prompt_ok = max(input_verdict(body.get("input")), instructions)
        wanted = prompt_ok != V.BAD and "input" in body
        prompt = as_chat_messages(body) if wanted else None
    else:
        prompt_ok = messages_verdict(body.get("messages")) if route == CHAT else text_rule(body.get("prompt"))
        wanted, prompt = prompt_ok != V.BAD and key in body, body.get(key)
    counted: dict[str, Any] = {key: prompt}
    if route == CHAT:  # the body's fields the chat template renders (tools ...), counted by /tokenize as by chat
        counted = {k: body[k] for k in ChatPromptFields.model_fields if k in body}
        prompt_ok = max([prompt_ok, *(spec_of(CHAT_SPECS, k).rule(v) for k, v in counted.items() if k != key)])
    if wanted:
        r = fz.http.post(TOKENIZE, json=counted)
        if r.status_code == 200:
            count = r.json()["count"]
        else:
            Exchange(TOKENIZE, counted, r).check(
                400 <= r.status_code < 500 and prompt_ok != V.OK, "/tokenize refused a prompt the oracle judged correct")
    room = None if count is None else MAX_MODEL_LEN - count
    resolved = {k: (max(1, room if room is not None else MAX_MODEL_LEN - 30) + v.delta if isinstance(v, AtRoom) else v)
                for k, v in body.items()}
    return resolved, count


# ------------------------------------------------------------------------------------------- checking an answer


def check_error(ex: Exchange, payload: Any, status: int, expect: Expect) -> None:
    """An error body in OpenAI's shape that names a field the oracle found wrong."""
    ex.check(isinstance(payload, dict) and set(payload) == {"error"}, "error body is not {'error': {...}}")
    error = payload["error"]
    ex.check(isinstance(error, dict) and set(error) == {"message", "type", "param", "code"},
             "error lacks OpenAI's keys message, type, param, code")
    ex.check(error["code"] == status and isinstance(error["message"], str) and error["message"], "bad error code/message")
    ex.check(error["param"] is None or isinstance(error["param"], str), "param is not a string or null")
    if status == 404:
        ex.check(expect.unknown_model and error["param"] == "model", "404 for a model that exists")
        return
    if expect.raw_body:
        return
    suspects = expect.bad | expect.maybe | ({"model"} if expect.unknown_model else set())
    ex.check(suspects, "refused a body the oracle judged correct")
    param = error["param"] or ""
    top = param.split(".", 1)[0].split("[", 1)[0]
    named = top in suspects or any(re.search(rf"(?<![\w.]){re.escape(s)}(?!\w)", error["message"]) for s in suspects)
    ex.check(named, f"the error names none of the suspect fields {sorted(suspects)}")
    media = re.fullmatch(r"messages\[(\d+)\]\.content\[(\d+)\](\.(image_url|video_url|video))?([.[].+)?", param)
    if media is not None and media[3] and not over_count(ex.body, media[4]):
        # an image's or video's own field (not the first one over the count): a part the oracle suspects
        try:
            part = ex.body["messages"][int(media[1])]["content"][int(media[2])]
        except (IndexError, KeyError, TypeError):
            ex.fail(f"the error names {param}, which the body does not have")
        ex.check(part_verdict(part, decoded=ex.route != TOKENIZE)[0] != V.OK,
                 f"the error names {param}, a part the oracle judged correct")
    image = re.fullmatch(r"input\[(\d+)\]\.content\[(\d+)\]\.image_url", param)
    items = ex.body.get("input")
    images = sum(p.get("type") == "input_image" for p in content_parts(items))
    if image is not None and images <= MAX_IMAGES:  # over the count, the first image beyond it is named
        try:
            part = ex.body["input"][int(image[1])]["content"][int(image[2])]
        except (IndexError, KeyError, TypeError):
            ex.fail(f"the error names {param}, which the body does not have")
        ex.check(responses_part_verdict(part)[0] != V.OK,
                 f"the error names {param}, an image part the oracle judged correct")


def over_count(body: dict, field: str) -> bool:
    """The conversation holds more image parts (``field`` image_url) or video parts than the server takes: the
    error then names the first part over the limit, itself correct."""
    if field == "image_url":
        return sum(p.get("type") == "image_url" for p in content_parts(body.get("messages"))) > MAX_IMAGES
    return num_videos(body) > MAX_VIDEOS


def check_timings(ex: Exchange, usage: dict) -> None:
    ex.check(usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], "usage does not add up")
    ex.check(usage["prompt_tokens"] > 0 and usage["completion_tokens"] >= 0, "usage counts out of range")
    timings = usage.get("firsttoken") or {}
    for key, value in timings.items():
        if key.endswith("_s") and value is not None:
            ex.check(isinstance(value, (int, float)) and value >= 0, f"usage.firsttoken.{key} = {value} is negative")
    ttft, e2e = timings.get("ttft_s"), timings.get("e2e_s")
    if CHECK_TTFT_WITHIN_E2E and ttft is not None and e2e is not None:
        ex.check(ttft <= e2e, f"usage.firsttoken.ttft_s {ttft} > e2e_s {e2e}")


def check_generation(ex: Exchange, body: dict, room: int | None, usage: dict, finishes: list[str | None],
                     logprobs_seen: int | None) -> None:
    """What any 2xx generation must show: counts within the request's limits (per choice), the stop rule kept."""
    check_timings(ex, usage)
    choices = num_choices(ex.route, body)
    ex.check(len(finishes) == choices, f"{len(finishes)} finish reasons for {choices} choices")
    ex.check(all(f in ("stop", "length") for f in finishes), f"finish_reasons {finishes!r}")
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or room
    if isinstance(limit, int) and limit > 0:
        ex.check(usage["completion_tokens"] <= limit * choices,
                 f"{usage['completion_tokens']} tokens over the limit {limit} x {choices} choices")
        stops = body.get("stop") or body.get("stop_token_ids")
        if lax_true(body.get("ignore_eos")) and not stops:
            ex.check(set(finishes) == {"length"} and usage["completion_tokens"] == limit * choices,
                     "ignore_eos without stops ended before its max_tokens")
    if room is not None:
        ex.check(usage["prompt_tokens"] == MAX_MODEL_LEN - room, "prompt_tokens differ from /tokenize's count")
    if logprobs_seen is not None:
        ex.check(logprobs_seen == usage["completion_tokens"],
                 f"logprobs for {logprobs_seen} tokens, {usage['completion_tokens']} generated")
    timings = usage.get("firsttoken") or {}
    if not num_videos(body):  # a video is one vision item per grid
        unique = {json.dumps(p, sort_keys=True) for p in content_parts(body.get("messages"))
                  if p.get("type") == "image_url"}  # (url, detail, budget)
        vision = (timings.get("images_encoded") or 0) + (timings.get("encoder_cache_hits") or 0)
        ex.check(vision <= len(unique), f"{vision} images encoded or cache hits for {len(unique)} distinct image parts")


def wants_logprobs(route: str, body: dict) -> bool:
    return lax_true(body.get("logprobs")) if route == CHAT else body.get("logprobs") is not None


def check_plain(ex: Exchange, body: dict, room: int | None) -> None:
    payload = ex.response.json()
    ex.check(payload.get("object") == ("chat.completion" if ex.route == CHAT else "text_completion"), "wrong object")
    choices = payload["choices"]
    ex.check([c["index"] for c in choices] == list(range(num_choices(ex.route, body))), "choices' indexes")
    logprobs = 0 if wants_logprobs(ex.route, body) else None
    for choice in choices:
        text = choice["message"]["content"] if ex.route == CHAT else choice["text"]
        ex.check(isinstance(text, str), "no text")
        if logprobs is not None:
            lp = choice.get("logprobs") or {}
            logprobs += len(lp.get("content") or []) if ex.route == CHAT else len(lp.get("tokens") or [])
    check_generation(ex, body, room, payload["usage"], [c["finish_reason"] for c in choices], logprobs)


def sse_events(ex: Exchange) -> list[dict]:
    """The stream's events as JSON objects, [DONE] (checked to end it) left out."""
    text = ex.response.text
    ex.check(ex.response.headers.get("content-type", "").startswith("text/event-stream"), "stream is not SSE")
    ex.check(text.endswith("data: [DONE]\n\n"), "stream does not end with data: [DONE]")
    events = text[: -len("\n\n")].split("\n\n")
    ex.check(all(e.startswith("data: ") and "\n" not in e for e in events), "an event is not one data: line")
    ex.check([e for e in events if e == "data: [DONE]"] == [events[-1]], "[DONE] is not last, or repeated")
    chunks = []
    for e in events[:-1]:
        try:
            chunks.append(json.loads(e[len("data: "):]))
        except ValueError:
            ex.fail(f"an event is not JSON: {e[:200]!r}")
    ex.check(all(isinstance(c, dict) for c in chunks), "an event is not a JSON object")
    return chunks


def check_stream(ex: Exchange, body: dict, room: int | None, expect: Expect) -> None:
    chunks = sse_events(ex)
    errors = [c for c in chunks if "error" in c]
    if errors:
        ex.check(len(errors) == 1 and chunks[-1] is errors[0], "an error event is not the stream's last")
        error = errors[0]
        ex.check(400 <= error["error"]["code"] < 500, "a stream failed with a 5xx error event")
        check_error(ex, error, error["error"]["code"], expect)
        return
    ex.check(expect.may_succeed, "a body with a wrong field was streamed")
    obj = "chat.completion.chunk" if ex.route == CHAT else "text_completion"
    ex.check(all(c["object"] == obj for c in chunks) and len({c["id"] for c in chunks}) == 1, "mixed chunk heads")
    options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    include_usage = lax_true(options.get("include_usage"))
    continuous = include_usage and lax_true(options.get("continuous_usage_stats"))
    usages = [c for c in chunks if "usage" in c and not c["choices"]]
    ex.check(len(usages) == (1 if include_usage else 0), f"{len(usages)} usage chunks, include_usage={include_usage}")
    running = [c for c in chunks if "usage" in c and c["choices"]]
    ex.check(continuous or not running, "usage on token chunks without continuous_usage_stats")
    ex.check(all(c["usage"]["completion_tokens"] >= 0 for c in running), "a running usage is negative")
    count = num_choices(ex.route, body)
    finishes = {}
    for c in chunks:
        for ch in c["choices"]:
            if ch.get("finish_reason"):
                ex.check(ch["index"] not in finishes, f"choice {ch['index']}'s finish_reason sent twice")
                finishes[ch["index"]] = ch["finish_reason"]
    ex.check(sorted(finishes) == list(range(count)), f"finish reasons for choices {sorted(finishes)} of {count}")
    if ex.route == CHAT:
        roles = [ch["index"] for c in chunks[:count] for ch in c["choices"] if ch["delta"].get("role") == "assistant"]
        ex.check(roles == list(range(count)), "the first chunks do not carry each choice's role")
    if usages:
        ex.check(usages[0] is chunks[-1] and usages[0]["choices"] == [], "usage chunk is not last, or has choices")
        logprobs = None
        if wants_logprobs(ex.route, body):
            logprobs = sum(len((ch.get("logprobs") or {}).get("content" if ex.route == CHAT else "tokens") or [])
                           for c in chunks for ch in c["choices"])
        check_generation(ex, body, room, usages[0]["usage"], [finishes[i] for i in sorted(finishes)], logprobs)


def responses_usage(ex: Exchange, response: dict) -> tuple[dict, str]:
    """A Response's usage in chat's terms (for check_generation), and its finish reason."""
    ex.check(response.get("object") == "response" and str(response.get("id", "")).startswith("resp_"), "wrong object")
    ex.check(response.get("status") in ("completed", "incomplete"), f"status {response.get('status')!r}")
    incomplete = response["status"] == "incomplete"
    ex.check((response.get("incomplete_details") or {}).get("reason") == ("max_output_tokens" if incomplete else None),
             "incomplete_details do not match the status")
    usage = response["usage"]
    ex.check(usage["input_tokens_details"]["cached_tokens"] >= 0, "cached_tokens out of range")
    return ({"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"],
             "total_tokens": usage["total_tokens"], "firsttoken": usage.get("firsttoken")},
            "length" if incomplete else "stop")


def as_chat_body(body: dict) -> dict:
    return {"messages": as_chat_messages(body), "max_tokens": body.get("max_output_tokens")}


def check_responses_plain(ex: Exchange, body: dict, room: int | None) -> None:
    payload = ex.response.json()
    ex.check(len(payload["output"]) == 1 and payload["output"][0]["type"] == "message", "output is not one message")
    content = payload["output"][0]["content"]
    ex.check(len(content) == 1 and isinstance(content[0].get("text"), str), "the message holds no one text")
    usage, finish = responses_usage(ex, payload)
    check_generation(ex, as_chat_body(body), room, usage, [finish], None)


HEAD = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def check_responses_stream(ex: Exchange, body: dict, room: int | None, expect: Expect) -> None:
    text = ex.response.text
    ex.check(text.endswith("\n\n"), "the stream does not end with a blank line")
    events = []
    for frame in text[:-2].split("\n\n"):
        lines = frame.split("\n")
        ex.check(len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "),
                 f"a frame is not an event: and a data: line: {frame[:200]!r}")
        try:
            events.append(json.loads(lines[1][len("data: "):]))
        except ValueError:
            ex.fail(f"an event is not JSON: {frame[:200]!r}")
        ex.check(events[-1].get("type") == lines[0][len("event: "):], "event: and data.type differ")
    ex.check([e["sequence_number"] for e in events] == list(range(len(events))), "sequence numbers")
    kinds = [e["type"] for e in events]
    if "error" in kinds:
        ex.check(kinds.index("error") == len(kinds) - 1, "an error event is not the stream's last")
        error = events[-1]["error"]
        ex.check(400 <= error["code"] < 500, "a stream failed with a 5xx error event")
        check_error(ex, {"error": error}, error["code"], expect)
        return
    ex.check(expect.may_succeed, "a body with a wrong field was streamed")
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    ex.check(kinds[:4] == HEAD and kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
             and kinds[4 + len(deltas):-1] == TAIL and kinds[-1] in ("response.completed", "response.incomplete"),
             f"events out of order: {kinds[:6]} ... {kinds[-5:]}")
    final = events[-1]["response"]
    ex.check(final["output"][0]["content"][0]["text"] == "".join(deltas) == events[-4]["text"],
             "the deltas do not make the final text")
    ex.check(kinds[-1] == ("response.completed" if final["status"] == "completed" else "response.incomplete"),
             "the last event does not match the status")
    usage, finish = responses_usage(ex, final)
    check_generation(ex, as_chat_body(body), room, usage, [finish], None)


def check_tokenize(ex: Exchange, body: dict) -> None:
    payload = ex.response.json()
    ex.check(payload["count"] == len(payload["tokens"]), "count differs from the token list")
    vision = sum(item["num_tokens"] for item in payload["images"] + payload.get("videos", []))
    ex.check(payload["num_text_tokens"] + vision == payload["count"], "text + image + video tokens differ from count")
    ex.check(payload["max_model_len"] == MAX_MODEL_LEN, "max_model_len")
    if lax_true(body.get("return_token_strs")):
        ex.check(len(payload["token_strs"]) == payload["count"], "token_strs differ from the tokens")


def leftovers(fz: Fuzzed) -> list[str]:
    """What the server still holds for requests that have all been answered (empty when it is idle)."""
    engine = fz.live.engine  # AsyncEngine
    core = engine.engine
    sched, runner = core.scheduler, core.executor.runner
    stats = fz.live.stats()
    out = [f"{k}={stats[k]}" for k in ("kv_blocks_used", "num_running", "num_waiting") if stats[k]]
    pins = {h: sorted(users) for h, users in list(sched.encoder_cache._users.items())}
    out += [f"engine requests {sorted(core.requests)}"] if core.requests else []
    out += [f"scheduler running {len(sched.running)} waiting {len(sched.waiting)}"] if sched.has_work else []
    out += ["runner state not yet released (finished requests, encoder outputs)"] if sched.needs_step else []
    out += [f"runner request state {sorted(runner.requests)}"] if runner.requests else []
    out += [f"half-done encodes {sorted(runner._encode_jobs)}"] if runner._encode_jobs else []
    out += [f"encoder-cache pins {pins}"] if pins else []
    stray = [h for h in list(runner.encoder_outputs) if not sched.encoder_cache.contains(h)]
    out += [f"image embeddings the encoder cache forgot {stray}"] if stray else []
    out += [f"streams in flight {engine.num_in_flight}"] if engine.num_in_flight else []
    out += [f"admission reservations {sorted(engine._reservations)}"] if engine._reservations else []
    out += [f"request slots in use {fz.app.state.slots.in_use}"] if fz.app.state.slots.in_use else []
    out += ["the engine is not alive"] if not engine.is_alive else []
    return out


def check_settled(fz: Fuzzed, ex: Exchange) -> None:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        try:
            left = leftovers(fz)
        except RuntimeError:  # a dict changed size while the engine thread finished its last step: look again
            left = ["(engine state changing)"]
        if not left:
            break
        if time.monotonic() > deadline:
            ex.fail(f"the server did not settle after the answer: {left}")
        time.sleep(0.01)
    fz.live.engine.engine.scheduler.check_invariants()
    ex.check(fz.http.get("/health").status_code == 200, "/health is not 200 after the answer")


def param_of(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return "(not an OpenAI error body)"


def exchange(fz: Fuzzed, route: str, drawn: dict | bytes) -> None:
    body, count = resolve(fz, route, drawn)
    ex = Exchange(route, body)
    expect = judge_responses(body, count) if route == RESPONSES else judge(route, body, count)
    try:
        ex.response = post(fz, route, body)
    except httpx.TimeoutException:
        ex.fail(f"no answer within {REQUEST_TIMEOUT_S:g} s")
    status = ex.response.status_code
    if currently_in_test_context():  # --hypothesis-show-statistics: what the examples were answered
        event(f"{status}" if status < 400 else f"{status} naming {param_of(ex.response)}")
        if status == 200 and isinstance(body, dict):
            sent = as_chat_body(body) if route == RESPONSES else body
            event(f"200 with {len(image_urls(sent))} images, {num_videos(sent)} videos"
                  + (", streamed" if lax_true(body.get("stream")) else ""))
    ex.check(status < 500, "a 5xx")
    ex.check(200 <= status < 300 or 400 <= status < 500, "neither a 2xx nor a 4xx")
    if status >= 400:
        ex.check(not expect.must_succeed, "refused a body the oracle judged correct")
        ex.check(ex.response.headers.get("content-type", "").startswith("application/json"), "error is not JSON")
        check_error(ex, ex.response.json(), status, expect)
    elif route == TOKENIZE:
        ex.check(expect.may_succeed, "accepted a body with a wrong field")
        check_tokenize(ex, body)
    elif ex.response.headers.get("content-type", "").startswith("text/event-stream"):
        ex.check(lax_true(body.get("stream")), "a stream for stream: false")
        room = None if count is None else MAX_MODEL_LEN - count
        if route == RESPONSES:
            check_responses_stream(ex, body, room, expect)
        else:
            check_stream(ex, body, room, expect)
    else:
        ex.check(expect.may_succeed, "accepted a body with a wrong field")
        ex.check(not lax_true(body.get("stream")), "no stream for stream: true")
        room = None if count is None else MAX_MODEL_LEN - count
        if route == RESPONSES:
            check_responses_plain(ex, body, room)
        else:
            check_plain(ex, body, room)
    check_settled(fz, ex)


# ------------------------------------------------------------------------------------------- the properties


def test_every_spec_names_a_field_of_its_schema() -> None:
    """The hand-written specs follow the schemas: a renamed field must not leave its edges fuzzing nothing."""
    for specs, schema in ((CHAT_SPECS, CHAT_SCHEMA), (COMPLETION_SPECS, COMPLETION_SCHEMA),
                          (TOKENIZE_SPECS, TOKENIZE_SCHEMA), (RESPONSES_SPECS, RESPONSES_SCHEMA)):
        assert set(specs) <= set(schema["properties"]), set(specs) - set(schema["properties"])
    assert {name for name, _, _ in UNSUPPORTED_EDGES} <= set(UNSUPPORTED_FIELDS)
    assert {name for name, _, _ in RESPONSES_UNSUPPORTED_EDGES} <= set(RESPONSES_UNSUPPORTED)


AT_THE_LIMIT = {"model": MODEL, "prompt": "a", "max_tokens": AtRoom(0), "ignore_eos": True}


@fuzz_settings(max_examples=90)
@given(body=chat_bodies())
@example(body={"model": MODEL, "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": IMAGE_CATALOG["1x1 png"][0]}},
    {"type": "image_url", "image_url": {"url": IMAGE_CATALOG["128x98 png (= the pixel limit)"][0]}},
    {"type": "image_url", "image_url": {"url": IMAGE_CATALOG["1x1 png"][0]}}]}],
    "max_completion_tokens": AtRoom(0), "stream": True, "stream_options": {"include_usage": True}})
def test_chat_completions_answer_every_body_well(fuzzed: Fuzzed, body: dict | bytes) -> None:
    exchange(fuzzed, CHAT, body)


@fuzz_settings(max_examples=60)
@given(body=completion_bodies())
@example(body=AT_THE_LIMIT)
@example(body={**AT_THE_LIMIT, "max_tokens": AtRoom(1)})
def test_completions_answer_every_body_well(fuzzed: Fuzzed, body: dict | bytes) -> None:
    exchange(fuzzed, COMPLETIONS, body)


@fuzz_settings(max_examples=50)
@given(body=tokenize_bodies())
def test_tokenize_answers_every_body_well(fuzzed: Fuzzed, body: dict | bytes) -> None:
    exchange(fuzzed, TOKENIZE, body)


@fuzz_settings(max_examples=50)
@given(body=responses_bodies())
@example(body={"model": MODEL, "instructions": "Look.", "input": [{"role": "user", "content": [
    {"type": "input_image", "image_url": IMAGE_CATALOG["1x1 png"][0]},
    {"type": "input_image", "image_url": IMAGE_CATALOG["128x98 png (= the pixel limit)"][0], "detail": "low"},
    {"type": "input_text", "text": "and?"}]}], "max_output_tokens": AtRoom(0), "stream": True})
def test_responses_answer_every_body_well(fuzzed: Fuzzed, body: dict | bytes) -> None:
    exchange(fuzzed, RESPONSES, body)


def test_after_the_fuzz_the_server_answers_and_holds_nothing(fuzzed: Fuzzed) -> None:
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": IMAGE_CATALOG["64x48 jpeg"][0]}}, {"type": "text", "text": "Hi"}]}]}
    exchange(fuzzed, CHAT, body)
    assert fuzzed.live.wait_idle()["kv_blocks_used"] == 0
