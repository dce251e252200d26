"""Refusals the server decides before (or while) it reads a request body reach clients that write the whole body
before reading anything: the server answers, then goes on reading and discarding the body (a lingering close,
api/http_protocol.py) instead of closing a socket the client is still writing to, which makes the kernel reset
the connection and lose the answer. Real server, real sockets; every case runs several rounds, since whether
the answer survived a reset was a race."""

from __future__ import annotations

import base64
import functools
import gzip
import http.client
import io
import json
import random
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from PIL import Image

from firsttoken.api.errors import ERROR_TYPES
from firsttoken.api.http_protocol import LingerBounds
from tests.e2e.conftest import LiveServer, start_server, stop_server

LIMIT = 2**20  # the refusing server's --max-request-bytes
BODY_BYTES = 4 * 2**20  # what the refused clients send: over the limit, well under the linger bound
# The refusing server's: a byte bound a test passes in a moment (the default is 256 MiB), and time bounds long
# enough that no test depends on this machine's speed (a lingering client here pauses while another is served).
LINGER = LingerBounds(max_bytes=16 * 2**20, total_s=120.0, idle_s=60.0)
BODY_TIMEOUT_S = 3.0  # the refusing server's --request-body-timeout (the 408 case waits this long)
ROUNDS = 5
CHAT = "/v1/chat/completions"
TOO_LARGE = f"request body too large: the limit is {LIMIT} bytes"


@pytest.fixture(scope="module")
def refusing(tiny_model_dir: Path) -> Iterator[LiveServer]:
    live, server, thread = start_server(tiny_model_dir, linger=LINGER, max_request_bytes=LIMIT,
                                        request_body_timeout=BODY_TIMEOUT_S)
    yield live
    stop_server(server, thread, live.engine)


def port_of(live: LiveServer) -> int:
    return int(live.base_url.rsplit(":", 1)[1])


LETTERS = bytes(b"abcdefghijklmnop"[i % 16] for i in range(256))  # byte -> letter, for bytes.translate


@functools.cache
def chat_body(num_bytes: int) -> bytes:
    """A chat request of exactly ``num_bytes`` bytes (its text is random letters, so gzip cannot shrink it much)."""
    head, tail = b'{"model":"tiny","max_tokens":1,"messages":[{"role":"user","content":"', b'"}]}'
    text = random.Random(num_bytes).randbytes(num_bytes - len(head) - len(tail)).translate(LETTERS)
    return head + text + tail


def pieces(body: bytes, size: int = 64 * 1024) -> list[bytes]:
    return [body[i:i + size] for i in range(0, len(body), size)]


def chunked(body: bytes) -> bytes:
    """``body`` in HTTP/1.1 chunked framing, terminator included."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces(body)) + b"0\r\n\r\n"


def post_whole_body(live: LiveServer, body: bytes | Iterable[bytes], headers: dict[str, str],
                    encode_chunked: bool = False) -> tuple[int, dict]:
    """POST with ``http.client``, which writes the whole body before it reads: (status, JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port_of(live), timeout=60)
    try:
        conn.request("POST", CHAT, body=body, headers=headers, encode_chunked=encode_chunked)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def assert_openai_error(payload: dict, status: int, fragment: str) -> None:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["type"] == ERROR_TYPES[status]
    assert fragment in error["message"], error["message"]


@dataclass(frozen=True)
class Refusal:
    name: str
    status: int
    fragment: str  # what the message must say
    headers: dict[str, str]
    body: Callable[[], bytes | Iterable[bytes]] = field(repr=False)
    encode_chunked: bool = False  # http.client frames an iterable body itself


JSON = {"Content-Type": "application/json"}
REFUSALS = (
    Refusal("413 by Content-Length", 413, TOO_LARGE, JSON, lambda: chat_body(BODY_BYTES)),
    Refusal("415 for a gzip body", 415, "Content-Encoding 'gzip' is not supported",
            {**JSON, "Content-Encoding": "gzip"}, lambda: gzip.compress(chat_body(BODY_BYTES))),
    Refusal("400 for Content-Length and Transfer-Encoding", 400, "both Content-Length and Transfer-Encoding",
            {**JSON, "Content-Length": str(len(chunked(chat_body(BODY_BYTES)))), "Transfer-Encoding": "chunked"},
            lambda: chunked(chat_body(BODY_BYTES))),
    Refusal("413 for a chunked body over the limit", 413, TOO_LARGE, {**JSON, "Transfer-Encoding": "chunked"},
            lambda: iter(pieces(chat_body(BODY_BYTES))), encode_chunked=True),
)


@pytest.mark.parametrize("refusal", REFUSALS, ids=[r.name for r in REFUSALS])
def test_a_client_that_writes_its_whole_body_first_reads_the_refusal(refusal: Refusal, refusing: LiveServer) -> None:
    for _ in range(ROUNDS):
        status, payload = post_whole_body(refusing, refusal.body(), refusal.headers, refusal.encode_chunked)
        assert status == refusal.status
        assert_openai_error(payload, refusal.status, refusal.fragment)


def test_both_framing_headers_on_a_body_that_is_not_chunked_get_a_400_not_a_reset(refusing: LiveServer) -> None:
    """Content-Length framing with a stray Transfer-Encoding header: h11 reads the body as chunks, fails, and
    uvicorn may answer its own plain-text 400 before the app's JSON one (which one is a race); either way the
    client reads a 400."""
    body = chat_body(BODY_BYTES)
    headers = {**JSON, "Content-Length": str(len(body)), "Transfer-Encoding": "chunked"}
    for _ in range(ROUNDS):
        conn = http.client.HTTPConnection("127.0.0.1", port_of(refusing), timeout=60)
        try:
            conn.request("POST", CHAT, body=body, headers=headers)
            response = conn.getresponse()
            answer = response.read()
        finally:
            conn.close()
        assert response.status == 400
        assert answer == b"Invalid HTTP request received." or b"both Content-Length and Transfer-Encoding" in answer


def test_a_slow_body_reads_its_408_after_writing_the_rest(refusing: LiveServer) -> None:
    """http.client writes a chunked body whose second half is only produced once the server's 408 has arrived
    (the generator waits for it on the socket: by order of events, not by timing), then reads the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port_of(refusing), timeout=60)

    def body() -> Iterator[bytes]:
        yield b'{"model":"tiny",'
        assert conn.sock.recv(1, socket.MSG_PEEK)  # blocks until the 408 is here
        yield from pieces(b" " * 2**20)

    try:
        conn.request("POST", CHAT, body=body(), headers={**JSON, "Transfer-Encoding": "chunked"}, encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 408
        assert_openai_error(json.loads(response.read()), 408, f"within {BODY_TIMEOUT_S:g} s")
    finally:
        conn.close()


def rejections(live: LiveServer, reason: str) -> float:
    series = f'firsttoken_rejections_total{{reason="{reason}"}}'
    metrics = httpx.get(f"{live.base_url}/metrics").text
    return float(next((line.split()[-1] for line in metrics.splitlines() if line.startswith(series)), 0))


def noise_png_data_url(width: int, height: int) -> str:
    pixels = random.Random(0).randbytes(width * height * 3)  # incompressible: the PNG is ~3 bytes a pixel
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def huge_chat(kind: str) -> list[dict]:
    """A chat over the refusing server's limit: ~4 MiB of text, or a ~3.6 MB PNG (~4.8 MB as base64)."""
    if kind == "text":
        return [{"role": "user", "content": "a" * BODY_BYTES}]
    image = {"type": "image_url", "image_url": {"url": noise_png_data_url(1200, 1000)}}
    return [{"role": "user", "content": [image, {"type": "text", "text": "Describe."}]}]


@pytest.mark.parametrize("kind", ["text", "image"])
def test_the_openai_client_gets_the_413_once_without_retrying(kind: str, refusing: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{refusing.base_url}/v1", api_key="unused")  # default retries: 2
    before = rejections(refusing, "body_too_large")
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=refusing.model, messages=huge_chat(kind), max_tokens=1)
    assert err.value.status_code == 413
    assert TOO_LARGE in err.value.message
    assert rejections(refusing, "body_too_large") == before + 1  # one request reached the server: no retry


def test_the_default_limit_refuses_64_mib_and_one_byte_to_a_whole_body_writer(live_server: LiveServer) -> None:
    limit = 64 * 2**20  # serve's default --max-request-bytes, which live_server runs with
    body = chat_body(limit + 1)
    for _ in range(ROUNDS):
        status, payload = post_whole_body(live_server, body, JSON)
        assert status == 413
        assert_openai_error(payload, 413, f"the limit is {limit} bytes")


def test_a_client_sending_past_the_linger_bound_is_cut_off(refusing: LiveServer) -> None:
    """A declared 1 GiB body: answered 413, read and discarded up to the bound, then the connection is reset;
    the client never gets to write it all (the server does not read without end). Counted in bytes, not time."""
    declared = 2**30
    sent = 0
    with socket.create_connection(("127.0.0.1", port_of(refusing)), timeout=60) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: t\r\nContent-Length: {declared}\r\n\r\n".encode())
        block = b"x" * 2**20
        with pytest.raises(ConnectionError):  # reset (or broken pipe) once the bound is passed
            while sent < declared:
                sock.sendall(block)
                sent += len(block)
    assert LINGER.max_bytes - len(block) <= sent  # it did linger: the server read up to the bound
    assert sent < 4 * LINGER.max_bytes  # and stopped there (past it: only what the two kernels' buffers held)


def test_a_lingering_connection_does_not_hold_up_others(refusing: LiveServer) -> None:
    """While one refused client is still sending its body, another request is served; then the first finishes
    writing and reads its 413."""
    body = chat_body(BODY_BYTES)
    with socket.create_connection(("127.0.0.1", port_of(refusing)), timeout=60) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:LIMIT])
        assert sock.recv(1, socket.MSG_PEEK)  # the 413 is here; the connection lingers
        out = refusing.client().chat.completions.create(
            model=refusing.model, max_tokens=2, messages=[{"role": "user", "content": "Still there?"}])
        assert out.choices[0].finish_reason in ("length", "stop")
        sock.sendall(body[LIMIT:])
        raw = b""
        while chunk := sock.recv(65536):  # to the server's FIN after the answer
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.split()[1] == b"413"
    assert_openai_error(json.loads(payload), 413, TOO_LARGE)
    assert refusing.wait_idle()["kv_blocks_used"] == 0


def test_the_linger_bounds_refuse_nonsense() -> None:
    for bad in ({"max_bytes": -1}, {"total_s": 0}, {"idle_s": -5.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LingerBounds(**bad)


BRIEF = LingerBounds(idle_s=0.5, total_s=2.0)  # the brief server's: its time bounds are what the tests wait for


@pytest.fixture(scope="module")
def brief(tiny_model_dir: Path) -> Iterator[tuple[LiveServer, uvicorn.Server]]:
    live, server, thread = start_server(tiny_model_dir, linger=BRIEF, max_request_bytes=LIMIT)
    yield live, server
    stop_server(server, thread, live.engine)


def refused_socket(live: LiveServer) -> socket.socket:
    """A connection whose request (a 4 MiB Content-Length) was answered 413 after 1 MiB of its body: lingering."""
    sock = socket.create_connection(("127.0.0.1", port_of(live)), timeout=60)
    sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: t\r\nContent-Length: {BODY_BYTES}\r\n\r\n".encode() + b"x" * LIMIT)
    assert sock.recv(1, socket.MSG_PEEK)  # the answer is here
    return sock


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Poll until ``condition`` holds; False after ``timeout_s`` (far beyond the bound the test waits for)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_refused_client_that_goes_silent_is_let_go(brief: tuple[LiveServer, uvicorn.Server]) -> None:
    live, server = brief
    with refused_socket(live):  # held open, silent: after the idle bound the server closes its side too
        assert wait_for(lambda: len(server.server_state.connections) == 0)


def test_a_refused_client_that_keeps_trickling_is_cut_off(brief: tuple[LiveServer, uvicorn.Server]) -> None:
    """A byte every 50 ms: never idle, so the total bound ends it (a stall past the idle bound would, sooner)."""
    live, _ = brief
    with refused_socket(live) as sock:
        deadline = time.monotonic() + 30  # far beyond the 2 s bound
        with pytest.raises(ConnectionError):  # reset: the server closed with bytes arriving
            while time.monotonic() < deadline:
                sock.send(b"x")
                time.sleep(0.05)
