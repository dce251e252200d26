"""The ingress's pool bound on a real cluster (/tight: one replica, two requests in all), over HTTP: a prompt whose
image crosses the routing cut is routed and answered (issue 37: it was refused with a 400 that kept its place for
good), and requests that fail on the replica give their place back, so ten failures later the pool admits exactly
its two again."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import httpx

from firsttoken.serving.routing import MAX_PREFIX_BLOCKS
from tests.e2e.conftest import image_data_url, make_image
from tests.ray.conftest import TIGHT_BLOCK_SIZE, Fleet
from tests.ray.test_fleet import _conversation, _hold

POOL_LIMIT = 2  # /tight: 1 replica x (1 running + 1 queued)
CUT_TOKENS = MAX_PREFIX_BLOCKS * TIGHT_BLOCK_SIZE  # 16,384: routing keys cover the prompt up to here at most
IMAGE_SIZE = (1120, 700)  # (width, height): 40 x 25 = 1,000 visual tokens, 28 pixels each after the 2x2 merge
TEXT_REPEATS = 7_940  # " sea" is two tokens: the image starts about 500 tokens before the cut and ends 500 after
NUM_FAILURES = 10  # five times what the pool holds
ANSWER_TIMEOUT_S = 600.0  # a bound for a hang (a 17k-token prefill on a fifth of a CPU), not a speed expectation


def _text_then_image() -> list[dict]:
    picture = {"type": "image_url", "image_url": {"url": image_data_url(make_image(*IMAGE_SIZE))}}
    return [{"role": "user", "content": [{"type": "text", "text": " sea" * TEXT_REPEATS}, picture]}]


def _image_span(fleet: Fleet, messages: list[dict], image_token_id: int) -> tuple[int, int]:
    """[start, end) of the prompt's one image, as the ingress tokenizes it (/tokenize: the prompt the engine sees)."""
    count = httpx.post(f"{fleet.base_url}/tokenize", json={"model": "tiny", "messages": messages}, timeout=60)
    assert count.status_code == 200, count.text
    start = count.json()["tokens"].index(image_token_id)
    return start, start + count.json()["images"][0]["num_tokens"]


def test_a_prompt_whose_image_crosses_the_routing_cut_is_answered_and_keeps_no_place(
        tight_fleet: Fleet, tiny_model_dir: Path) -> None:
    tight_fleet.wait_idle()
    messages = _text_then_image()
    image_token_id = json.loads((tiny_model_dir / "config.json").read_text())["image_token_id"]
    start, end = _image_span(tight_fleet, messages, image_token_id)
    assert start < CUT_TOKENS < end  # the case of issue 37, at this fleet's block size
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0}
    for _ in range(POOL_LIMIT + 1):  # one more than the pool holds: each answer gave its place back
        answer = httpx.post(f"{tight_fleet.base_url}/v1/chat/completions", json=body, timeout=ANSWER_TIMEOUT_S)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] > end


def test_ten_failed_requests_later_a_pool_of_two_still_admits_two(tight_fleet: Fleet) -> None:
    tight_fleet.wait_idle()
    url = f"{tight_fleet.base_url}/v1/chat/completions"
    with tight_fleet.failing():
        for i in range(NUM_FAILURES):  # each admitted, routed, prefilled, then failed by the replica
            body = {"model": "tiny", "messages": _conversation(f"tight-fail-{i}"), "max_tokens": 2}
            failed = httpx.post(url, json=body, timeout=120)
            assert failed.status_code == 500, failed.text  # not 429: the failures before it left no place taken
            assert failed.json()["error"]["code"] == 500
    body = {"model": "tiny", "messages": _conversation("tight-after"), "max_tokens": 2}
    with tight_fleet.paced(), ExitStack() as clients:
        held = [_hold(tight_fleet, clients.enter_context(httpx.Client(timeout=120)), f"tight-hold-{i}")
                for i in range(POOL_LIMIT)]  # both places are free
        refused = httpx.post(url, json=body, timeout=60)
        assert refused.status_code == 429  # and there are still only two
    del held  # the clients leave mid-stream: their places are given back too
    tight_fleet.wait_idle()
    assert httpx.post(url, json=body, timeout=120).status_code == 200
