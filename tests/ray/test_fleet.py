"""Replicas on Ray Serve, through the ingress's HTTP port: the same answers as one server, follow-up turns where
their prefix is cached, 429 when every replica is full, a client leaving frees its replica, one /metrics for all."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from firsttoken.llm import LLM
from tests.conftest import require_program
from tests.ray.conftest import Fleet

BLOCK_SIZE = 16  # the engine's default --block-size, which the fleets run with
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:gpu_cache_usage_perc", "vllm:cache_config_info")


def _conversation(tag: str) -> list[dict]:
    """A first turn whose first block is unique to ``tag`` (the tag opens the system prompt)."""
    system = f"[{tag}] You answer briefly and precisely about the sea, tides, waves and ships."
    return [{"role": "system", "content": system}, {"role": "user", "content": "What is a tide?"}]


def _two_turns(fleet: Fleet, tag: str) -> tuple[int, int]:
    """(prompt tokens of turn 1, cached prompt tokens of turn 2) of one two-turn conversation."""
    client = fleet.client()
    first = _conversation(tag)
    r1 = client.chat.completions.create(model="tiny", messages=first, max_tokens=4, temperature=0)
    follow_up = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "And what is a wave?"}]
    r2 = client.chat.completions.create(model="tiny", messages=follow_up, max_tokens=4, temperature=0)
    return r1.usage.prompt_tokens, r2.usage.prompt_tokens_details.cached_tokens


def test_streaming_through_the_ingress_equals_one_engine_greedy(affinity_fleet: Fleet, tiny_model_dir: Path) -> None:
    messages = [{"role": "user", "content": "Describe a lighthouse at night."}]
    stream = affinity_fleet.client().chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                             temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    whole = affinity_fleet.client().completions.create(model="tiny", prompt="The sea at dawn", max_tokens=12,
                                                       temperature=0)
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory="16MiB", max_batched_tokens=256)
    assert streamed == llm.chat(messages, {"temperature": 0, "max_tokens": 12}).text
    assert whole.choices[0].text == llm.complete("The sea at dawn", {"temperature": 0, "max_tokens": 12}).text
    assert streamed and whole.choices[0].text


def test_follow_up_turns_land_on_the_replica_holding_their_prefix(affinity_fleet: Fleet) -> None:
    for tag in ("affinity-a", "affinity-b", "affinity-c"):
        first_prompt_tokens, cached = _two_turns(affinity_fleet, tag)
        # every full block of the first turn's prompt is a prefix of the second's, cached where the first ran
        assert cached >= BLOCK_SIZE * ((first_prompt_tokens - 1) // BLOCK_SIZE) > 0


def test_round_robin_sends_the_follow_up_to_the_other_replica(rr_fleet: Fleet) -> None:
    # two replicas taken in turn: the second turn always goes where the first did not
    for tag in ("rr-a", "rr-b"):
        _, cached = _two_turns(rr_fleet, tag)
        assert cached == 0


def _hold(fleet: Fleet, http: httpx.Client, tag: str) -> Iterator[str]:
    """A streaming request that runs long (ignore_eos, paced), read up to its first chunk (the role: it has been
    admitted and holds its place, running or queued); the caller keeps the returned line iterator (dropping it
    would close the connection: the client leaving)."""
    body = {"model": "tiny", "messages": _conversation(tag), "max_tokens": 30_000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    response = http.send(http.build_request("POST", f"{fleet.base_url}/v1/chat/completions", json=body),
                         stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    assert '"role":"assistant"' in next(lines)
    return lines


def test_429_with_retry_after_when_every_replica_is_full_and_a_client_leaving_frees_its_place(
        rr_fleet: Fleet) -> None:
    rr_fleet.wait_idle()
    body = {"model": "tiny", "messages": _conversation("rr-full"), "max_tokens": 2, "temperature": 0}
    with rr_fleet.paced(), ExitStack() as clients:
        # 2 replicas x (1 running + 1 queued): four requests fill the pool, wherever the router put them
        held = [_hold(rr_fleet, clients.enter_context(httpx.Client(timeout=120)), f"rr-hold-{i}") for i in range(4)]
        refused = httpx.post(f"{rr_fleet.base_url}/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["type"] == "RateLimitError" and error["code"] == 429 and "full" in error["message"]
    del held  # the clients have left mid-stream (their connections closed): the replicas abort their requests
    rr_fleet.wait_idle()
    assert httpx.post(f"{rr_fleet.base_url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_bad_input_is_refused_at_the_ingress_in_openai_shape(affinity_fleet: Fleet) -> None:
    url = f"{affinity_fleet.base_url}/v1/chat/completions"
    bad = httpx.post(url, json={"model": "tiny", "messages": _conversation("bad"), "temperature": 5}, timeout=60)
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "BadRequestError" and "temperature" in bad.json()["error"]["message"]
    unknown = httpx.post(url, json={"model": "nope", "messages": _conversation("bad")}, timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    models = affinity_fleet.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_metrics_aggregate_every_replica_with_a_replica_label_and_vllm_gauges(affinity_fleet: Fleet) -> None:
    affinity_fleet.wait_idle()
    stats = affinity_fleet.get("/v1/engine/stats").json()
    text = affinity_fleet.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in VLLM_GAUGES:
        replicas = {s.labels["replica"] for s in families[name].samples}
        assert len(replicas) == 2 and all(r.startswith("all/") for r in replicas), (name, replicas)
    running = {s.labels["replica"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert sum(running.values()) == stats["num_running"] == 0
    blocks = [int(s.labels["num_gpu_blocks"]) for s in families["vllm:cache_config_info"].samples]
    assert sum(blocks) == stats["kv_blocks_total"]
    rejections = {s.labels["replica"] for s in families["firsttoken_rejections"].samples}
    assert "ingress" in rejections
    promtool = require_program("promtool", "prometheus")  # the merged text is valid exposition
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    assert "error" not in (check.stdout + check.stderr).lower(), check.stdout + check.stderr


def test_a_long_pool_flood_never_queues_a_short_prompt(pools_fleet: Fleet) -> None:
    """Three long prompts fill the long replica (one running, two waiting); a short one, sent after them, is
    answered by the short replica while all three are still there."""
    pools_fleet.wait_idle()
    long_system = "[flood] " + " ".join(f"Rule {i}: the keeper checks lamp number {i} at dusk." for i in range(12))
    with pools_fleet.paced(), ExitStack() as clients:
        held = []
        for i in range(3):
            body = {"model": "tiny", "max_tokens": 30_000, "temperature": 0, "stream": True, "ignore_eos": True,
                    "messages": [{"role": "system", "content": long_system}, {"role": "user", "content": str(i)}]}
            http = clients.enter_context(httpx.Client(timeout=120))
            response = http.send(http.build_request("POST", f"{pools_fleet.base_url}/v1/chat/completions",
                                                    json=body), stream=True)
            held.append(response.iter_lines())
            assert '"role":"assistant"' in next(held[-1])

        def long_replica_full() -> bool:
            waiting = pools_fleet.gauges("vllm:num_requests_waiting")
            return any(r.startswith("long/") and v == 2 for r, v in waiting.items())

        pools_fleet.wait_for("the long replica to hold the flood", long_replica_full)
        short = httpx.post(f"{pools_fleet.base_url}/v1/chat/completions", timeout=120,
                           json={"model": "tiny", "messages": _conversation("short"), "max_tokens": 2})
        assert short.status_code == 200
        assert short.json()["usage"]["prompt_tokens"] < 64
        running = pools_fleet.gauges("vllm:num_requests_running")
        waiting = pools_fleet.gauges("vllm:num_requests_waiting")
        long_replica = next(r for r in running if r.startswith("long/"))
        assert (running[long_replica], waiting[long_replica]) == (1, 2)  # the flood is all still there
        finished = {s.labels["replica"] for f in text_string_to_metric_families(pools_fleet.get("/metrics").text)
                    if f.name == "firsttoken_requests" for s in f.samples if s.value > 0}
        assert finished == {next(r for r in running if r.startswith("short/"))}  # the short replica answered it
    del held
    pools_fleet.wait_idle()
