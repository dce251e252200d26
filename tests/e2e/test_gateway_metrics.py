"""The vLLM-named gauges a Kubernetes inference gateway routes on, read from a live server in a known state: one
request decoding (running, holding KV blocks) with the engine thread held inside its second step, then idle again.
They must equal the engine's own /v1/engine/stats (published after each step; the engine thread is held, so
nothing moves between the two reads)."""

from __future__ import annotations

import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import start_server, stop_server

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc")


class HoldSecondStep:
    """Holds the engine thread when it samples for the second time: the first step (prefill) has been published."""

    def __init__(self) -> None:
        self.samples = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, stage: str, request_id: str) -> None:
        if stage == "sample":
            self.samples += 1
            if self.samples == 2:
                self.entered.set()
                assert self.release.wait(60)


def vllm_gauges(base_url: str) -> dict[str, tuple[dict, float]]:
    text = httpx.get(f"{base_url}/metrics").text
    return {f.name: (f.samples[0].labels, f.samples[0].value)
            for f in text_string_to_metric_families(text) if f.name in GAUGES}


def expected(stats: dict) -> dict[str, float]:
    usage = stats["kv_blocks_used"] / stats["kv_blocks_total"]
    return {"vllm:num_requests_running": stats["num_running"], "vllm:num_requests_waiting": stats["num_waiting"],
            "vllm:kv_cache_usage_perc": usage, "vllm:gpu_cache_usage_perc": usage}


def test_vllm_gauges_equal_the_engine_state_while_a_request_decodes_and_when_idle(tiny_model_dir):
    gate = HoldSecondStep()
    live, server, thread = start_server(tiny_model_dir, fault_hook=gate)
    client = httpx.Client(timeout=30)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Describe the sea. " * 20}],
                "max_tokens": 4, "temperature": 0.0, "stream": True, "ignore_eos": True}
        resp = client.send(client.build_request("POST", f"{live.base_url}/v1/chat/completions", json=body),
                           stream=True)
        assert gate.entered.wait(30)  # the prefill step is published; the engine thread is inside the next one
        held = vllm_gauges(live.base_url)
        stats = live.stats()
        assert {name: value for name, (_, value) in held.items()} == expected(stats)
        assert held["vllm:num_requests_running"][1] == 1 and held["vllm:kv_cache_usage_perc"][1] > 0
        assert {tuple(sorted(labels.items())) for labels, _ in held.values()} == {
            (("engine", "0"), ("model_name", "tiny"))}  # the served model name, as vLLM labels it
        gate.release.set()
        assert [line for line in resp.iter_lines() if line][-1] == "data: [DONE]"
        idle = live.wait_idle()
        assert {name: value for name, (_, value) in vllm_gauges(live.base_url).items()} == expected(idle) == {
            "vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0.0,
            "vllm:gpu_cache_usage_perc": 0.0}
    finally:
        gate.release.set()
        client.close()
        stop_server(server, thread, live.engine)
