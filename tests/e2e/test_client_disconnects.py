"""A client that leaves is a normal event, wherever it leaves: never an ERROR record with a stack trace (an operator
alerting on error logs must not be paged for it), one count in ``firsttoken_client_disconnects_total`` labelled by
where it left (``body``: while sending its request body; ``answer``: before its answer was complete, whole or
streamed), and the server goes on serving. Through the real server, by order of events: each test waits for the
count, never for a time."""

from __future__ import annotations

import json
import logging
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import LiveServer

LONG = {"model": "tiny", "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 2000,
        "temperature": 0.0, "ignore_eos": True}


def disconnects(live: LiveServer) -> dict[str, float]:
    """firsttoken_client_disconnects_total by stage, as /metrics exports it."""
    text = httpx.get(f"{live.base_url}/metrics").text
    return {s.labels["stage"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "firsttoken_client_disconnects" for s in f.samples if s.name.endswith("_total")}


def wait_for_count(live: LiveServer, stage: str, count: float, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while disconnects(live).get(stage) != count:
        assert time.monotonic() < deadline, f"{stage} disconnects: {disconnects(live)}, expected {count}"
        time.sleep(0.05)


def raw_post(live: LiveServer, body: bytes, sent_bytes: int) -> socket.socket:
    """A connection that declares ``body`` whole (Content-Length) and sends its first ``sent_bytes``."""
    url = urlparse(live.base_url)
    sock = socket.create_connection((url.hostname, url.port))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body[:sent_bytes])
    return sock


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_that_leaves_while_sending_its_body_is_a_counted_disconnect_not_an_error(
        live_server: LiveServer, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO)
    before = disconnects(live_server)
    body = json.dumps({**LONG, "max_tokens": 4}).encode()
    raw_post(live_server, body, len(body) // 2).close()  # half the declared body, then gone
    wait_for_count(live_server, "body", before.get("body", 0) + 1)
    assert errors_logged(caplog) == []
    assert any("disconnect" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert disconnects(live_server).get("answer") == before.get("answer")  # counted once, where it left
    out = live_server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_a_client_that_leaves_before_its_answer_is_complete_counts_in_the_same_metric(
        live_server: LiveServer, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO)
    answer = disconnects(live_server).get("answer", 0)
    whole = raw_post(live_server, json.dumps(LONG).encode(), len(json.dumps(LONG)))
    deadline = time.monotonic() + 20
    while live_server.stats()["num_running"] != 1:  # its whole body read: the engine is generating its answer
        assert time.monotonic() < deadline
        time.sleep(0.05)
    whole.close()
    wait_for_count(live_server, "answer", answer + 1)
    live_server.wait_idle()
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{live_server.base_url}/v1/chat/completions", json={**LONG, "stream": True}) as r:
            for chunks, _ in enumerate(r.iter_lines()):
                if chunks == 3:
                    break  # leaving the block closes the connection mid-stream
    wait_for_count(live_server, "answer", answer + 2)
    assert errors_logged(caplog) == []
    assert live_server.wait_idle()["kv_blocks_used"] == 0


def test_answers_streamed_to_their_end_are_not_disconnects(live_server: LiveServer, caplog: pytest.LogCaptureFixture):
    """The server reports a streamed answer's end to the app as ``http.disconnect`` (ASGI 2.3): that is the answer
    delivered, not a client leaving."""
    caplog.set_level(logging.INFO)
    before = disconnects(live_server)
    client = live_server.client()
    for _ in range(3):
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, stream=True))
        assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason is not None
    with httpx.Client(timeout=30) as raw:  # a completions stream too, read to its [DONE]
        with raw.stream("POST", f"{live_server.base_url}/v1/completions",
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True}) as r:
            assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    live_server.wait_idle()
    after = live_server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=1)  # a later request: the counts have settled
    assert after.usage.completion_tokens == 1
    assert disconnects(live_server) == before
    assert not [r for r in caplog.records if "disconnect" in r.getMessage()]
