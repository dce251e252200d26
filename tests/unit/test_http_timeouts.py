"""Connections that never finish a request: headers that never end are closed after the header deadline (the
protocol class `serve` gives uvicorn), a body that never ends gets 408 (the middleware), and neither touches
other connections. Real uvicorn on a loopback port, a scripted fake engine; the tests wait for the server to
act, they measure no time."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from firsttoken.api.http_protocol import header_timeout_protocol
from firsttoken.inputs.processor import InputProcessor

from .fake_engine import FakeEngine
from .test_api_protocol import MODEL, live_server, processor  # noqa: F401 (processor: a fixture)

HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 0.5, 0.5
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture(scope="module")
def server(processor: InputProcessor) -> Iterator[int]:
    options = {"http": header_timeout_protocol(HEADER_TIMEOUT_S)}  # what `serve` runs uvicorn with
    with live_server(FakeEngine(), processor, options, request_body_timeout_s=BODY_TIMEOUT_S) as url:
        yield int(url.rsplit(":", 1)[1])


def read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(30)  # far beyond either deadline: a hang fails the test instead of blocking it
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def request(body: bytes, extra: str = "") -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def test_headers_that_never_end_are_closed_without_an_answer(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server)) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nX-Slow: ")  # and nothing more
        r = httpx.post(f"http://127.0.0.1:{server}/v1/chat/completions", content=CHAT)
        assert r.status_code == 200  # another connection is served meanwhile
        assert read_until_closed(slow) == b""  # closed by the server; there was no request to answer


def test_the_deadline_applies_again_to_the_next_request_on_a_kept_alive_connection(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server)) as conn:
        conn.sendall(request(CHAT))
        first = b""
        while b'"finish_reason"' not in first:
            first += conn.recv(65536)
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost")  # the second request stalls in its head
        rest = read_until_closed(conn)
    assert first.startswith(b"HTTP/1.1 200") and b"HTTP/1.1" not in rest


def test_complete_headers_and_a_body_that_never_ends_get_408(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server)) as conn:
        conn.sendall(request(CHAT)[: -len(CHAT) + 10])  # headers promise the whole body; 10 bytes of it come
        answer = read_until_closed(conn)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["type"] == "RequestTimeoutError"


def test_the_protocol_refuses_a_nonsense_deadline() -> None:
    with pytest.raises(ValueError):
        header_timeout_protocol(0)


def test_the_linger_byte_bound_follows_a_large_body_limit() -> None:
    from firsttoken.api.http_protocol import LingerBounds

    assert LingerBounds.for_body_limit(64 * 2**20).max_bytes == LingerBounds().max_bytes == 256 * 2**20
    assert LingerBounds.for_body_limit(2**30).max_bytes == 4 * 2**30  # a 1 GiB limit still gets its 413 read
