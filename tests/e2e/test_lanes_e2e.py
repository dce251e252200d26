"""Lanes through the real server: a short question is answered while someone's long image prompt is prefilling."""

from __future__ import annotations

import json
import threading

import httpx

from tests.e2e.conftest import LiveServer, image_message, make_image, start_server, stop_server


def _first_content(base: str, body: dict, events: list[str], name: str, started: threading.Event | None) -> None:
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if started is not None:
                started.set()  # the role chunk: the request is in the engine
                started = None
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                events.append(name)
                return


def assert_short_answered_first(live: LiveServer, long_messages: list[dict]) -> None:
    """A short question sent once the long prompt is admitted gets its first token before the long one does, and
    the engine frees every KV block after both."""
    events: list[str] = []
    long_started = threading.Event()
    long_body = {"model": "tiny", "max_tokens": 2, "temperature": 0.0, "messages": long_messages}
    short_body = {"model": "tiny", "max_tokens": 2, "temperature": 0.0,
                  "messages": [{"role": "user", "content": "What time is it?"}]}
    t_long = threading.Thread(target=_first_content, args=(live.base_url, long_body, events, "long", long_started))
    t_long.start()
    assert long_started.wait(60)
    while live.stats()["num_running"] == 0:  # the long request is admitted: encoding, then prefilling
        pass
    _first_content(live.base_url, short_body, events, "short", None)
    t_long.join(120)
    assert events == ["short", "long"]
    assert live.wait_idle()["kv_blocks_used"] == 0


def test_short_request_gets_its_first_token_before_a_long_prefill_finishes(tiny_model_dir):
    # 64 tokens of long-lane work per step: the long prompt (~2,400 tokens, one 980x980 image) needs dozens of steps
    live, server, thread = start_server(tiny_model_dir, max_batched_tokens=256, long_step_tokens=64,
                                        long_prompt_threshold=512)
    try:
        assert_short_answered_first(live, image_message("Describe every detail. " * 60, make_image(980, 980, seed=12)))
    finally:
        stop_server(server, thread, live.engine)
