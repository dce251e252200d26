"""What a user sees when things go wrong on the server's side: the truth from /health, errors, no hangs."""

from __future__ import annotations

import threading

import httpx

from tests.e2e.conftest import start_server, stop_server


class EngineCrash(BaseException):
    """Stands for a failure of the engine loop itself (not of one request), which no handler may swallow."""


class CrashWhenArmed:
    def __init__(self) -> None:
        self.armed = threading.Event()

    def __call__(self, stage: str, request_id: str) -> None:
        if self.armed.is_set() and stage == "sample":
            raise EngineCrash()


def test_health_turns_503_and_requests_fail_cleanly_when_the_engine_loop_dies(tiny_model_dir):
    hook = CrashWhenArmed()
    live, server, thread = start_server(tiny_model_dir, fault_hook=hook)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert httpx.post(f"{live.base_url}/v1/chat/completions", json=body).status_code == 200
        assert httpx.get(f"{live.base_url}/health").status_code == 200
        hook.armed.set()
        dying = httpx.post(f"{live.base_url}/v1/chat/completions", json=body, timeout=30)
        assert dying.status_code == 503  # the request in flight is told, not left hanging
        assert set(dying.json()["error"]) >= {"message", "type", "code"}
        assert httpx.get(f"{live.base_url}/health").status_code == 503
        after = httpx.post(f"{live.base_url}/v1/chat/completions", json=body, timeout=30)
        assert after.status_code == 503
    finally:
        stop_server(server, thread, live.engine)
