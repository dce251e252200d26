"""A replica killed mid-run (ray.kill on its actor): the request it had started ends with a clean, retryable 503;
the accepted request still waiting in its queue is sent to the other replica and answered; Serve replaces it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import ray

from tests.ray.conftest import STARTUP_TIMEOUT_S, Fleet


def _replica_actor(app: str, replica: str):
    """The Ray actor of the replica labelled ``<pool>/<id>`` in /metrics."""
    unique_id = replica.split("/", 1)[1]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{app}#") and a["name"].endswith(f"#{unique_id}")]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def test_killed_replica_fails_started_requests_cleanly_and_resends_unstarted_ones(affinity_fleet: Fleet) -> None:
    fleet = affinity_fleet
    fleet.wait_idle()
    system = "[kill] The lighthouse keeper writes in the log every night, whatever the weather."
    url = f"{fleet.base_url}/v1/chat/completions"
    started_body = {"model": "tiny", "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": "Tell me everything."}],
                    "max_tokens": 30_000, "temperature": 0, "stream": True, "ignore_eos": True}
    queued_body = {"model": "tiny", "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": "Just one word."}],
                   "max_tokens": 4, "temperature": 0}
    with fleet.paced(), httpx.Client(timeout=300) as http, ThreadPoolExecutor(1) as pool:
        with http.stream("POST", url, json=started_body) as started:
            lines = started.iter_lines()
            assert any('"content":' in line and '"content":""' not in line for line in lines)  # tokens arrived
            victim = fleet.wait_for("the started request to run", lambda: [
                r for r, v in fleet.gauges("vllm:num_requests_running").items() if v >= 1])[0]
            # same prefix: routed to the victim, where it waits behind the started one (--max-num-seqs 1)
            queued = pool.submit(httpx.post, url, json=queued_body, timeout=300)
            fleet.wait_for("the second request to wait on the same replica",
                           lambda: fleet.gauges("vllm:num_requests_waiting").get(victim, 0) >= 1)
            ray.kill(_replica_actor(fleet.name, victim), no_restart=True)
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "retry" in error["message"]
        answer = queued.result()
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"

    def replaced() -> bool:
        replicas = set(fleet.gauges("vllm:num_requests_running"))
        return len(replicas) == 2 and victim not in replicas

    fleet.wait_for("Serve to replace the killed replica", replaced, STARTUP_TIMEOUT_S)
    ok = httpx.post(url, json=queued_body, timeout=300)
    assert ok.status_code == 200
