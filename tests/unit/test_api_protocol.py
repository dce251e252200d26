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

from tests.conftest import VLLM_FIXTURES
import uvicorn
from PIL import Image

from firsttoken.api.server import build_app
from firsttoken.api.settings import ServerSettings
from firsttoken.config import GenerationDefaults
from firsttoken.models.registry import load_model_config
from firsttoken.engine.request import FinishReason
from firsttoken.inputs.processor import ImageSettings, InputProcessor

from .fake_engine import FakeEngine, Script

FIXTURES = VLLM_FIXTURES
MODEL = "qwen2vl"  # the fixtures' served name, so error bodies compare byte for byte
MAX_MODEL_LEN = 4096


# ------------------------------------------------------------------------------------------- harness


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> InputProcessor:
    return InputProcessor(
        tiny_model_dir,
        load_model_config(tiny_model_dir),
        GenerationDefaults.from_pretrained(tiny_model_dir),
        max_model_len=MAX_MODEL_LEN,
        images=ImageSettings(),
    )


def settings(**overrides) -> ServerSettings:
    return ServerSettings(**{"served_model_name": MODEL, "max_model_len": MAX_MODEL_LEN, **overrides})


def fixture(name: str) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of a recorded vLLM exchange."""
    head, _, body = (FIXTURES / name).read_text().partition("\n\n")
    status_line, *header_lines = head.splitlines()
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, body


def fixture_request(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.request.json").read_text())["body"]


def asgi_client(engine: FakeEngine, processor: InputProcessor, **overrides) -> httpx.AsyncClient:
    app = build_app(engine, processor, settings(**overrides))
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
def live_server(engine: FakeEngine, processor: InputProcessor, **overrides) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(engine, processor, settings(**overrides)), host="127.0.0.1", port=port, log_level="warning"
        )
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
    timeline = engine.requests[0].timeline
    assert timeline.first_byte_s is not None and timeline.first_byte_s >= timeline.first_token_s


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
    assert tok["images"] == [{"original_size": [64, 48], "resized_size": [56, 56], "num_tokens": 4, "budget_tokens": 1280}]
    assert "".join(tok_prompt["token_strs"]) == "hello <|image_pad|>" and tok_prompt["images"] == []
    assert health.status_code == 200 and health.headers["x-request-id"]
    assert stats["kv_blocks_cached"] == 3 and {"kv_blocks_used", "kv_blocks_free", "num_running", "num_waiting"} <= set(
        stats
    )


class ThreadRecordingProcessor(InputProcessor):
    """Records which thread preprocessing ran on (a subclass injected through build_app, no patching)."""

    threads: list[int]

    def process_chat(self, req, request_id, timeline):
        self.threads.append(threading.get_ident())
        return super().process_chat(req, request_id, timeline)


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
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
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


def test_body_too_large_is_413(processor: InputProcessor) -> None:
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    err = error_of(post(processor, "/v1/chat/completions", json=big, server={"max_request_body_bytes": 1000}), 413)
    assert err["type"] == "RequestTooLargeError"

    async def chunks():
        yield json.dumps(big).encode()

    chunked = post(
        processor,
        "/v1/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        server={"max_request_body_bytes": 1000},
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
                error_of(http.post(f"{url}/v1/chat/completions", json=body), 429)
            assert engine.abort_called.wait(5)
            engine.script = Script(pieces=("ok",))
            deadline = time.monotonic() + 5  # the slot comes back once the first stream is closed
            while http.post(f"{url}/v1/chat/completions", json={**body, "stream": False}).status_code != 200:
                assert time.monotonic() < deadline, "the concurrency slot was not released"
                time.sleep(0.05)
