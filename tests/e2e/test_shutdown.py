"""SIGTERM: new work gets 503 while in-flight requests finish, then the process exits 0 (a real subprocess)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    port = _port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "firsttoken.cli.main", "serve", "--model", str(model_dir), "--port", str(port),
         "--dtype", "float32", "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
         "--log-level", "warning", *extra],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("server did not start")


def _stream(base: str, max_tokens: int, result: dict) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    result["chunks"] = 0
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    result["chunks"] += 1
                    if chunk.get("usage"):
                        result["completion_tokens"] = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                        result["finish_reason"] = chunk["choices"][0]["finish_reason"]
                    if result["chunks"] == 3:
                        result["started"].set()
    except httpx.HTTPError as e:
        result["error"] = type(e).__name__


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_zero(tiny_model_dir):
    proc, base = _serve(tiny_model_dir, "--shutdown-timeout", "60", "--max-batched-tokens", "64")
    try:
        result: dict = {"started": threading.Event()}
        t = threading.Thread(target=_stream, args=(base, 400, result))
        t.start()
        assert result["started"].wait(60)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"{base}/health").status_code != 503:  # draining is visible at once
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(f"{base}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "new"}], "max_tokens": 2})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        t.join(60)
        assert result.get("finish_reason") == "length" and result.get("completion_tokens") == 400
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_requests_still_running_at_the_shutdown_timeout_are_aborted_and_the_exit_is_zero(tiny_model_dir):
    proc, base = _serve(tiny_model_dir, "--shutdown-timeout", "0.5")
    try:
        result: dict = {"started": threading.Event()}
        t = threading.Thread(target=_stream, args=(base, 30000, result))
        t.start()
        assert result["started"].wait(60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        t.join(30)
        assert "finish_reason" not in result  # cut off, not completed
    finally:
        if proc.poll() is None:
            proc.kill()
