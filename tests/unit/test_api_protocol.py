"""The HTTP layer through the official openai client and raw HTTP, with a scripted fake engine injected via
build_app. Fast paths use httpx's ASGI transport; disconnect and concurrency tests run a real uvicorn."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from PIL import Image

from firsttoken.api.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    StreamFrames,
)
from firsttoken.api.server import build_app
from firsttoken.api.settings import ServedModel
from firsttoken.config import GenerationDefaults, ServerConfig
from firsttoken.inputs.processor import InputProcessor
from firsttoken.inputs.prompt import TextPrompt
from firsttoken.models.registry import load_model_config
from firsttoken.types import FinishReason
from tests.conftest import VLLM_FIXTURES

from .fake_engine import FakeEngine, Script

FIXTURES = VLLM_FIXTURES
MODEL = "qwen2vl"  # the fixtures' served name, so error bodies compare byte for byte
MAX_MODEL_LEN = 4096
from tests.helpers import make_processor

# ------------------------------------------------------------------------------------------- harness


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> InputProcessor:
    return make_processor(tiny_model_dir, MAX_MODEL_LEN)


def app_of(engine, processor: InputProcessor, **overrides):
    """build_app with the test model; ``overrides`` are ServerConfig fields, or ``model_root``, or
    ``engine_config`` (what GET /v1/engine/config serves)."""
    root = overrides.pop("model_root", None)
    engine_config = overrides.pop("engine_config", None)
    return build_app(engine, processor, ServedModel(MODEL, MAX_MODEL_LEN, root, engine_config),
                     ServerConfig(**overrides))


def fixture(name: str) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of a recorded vLLM exchange."""
    head, _, body = (FIXTURES / name).read_text().partition("\n\n")
    status_line, *header_lines = head.splitlines()
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, body


def fixture_request(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.request.json").read_text())["body"]


def asgi_client(engine: FakeEngine, processor: InputProcessor, **overrides) -> httpx.AsyncClient:
    app = app_of(engine, processor, **overrides)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def openai_client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)


def run(coro):
    return asyncio.run(coro)


def sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


def png_url(width: int = 64, height: int = 48) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGE_MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": png_url()}},
            {"type": "text", "text": "What is in this picture?"},
        ],
    }
]


@contextlib.contextmanager
def live_server(
    engine: FakeEngine, processor: InputProcessor, uvicorn_options: dict | None = None, **overrides
) -> Iterator[str]:
    """A real uvicorn on a loopback port; ``overrides`` go to ServerSettings, ``uvicorn_options`` to its Config."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = app_of(engine, processor, **overrides)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **(uvicorn_options or {}))
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# ------------------------------------------------------------------------------------------- happy paths


def test_chat_completion_through_the_openai_client(processor: InputProcessor) -> None:
    engine = FakeEngine()

    async def go():
        async with asgi_client(engine, processor) as http:
            raw = await openai_client(http).chat.completions.with_raw_response.create(
                model=MODEL,
                messages=IMAGE_MESSAGES,
                max_tokens=6,
                temperature=0,
                extra_headers={"X-Request-Id": "my-req-1"},
            )
            return raw.headers, raw.parse()

    headers, resp = run(go())
    assert headers["x-request-id"] == "my-req-1"
    choice = resp.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "ax" * 6, "length")
    (request,) = engine.requests
    assert resp.usage.prompt_tokens == request.num_prompt_tokens and resp.usage.completion_tokens == 6
    assert resp.usage.total_tokens == request.num_prompt_tokens + 6
    timings = resp.usage.model_extra["firsttoken"]
    assert timings["ttft_s"] is not None and {"preprocess_s", "queue_s", "prefill_s", "send_s"} <= set(timings)
    assert request.images[0].num_tokens == 4 and request.sampling.max_tokens == 6 and request.sampling.temperature == 0


def test_chat_response_has_the_fixture_shape(processor: InputProcessor) -> None:
    _, _, body = fixture("chat-image.txt")
    theirs = json.loads(body)

    async def go():
        async with asgi_client(FakeEngine(), processor) as http:
            return (await http.post("/v1/chat/completions", json=fixture_request("chat-image.txt"))).json()

    ours = run(go())
    assert ours["object"] == theirs["object"] and ours["id"].startswith("chatcmpl-")
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(ours) & set(theirs)
    assert {"index", "message", "logprobs", "finish_reason"} <= set(ours["choices"][0])
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"] == "axaxaxaxaxax"
    assert set(theirs["usage"]) - {"completion_tokens_details"} <= set(ours["usage"])


def test_stream_framing_matches_vllm(processor: InputProcessor) -> None:
    engine = FakeEngine()
    _, their_headers, their_body = fixture("chat-stream-image.txt")
    theirs = sse_events(their_body)

    async def go():
        async with asgi_client(engine, processor) as http:
            r = await http.post("/v1/chat/completions", json=fixture_request("chat-stream-image.txt"))
            return r.headers, r.text

    headers, body = run(go())
    assert headers["content-type"].split(";")[0] == their_headers["content-type"].split(";")[0] == "text/event-stream"
    ours = sse_events(body)
    assert len(ours) == len(theirs) and ours[-1] == theirs[-1] == "[DONE]"
    o, t = [json.loads(e) for e in ours[:-1]], [json.loads(e) for e in theirs[:-1]]
    assert o[0]["choices"][0]["delta"] == t[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for mine, vllm in zip(o[1:-1], t[1:-1]):
        assert mine["choices"][0]["delta"] == vllm["choices"][0]["delta"]
        assert mine["choices"][0]["finish_reason"] == vllm["choices"][0]["finish_reason"]
        assert mine["object"] == vllm["object"] == "chat.completion.chunk"
        assert {"id", "object", "created", "model", "choices"} <= set(mine)
    assert "usage" not in o[1]  # only the usage chunk carries usage
    assert o[-1]["choices"] == t[-1]["choices"] == []
    assert set(t[-1]["usage"]) <= set(o[-1]["usage"]) and "firsttoken" in o[-1]["usage"]
    assert o[-1]["usage"]["completion_tokens"] == t[-1]["usage"]["completion_tokens"] == 6
    assert len({c["id"] for c in o}) == 1 and len({c["created"] for c in o}) == 1
    timings = o[-1]["usage"]["firsttoken"]  # the timeline the API assembled: the first byte came after the token
    phases = ("preprocess", "queue", "encode", "prefill", "sample", "send")
    assert timings["send_s"] >= 0 and abs(sum(timings[f"{p}_s"] for p in phases) - timings["ttft_s"]) < 1e-9


@pytest.mark.parametrize("text", ["", "Hi", ' "quoted"\\ and\nnew line\t', "naïve 汉字 🙂", "\x00\x1f\u2028"])
@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_stream_frames_are_the_response_models_bytes(text: str, finish: str | None) -> None:
    """The streaming fast path renders chunks without pydantic; a client must not see one byte of difference."""
    rid, created, model = 'chatcmpl-"x"\u00e9', 1_700_000_000, "m/ödel"
    chat = StreamFrames("chat.completion.chunk", rid, created, model)
    content = text or None

    def chat_model(delta: DeltaMessage) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish)
        return "data: " + ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice]).to_json() + "\n\n"

    assert chat.chat(content, finish) == chat_model(DeltaMessage(content=content))
    assert chat.chat(text, finish, role=True) == chat_model(DeltaMessage(role="assistant", content=text))
    completion = StreamFrames("text_completion", rid, created, model)
    choice = CompletionChoice(text=text, finish_reason=finish)
    body = CompletionResponse(id=rid, created=created, model=model, choices=[choice]).to_json()
    assert completion.completion(text, finish) == "data: " + body + "\n\n"


def test_stream_through_the_openai_client(processor: InputProcessor) -> None:
    async def go():
        async with asgi_client(
            FakeEngine(Script(pieces=("Hel", "lo", " 😀"), finish_reason=FinishReason.STOP)), processor
        ) as http:
            stream = await openai_client(http).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            return [chunk async for chunk in stream]

    chunks = run(go())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello 😀"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 3


def test_stream_without_include_usage_has_no_usage_chunk(processor: InputProcessor) -> None:
    async def go():
        async with asgi_client(FakeEngine(), processor) as http:
            r = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
            )
            return r.text

    events = sse_events(run(go()))
    assert events[-1] == "[DONE]" and all("usage" not in json.loads(e) for e in events[:-1])
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_completions_stream_and_non_stream(processor: InputProcessor) -> None:
    async def go():
        async with asgi_client(FakeEngine(Script(pieces=("a", "b"))), processor) as http:
            client = openai_client(http)
            full = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2)
            stream = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2, stream=True)
            return full, [c async for c in stream]

    full, chunks = run(go())
    assert full.object == "text_completion" and full.choices[0].text == "ab" and full.usage.completion_tokens == 2
    assert "".join(c.choices[0].text for c in chunks) == "ab" and chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_are_reported_with_token_text(processor: InputProcessor) -> None:
    token_id = processor.tokenizer.encode("hello", add_special_tokens=False)[0]

    async def go():
        engine = FakeEngine(Script(pieces=("x",), logprobs=True, token_id=token_id))
        async with asgi_client(engine, processor) as http:
            return await openai_client(http).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2
            ), engine

    resp, engine = run(go())
    (entry,) = resp.choices[0].logprobs.content
    assert entry.token == processor.tokenizer.decode([token_id]) and entry.logprob == -0.5
    assert [t.logprob for t in entry.top_logprobs] == [-0.5, -1.5]
    assert engine.requests[0].sampling.top_logprobs == 2


def test_models_tokenize_health_stats(processor: InputProcessor) -> None:
    _, _, models_body = fixture("models.txt")
    _, _, tokenize_body = fixture("tokenize-image.txt")

    async def go():
        async with asgi_client(FakeEngine(), processor, model_root="/models/tiny") as http:
            models = (await openai_client(http).models.list()).data
            raw_models = (await http.get("/v1/models")).json()
            tok = (await http.post("/tokenize", json=fixture_request("tokenize-image.txt"))).json()
            tok_prompt = (
                await http.post("/tokenize", json={"prompt": "hello <|image_pad|>", "return_token_strs": True})
            ).json()
            health = await http.get("/health")
            stats = (await http.get("/v1/engine/stats")).json()
            return models, raw_models, tok, tok_prompt, health, stats

    models, raw_models, tok, tok_prompt, health, stats = run(go())
    assert [m.id for m in models] == [MODEL]
    their_card = json.loads(models_body)["data"][0]
    assert set(raw_models["data"][0]) >= set(their_card) - {"permission"}
    assert raw_models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert set(tok) >= set(json.loads(tokenize_body))
    assert tok["count"] == len(tok["tokens"]) == tok["num_text_tokens"] + 4
    assert tok["images"] == [{"original_size": [64, 48], "resized_size": [56, 56], "num_tokens": 4, "budget_tokens": 1280,
                             "tile_grid": None, "num_tiles": None}]
    assert "".join(tok_prompt["token_strs"]) == "hello <|image_pad|>" and tok_prompt["images"] == []
    assert health.status_code == 200 and health.headers["x-request-id"]
    assert stats["kv_blocks_cached"] == 3 and {"kv_blocks_used", "kv_blocks_free", "num_running", "num_waiting"} <= set(
        stats
    )


def test_engine_config_is_what_the_engine_was_resolved_with(processor: InputProcessor) -> None:
    """GET /v1/engine/config serves the resolved configuration the server was built with, as JSON; an app that
    fronts no single engine (none given) answers 404 in the OpenAI error shape."""
    resolved = {"model": {"dtype": "float32", "quantization": "bf16", "fused_decode": None},
                "num_threads": 2, "kv": {"num_blocks": 64, "num_tokens": 1024}}

    async def go(engine_config):
        async with asgi_client(FakeEngine(), processor, engine_config=engine_config) as http:
            return await http.get("/v1/engine/config")

    served, none = run(go(resolved)), run(go(None))
    assert served.status_code == 200 and served.json() == resolved
    assert none.status_code == 404 and "single engine" in none.json()["error"]["message"]


class ThreadRecordingProcessor(InputProcessor):
    """Records which thread preprocessing ran on (a subclass injected through build_app, no patching)."""

    threads: list[int]

    def draft(self, prompt, sampling):
        self.threads.append(threading.get_ident())
        return super().draft(prompt, sampling)


def test_preprocessing_runs_off_the_event_loop(tiny_model_dir: Path) -> None:
    proc = ThreadRecordingProcessor(
        tiny_model_dir, load_model_config(tiny_model_dir), GenerationDefaults(), max_model_len=MAX_MODEL_LEN
    )
    proc.threads = []

    async def go():
        async with asgi_client(FakeEngine(), proc) as http:
            await http.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            )
        return threading.get_ident()

    loop_thread = run(go())
    assert proc.threads and proc.threads[0] != loop_thread


# ------------------------------------------------------------------------------------------- errors


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and r.headers.get("x-request-id")
    return body["error"]


def post(processor: InputProcessor, path: str, engine: FakeEngine | None = None, **kwargs) -> httpx.Response:
    async def go():
        async with asgi_client(engine or FakeEngine(), processor, **kwargs.pop("server", {})) as http:
            return await http.post(path, **kwargs)

    return run(go())


def test_unknown_model_is_vllm_404_byte_for_byte(processor: InputProcessor) -> None:
    status, _, body = fixture("error-unknown-model.txt")
    r = post(processor, "/v1/chat/completions", json=fixture_request("error-unknown-model.txt"))
    assert r.status_code == status == 404 and r.json() == json.loads(body)


def test_bad_max_tokens_matches_vllm(processor: InputProcessor) -> None:
    _, _, body = fixture("error-bad-max-tokens.txt")
    theirs = json.loads(body)["error"]
    ours = error_of(post(processor, "/v1/chat/completions", json=fixture_request("error-bad-max-tokens.txt")), 400)
    assert (ours["type"], ours["param"], ours["code"]) == (theirs["type"], theirs["param"], theirs["code"])
    assert ours["message"].startswith("max_tokens must be at least 1, got -1")


def test_malformed_json_is_400_not_422(processor: InputProcessor) -> None:
    err = error_of(
        post(
            processor,
            "/v1/chat/completions",
            content=b'{"model": "qwen2vl", "messages": [SECRET',
            headers={"content-type": "application/json"},
        ),
        400,
    )
    assert err["type"] == "BadRequestError" and "SECRET" not in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "SECRET"}, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text",
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 9}, "temperature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999}, "max_tokens"),
    ],
)
def test_schema_and_value_errors_name_the_field(processor: InputProcessor, body: dict, param: str) -> None:
    err = error_of(post(processor, "/v1/chat/completions", json=body), 400)
    assert err["param"] == param and "SECRET" not in err["message"]


def test_unknown_fields_are_tolerated(processor: InputProcessor) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi", "name": "bob"}],
        "user": "u1",
        "vendor_x": {"a": 1},
    }
    assert post(processor, "/v1/chat/completions", json=body).status_code == 200


def test_bad_image_is_400_through_the_openai_client(processor: InputProcessor) -> None:
    async def go():
        async with asgi_client(FakeEngine(), processor) as http:
            await openai_client(http).chat.completions.create(
                model=MODEL,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
                        ],
                    }
                ],
            )

    with pytest.raises(openai.BadRequestError) as err:
        run(go())
    assert err.value.status_code == 400 and "invalid image" in err.value.message and "bm90" not in err.value.message


def test_a_bad_image_among_several_is_the_error_param(processor: InputProcessor) -> None:
    good = {"type": "image_url", "image_url": {"url": png_url(8, 8)}}
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [good, bad]}]}
    err = error_of(post(processor, "/v1/chat/completions", json=body), 400)
    assert err["param"] == "messages[1].content[1].image_url"
    assert err["message"].startswith("invalid image (invalid_image): image 2 of 2: ")


def test_body_too_large_is_413(processor: InputProcessor) -> None:
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    err = error_of(post(processor, "/v1/chat/completions", json=big, server={"max_request_bytes": 1000}), 413)
    assert err["type"] == "RequestTooLargeError"

    async def chunks():
        yield json.dumps(big).encode()

    chunked = post(
        processor,
        "/v1/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        server={"max_request_bytes": 1000},
    )
    error_of(chunked, 413)


def test_dead_engine_is_503(processor: InputProcessor) -> None:
    engine = FakeEngine(alive=False)
    error_of(
        post(
            processor,
            "/v1/chat/completions",
            engine,
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        ),
        503,
    )

    async def go():
        async with asgi_client(engine, processor) as http:
            return await http.get("/health")

    error_of(run(go()), 503)


def test_unexpected_exception_is_a_generic_500(processor: InputProcessor, caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine(Script(raise_error=RuntimeError("secret detail at 0x7f3a2b1c")))
    r = post(
        processor,
        "/v1/chat/completions",
        engine,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    err = error_of(r, 500)
    assert err["type"] == "InternalServerError"
    assert not re.search(r"secret|0x[0-9a-f]+|Traceback|File \"", err["message"])
    request_id = engine.requests[0].request_id
    assert request_id in err["message"]  # the handle to find the trace...
    assert "secret detail" in caplog.text and request_id in caplog.text  # ...which stays in the server log


def test_engine_refusing_a_request_is_400_and_a_dead_engine_503(processor: InputProcessor) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    engine = FakeEngine(Script(raise_error=ValueError("prompt of 9 tokens does not fit the KV cache")))
    assert error_of(post(processor, "/v1/chat/completions", engine, json=body), 400)["message"].startswith(
        "prompt of 9"
    )

    class DyingEngine(FakeEngine):
        async def generate(self, request):
            self.alive = False
            raise RuntimeError("engine loop crashed")
            yield

    error_of(post(processor, "/v1/chat/completions", DyingEngine(), json=body), 503)
    events = sse_events(post(processor, "/v1/chat/completions", DyingEngine(), json={**body, "stream": True}).text)
    assert json.loads(events[-2])["error"]["code"] == 503 and events[-1] == "[DONE]"


def test_engine_failure_mid_stream_is_an_error_event(processor: InputProcessor) -> None:
    engine = FakeEngine(Script(pieces=("a", "b"), error="the engine ran out of memory"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    events = sse_events(post(processor, "/v1/chat/completions", engine, json=body).text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == "the engine ran out of memory"
    non_stream = post(processor, "/v1/chat/completions", engine, json={**body, "stream": False})
    assert error_of(non_stream, 500)["message"] == "the engine ran out of memory"


def test_responses_engine_failure_mid_stream_is_one_error_event(processor: InputProcessor) -> None:
    """/v1/responses frames events as ``event:`` + ``data:``; a failure after some text is one ``error`` event that
    the openai client raises on (it carries ``error``, as chat's), with nothing after it."""
    engine = FakeEngine(Script(pieces=("a", "b"), error="the engine ran out of memory"))
    body = {"model": MODEL, "input": "hi", "stream": True}
    text = post(processor, "/v1/responses", engine, json=body).text
    frames = [f.split("\n") for f in text.split("\n\n")[:-1]]
    assert all(len(f) == 2 and f[0].startswith("event: ") and f[1].startswith("data: ") for f in frames)
    events = [json.loads(f[1][len("data: "):]) for f in frames]
    assert [e["type"] for e in events][:4] == ["response.created", "response.in_progress",
                                               "response.output_item.added", "response.content_part.added"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = events[-1]
    assert last["type"] == "error" and last["error"]["message"] == "the engine ran out of memory"
    assert last["message"] == "the engine ran out of memory"
    non_stream = post(processor, "/v1/responses", engine, json={**body, "stream": False})
    assert error_of(non_stream, 500)["message"] == "the engine ran out of memory"


def test_a_prompt_that_can_never_fit_names_each_routes_prompt_field(tiny_model_dir: Path) -> None:
    from firsttoken.types import AdmissionVerdict

    processor = make_processor(tiny_model_dir, MAX_MODEL_LEN)
    engine = FakeEngine(admission=lambda work, request_id: AdmissionVerdict(False, "short", "never_fits", "never fits",
                                                                            400))
    for path, body, param in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                              ("/v1/completions", {"prompt": "hi"}, "prompt"),
                              ("/v1/responses", {"input": "hi"}, "input")):
        assert error_of(post(processor, path, engine, json={"model": MODEL, **body}), 400)["param"] == param


def test_unknown_route_is_404_in_error_shape(processor: InputProcessor) -> None:
    error_of(post(processor, "/v1/nothing", json={}), 404)


# ------------------------------------------------------------------------------------------- disconnects (real server)


def test_disconnect_mid_stream_aborts_the_request(processor: InputProcessor) -> None:
    engine = FakeEngine(Script(pieces=("tok",) * 1000, delay_s=0.01))
    with live_server(engine, processor) as url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.Client(timeout=10) as http, http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            while '"tok"' not in next(lines):
                pass
            assert not engine.abort_called.is_set()
        assert engine.abort_called.wait(5), "engine.abort was not called"
    assert engine.aborted == [engine.requests[0].request_id]


def test_disconnect_while_waiting_for_the_first_token_aborts(processor: InputProcessor) -> None:
    engine = FakeEngine(Script(hang_after=0))
    with live_server(engine, processor) as url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.Client(timeout=10) as http, http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()  # keep it: a dropped httpx line iterator closes the connection
            assert '"role":"assistant"' in next(lines)  # role chunk, then nothing: the request waits
            assert engine.submitted.wait(5)
            time.sleep(0.2)
            assert not engine.abort_called.is_set()  # still connected: nothing aborted yet
        assert engine.abort_called.wait(5), "engine.abort was not called"


def test_non_streaming_client_that_leaves_aborts(processor: InputProcessor) -> None:
    engine = FakeEngine(Script(hang_after=2))
    with live_server(engine, processor) as url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
            http.post(f"{url}/v1/chat/completions", json=body)
        assert engine.abort_called.wait(5), "engine.abort was not called"


def test_requests_over_the_concurrency_cap_get_429(processor: InputProcessor) -> None:
    engine = FakeEngine(Script(hang_after=0))
    with live_server(engine, processor, max_concurrent_requests=1) as url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.Client(timeout=10) as http:
            with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                next(lines)
                refused = http.post(f"{url}/v1/chat/completions", json=body)
                error_of(refused, 429)
                assert refused.headers["retry-after"] == "1"  # as the queue-full 429: clients honour it
            assert engine.abort_called.wait(5)
            engine.script = Script(pieces=("ok",))
            deadline = time.monotonic() + 5  # the slot comes back once the first stream is closed
            while http.post(f"{url}/v1/chat/completions", json={**body, "stream": False}).status_code != 200:
                assert time.monotonic() < deadline, "the concurrency slot was not released"
                time.sleep(0.05)


# ------------------------------------------------------------------------------------------- hardening (issue 12)

CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def raw_post(processor: InputProcessor, content: bytes, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return post(processor, path, content=content, headers=headers, **kw)


def ascii_json(body: dict) -> bytes:
    """JSON as a client library writes it with ensure_ascii: a lone surrogate travels as the escape \\ud800."""
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("content", "headers", "status", "message"),
    [
        (b"", {}, 400, "request body is empty; expected a JSON object"),
        (b"   \n", {}, 400, "request body is empty; expected a JSON object"),
        (b'{"model": "caf\xe9"}', {}, 400, "request body is not valid UTF-8 (invalid byte at offset 14)"),
        (b'{"model": "q", "messages": [', {}, 400, "request body is not valid JSON: Expecting value at line 1"),
        (b"[" * 50_000 + b"]" * 50_000, {}, 400, "nested too deeply: JSON objects and arrays may nest at most 64"),
        (b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}", {}, 400, "nested too deeply"),
        (ascii_json(CHAT_BODY)[:-1] + b', "max_tokens": ' + b"9" * 5000 + b"}", {}, 400,
         "max_tokens: must be an integer within 64 bits, got inf"),  # valid JSON, past every bound: named
        (b"\x1f\x8b\x08\x00", {"content-encoding": "gzip"}, 415, "Content-Encoding 'gzip' is not supported"),
        (b'{"model": "q"}', {"content-encoding": "br"}, 415, "send the body uncompressed"),
        (b'{"model": "q"}', {"transfer-encoding": "chunked"}, 400, "both Content-Length and Transfer-Encoding"),
    ],
    ids=["empty", "blank", "latin-1", "truncated", "deep-50000", "deep-71", "5000-digits", "gzip", "br", "cl+te"],
)
def test_malformed_bodies_say_what_is_wrong(
    processor: InputProcessor, content: bytes, headers: dict, status: int, message: str
) -> None:
    err = error_of(raw_post(processor, content, headers=headers), status)
    assert err["message"].startswith(message) or message in err["message"], err["message"]


def test_a_deep_but_allowed_body_still_parses(processor: InputProcessor) -> None:
    body = {**CHAT_BODY, "metadata": {"a": [[[[[[[[[[1]]]]]]]]]]}, "user": "x"}  # 12 levels: fine
    assert raw_post(processor, ascii_json(body)).status_code == 200


def test_a_body_that_never_ends_gets_408_in_openai_shape(processor: InputProcessor) -> None:
    async def never_ending():
        yield b'{"model": "qwen2vl", '
        await asyncio.Event().wait()  # the terminating chunk never comes

    r = post(processor, "/v1/chat/completions", content=never_ending(), headers={"content-type": "application/json"},
             server={"request_body_timeout_s": 0.2})
    err = error_of(r, 408)
    assert err["type"] == "RequestTimeoutError" and "--request-body-timeout" in err["message"]
    assert r.headers["connection"] == "close"


UNSUPPORTED = [
    ("functions", [{"name": "f"}]),
    ("function_call", {"name": "f"}),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("best_of", 3),
    ("min_tokens", 5),
]


@pytest.mark.parametrize(("name", "value"), UNSUPPORTED, ids=[f"{n}={v!r}"[:40] for n, v in UNSUPPORTED])
def test_unsupported_fields_are_refused_naming_them(processor: InputProcessor, name: str, value: object) -> None:
    err = error_of(post(processor, "/v1/chat/completions", json={**CHAT_BODY, name: value}), 400)
    assert err["param"] == name and err["message"].startswith(f"'{name}'") and "not supported" in err["message"]


def test_a_response_format_of_an_unknown_type_is_refused_naming_it(processor: InputProcessor) -> None:
    for value in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "x"}}, "json"):
        err = error_of(post(processor, "/v1/chat/completions", json={**CHAT_BODY, "response_format": value}), 400)
        assert err["param"] == "response_format", err


def test_unsupported_completion_fields_are_refused(processor: InputProcessor) -> None:
    for name, value in (("suffix", "end"), ("best_of", 2)):
        body = {"model": MODEL, "prompt": "hi", name: value}
        assert error_of(post(processor, "/v1/completions", json=body), 400)["param"] == name


def test_echo_is_a_completions_field_and_refused_on_chat(processor: InputProcessor) -> None:
    err = error_of(post(processor, "/v1/chat/completions", json={**CHAT_BODY, "echo": True}), 400)
    assert err["param"] == "echo" and "/v1/completions only" in err["message"]
    assert post(processor, "/v1/chat/completions", json={**CHAT_BODY, "echo": False}).status_code == 200
    assert post(processor, "/v1/completions", json={"model": MODEL, "prompt": "hi", "echo": True,
                                                    "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("bias", [{"x": 1}, {"5": 101}, {"5": -1e9}, {"16064": 1}, {"-1": 1}, {"5": "much"}])
def test_a_logit_bias_out_of_range_is_refused_naming_it(processor: InputProcessor, bias: dict) -> None:
    err = error_of(post(processor, "/v1/chat/completions", json={**CHAT_BODY, "logit_bias": bias}), 400)
    assert err["param"].split(".")[0] == "logit_bias", err


def test_harmless_extras_and_off_values_are_tolerated(processor: InputProcessor) -> None:
    extras = dict(user="u", metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=True,
                  response_format={"type": "text"}, tools=[], tool_choice="none", functions=None, logit_bias={},
                  modalities=["text"], best_of=1, min_tokens=0, logprobs=None, n=None, echo=False, audio=None)
    assert post(processor, "/v1/chat/completions", json={**CHAT_BODY, **extras}).status_code == 200


SURROGATE = "\ud800"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT_BODY, "model": f"q{SURROGATE}"}, "model"),
        ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": SURROGATE}]},
         "messages[0].content"),
        ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": [
            {"type": "text", "text": f"a{SURROGATE}b"}]}]}, "messages[0].content[0].text"),
        ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"/img/{SURROGATE}.png"}}]}]},
         "messages[0].content[0].image_url.url"),
        ("/v1/chat/completions", {**CHAT_BODY, "stop": ["ok", SURROGATE]}, "stop[1]"),
        ("/v1/completions", {"model": MODEL, "prompt": f"x{SURROGATE}"}, "prompt"),
        ("/tokenize", {"prompt": SURROGATE}, "prompt"),
        ("/tokenize", {"model": SURROGATE, "prompt": "x"}, "model"),
    ],
)
def test_strings_that_are_not_valid_unicode_are_400_naming_the_field(
    processor: InputProcessor, path: str, body: dict, param: str
) -> None:
    err = error_of(raw_post(processor, ascii_json(body), path), 400)
    assert err["param"] == param and "lone UTF-16 surrogate" in err["message"]


def test_an_error_message_holding_unencodable_text_still_renders() -> None:
    from firsttoken.api.errors import error_response

    response = error_response(400, f"bad {SURROGATE} value" + "x" * 5000, param=f"p{SURROGATE}")
    body = json.loads(response.body)["error"]
    assert body["message"].startswith("bad \ufffd value") and len(body["message"]) <= 1000
    assert body["param"] == "p\ufffd"


def test_a_long_unknown_model_is_quoted_not_echoed(processor: InputProcessor) -> None:
    err = error_of(post(processor, "/v1/chat/completions", json={**CHAT_BODY, "model": "m" * 100_000}), 404)
    assert err["param"] == "model" and len(err["message"]) < 160 and "m" * 63 + "…" in err["message"]


def test_an_unknown_part_type_is_quoted_not_echoed(processor: InputProcessor) -> None:
    body = {**CHAT_BODY, "messages": [{"role": "user", "content": [{"type": "t" * 10_000}]}]}
    err = error_of(post(processor, "/v1/chat/completions", json=body), 400)
    assert err["param"] == "messages[0].content[0].type" and len(err["message"]) < 200


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_out_of_range_is_the_same_400_streamed_or_not(processor: InputProcessor, seed: int) -> None:
    engine = FakeEngine()
    plain = error_of(post(processor, "/v1/chat/completions", engine, json={**CHAT_BODY, "seed": seed}), 400)
    streamed = post(processor, "/v1/chat/completions", engine, json={**CHAT_BODY, "seed": seed, "stream": True})
    assert error_of(streamed, 400) == plain and plain["param"] == "seed"
    assert streamed.headers["content-type"].startswith("application/json")  # no stream was opened
    assert engine.requests == []


def test_top_logprobs_over_20_is_refused_for_chat_and_completions(processor: InputProcessor) -> None:
    chat_err = error_of(post(processor, "/v1/chat/completions",
                             json={**CHAT_BODY, "logprobs": True, "top_logprobs": 21}), 400)
    completion_err = error_of(post(processor, "/v1/completions", json={"model": MODEL, "prompt": "a", "logprobs": 21}),
                              400)
    assert (chat_err["param"], completion_err["param"]) == ("top_logprobs", "logprobs")


class BlockingProcessor(InputProcessor):
    """Holds every completions request (the heavy ones below) inside preprocessing until released: a seam for
    'heavy work is in progress' that depends on no timing."""

    def start_holding(self) -> None:
        self.held = threading.Semaphore(0)
        self.release = threading.Event()

    def draft(self, prompt, sampling):
        if isinstance(prompt, TextPrompt):  # completions requests
            self.held.release()
            assert self.release.wait(30)
        return super().draft(prompt, sampling)


def test_a_short_chat_is_answered_while_heavy_requests_hold_every_heavy_thread(tiny_model_dir: Path) -> None:
    proc = BlockingProcessor(tiny_model_dir, load_model_config(tiny_model_dir), GenerationDefaults(),
                             max_model_len=MAX_MODEL_LEN)
    proc.start_holding()
    threads = ServerConfig().num_preprocess_threads
    heavy = {"model": MODEL, "prompt": "long document " * 2000, "max_tokens": 2}  # 28,000 characters: heavy

    async def go():
        async with asgi_client(FakeEngine(), proc) as http:
            pending = [asyncio.ensure_future(http.post("/v1/completions", json=heavy)) for _ in range(threads + 1)]
            for _ in range(threads):  # every heavy thread is now inside a request (one more waits for a thread)
                await asyncio.to_thread(proc.held.acquire, True, 30)
            chat = await http.post("/v1/chat/completions", json=CHAT_BODY)
            still_held = not proc.release.is_set() and not any(p.done() for p in pending)
            proc.release.set()
            heavy_statuses = [r.status_code for r in await asyncio.gather(*pending)]
            return chat.status_code, still_held, heavy_statuses

    chat_status, still_held, heavy_statuses = run(go())
    assert chat_status == 200 and still_held  # answered while every heavy request was still being processed
    assert heavy_statuses == [200] * (threads + 1)
