"""What a user sees when things go wrong on the server's side: the truth from /health, errors, no hangs."""

from __future__ import annotations

import threading

import httpx

from tests.e2e.conftest import HoldEngine, start_server, stop_server


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


def test_a_full_lane_answers_429_with_retry_after_before_decoding_any_image(tiny_model_dir):
    import asyncio
    import io

    from tests.e2e.conftest import image_message, make_image

    hold = HoldEngine()
    live, server, thread = start_server(tiny_model_dir, fault_hook=hold, max_queued_requests=2,
                                        long_prompt_threshold=8)
    try:
        def body(seed: int) -> dict:
            return {"model": "tiny", "messages": image_message("Describe.", make_image(84, 84, seed=seed)),
                    "max_tokens": 2, "temperature": 0.0}

        async def scenario():
            async with httpx.AsyncClient(base_url=live.base_url, timeout=60) as client:
                first = asyncio.create_task(client.post("/v1/chat/completions", json=body(1)))
                await asyncio.to_thread(hold.entered.wait, 30)  # request 1 holds the engine mid-prefill
                queued = [asyncio.create_task(client.post("/v1/chat/completions", json=body(s))) for s in (2, 3)]
                while True:  # both admitted (their places reserved) before the next one asks
                    await asyncio.sleep(0.05)
                    if live.engine.engine.scheduler.waiting.depths()["long"] + len(live.engine._reservations) >= 2:
                        break
                png = io.BytesIO()
                make_image(84, 84, seed=9).save(png, "PNG")
                truncated = png.getvalue()[: len(png.getvalue()) // 2]  # valid header, undecodable body
                import base64

                url = "data:image/png;base64," + base64.b64encode(truncated).decode()
                over = await client.post("/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]}]})
                hold.release.set()
                return over, await first, [await q for q in queued]

        over, first, queued = asyncio.run(scenario())
        assert over.status_code == 429  # not 400: the broken image was never decoded
        assert over.headers["retry-after"] == "1"
        assert "long lane" in over.json()["error"]["message"]
        assert first.status_code == 200 and [q.status_code for q in queued] == [200, 200]
        assert live.wait_idle()["kv_blocks_used"] == 0
    finally:
        hold.release.set()
        stop_server(server, thread, live.engine)
