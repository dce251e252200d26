"""One local Ray cluster and Serve instance for this folder (ray.init(num_cpus=2): what CI's runner has; shut down
after its last test), with these firsttoken applications on it, started together:

    /affinity   2 engine replicas, --routing affinity, --max-num-seqs 1 (a second request on a replica waits
                in its queue: an accepted, unstarted request, for the replica-failure test)
    /rr         2 engine replicas, --routing round-robin, --max-num-seqs 1, --max-queued-per-replica 1 (each
                replica holds two requests: the pool is full with four in flight)
    /pools      --short-replicas 1 --long-replicas 1, --long-prompt-threshold 64, --max-num-seqs 1
    /scale      --replicas 1:2 (autoscaled on queued requests: target 1 per replica, no delays, a 1 s window),
                --max-num-seqs 1, --max-queued-per-replica 2
    /tight      1 engine replica, --max-num-seqs 1, --max-queued-per-replica 1 (the pool holds two requests),
                --block-size 4 (routing keys stop at MAX_PREFIX_BLOCKS x 4 = 16,384 tokens: a prompt that crosses
                the cut fits the tiny checkpoint's context); ``Fleet.failing()`` fails its requests

Replicas get a fifth of a CPU (so every fleet at its largest, 9 replicas, fits the 2) and one torch thread each; the
tiny random checkpoint (tests/conftest.py). Tests talk to the ingress over HTTP (Serve's proxy) with the official
openai client or httpx, and order events by what the fleet reports (/metrics, /v1/engine/stats), never by time.
``Fleet.paced()`` keeps long requests running while a test does what it checks (tests/ray/pacing.py).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve import RunTarget

from firsttoken.cli.serve import serve_config
from firsttoken.serving.app import build_application
from firsttoken.serving.options import FleetOptions
from tests.ray.pacing import FailWhileFlag, PaceWhileFlag

FIRST_PORT = 18600  # ports below are other servers' on shared machines
STARTUP_TIMEOUT_S = 600.0  # a bound for a hang, not a speed expectation
LONG_PROMPT_THRESHOLD = 64  # /pools: prompts of this many tokens or more go to the long pool
TIGHT_BLOCK_SIZE = 4  # /tight's KV block


@dataclass(frozen=True)
class Fleet:
    name: str  # the Serve application
    base_url: str  # http://127.0.0.1:PORT/<name>
    pace_flag: Path  # while it exists, every replica's tokens come slowly (tests/ray/pacing.py)
    fail_flag: Path | None = None  # while it exists, every request fails on a replica (the fleets whose hook has it)

    @contextmanager
    def paced(self) -> Iterator[None]:
        with _flag(self.pace_flag):
            yield

    @contextmanager
    def failing(self) -> Iterator[None]:
        if self.fail_flag is None:
            raise ValueError(f"the {self.name} fleet's replicas have no failure hook")
        with _flag(self.fail_flag):
            yield

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kw)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.base_url}{path}", timeout=60)

    def gauges(self, name: str) -> dict[str, float]:
        """replica label -> value of one gauge in the aggregated /metrics."""
        text = self.get("/metrics").text
        return {s.labels["replica"]: s.value for f in text_string_to_metric_families(text) if f.name == name
                for s in f.samples}

    def wait_for(self, what: str, predicate, timeout_s: float = 120.0):
        """Poll ``predicate()`` until it returns something truthy (a bound against a hang, not a timing check)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up waiting for {what}")
            time.sleep(0.1)

    def wait_idle(self) -> None:
        def idle() -> bool:
            s = self.get("/v1/engine/stats").json()
            return s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_used"] == 0
        # the ingress refreshes the fleet's stats every second: a fresh view shows the freed blocks
        self.wait_for("the fleet to be idle", idle)


@contextmanager
def _flag(path: Path) -> Iterator[None]:
    path.touch()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _free_port() -> int:
    for port in range(FIRST_PORT, FIRST_PORT + 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port from {FIRST_PORT}")


@pytest.fixture(scope="package")
def fleets(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Fleet]]:
    port = _free_port()
    flags = tmp_path_factory.mktemp("flags")
    flag, fail_flag = flags / "slow", flags / "fail"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a running one
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = serve_config(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=16 * 2**20,
                          max_batched_tokens=256, served_model_name="tiny", step_time_target="off", num_threads=1,
                          max_num_seqs=1)
    small = {"replica_cpus": 0.2}
    hook = PaceWhileFlag(str(flag))
    apps = {
        "affinity": build_application(config, FleetOptions(replicas=2, routing="affinity", **small), hook),
        "rr": build_application(config, FleetOptions(replicas=2, routing="round-robin", max_queued_per_replica=1,
                                                     **small), hook),
        "pools": build_application(replace(config, engine=replace(config.engine, scheduler=replace(
            config.engine.scheduler, long_prompt_threshold=LONG_PROMPT_THRESHOLD))),
            FleetOptions(short_replicas=1, long_replicas=1, **small), hook),
        "scale": build_application(config, FleetOptions(
            replicas="1:2", max_queued_per_replica=2, autoscale_target_queued=1, upscale_delay_s=0,
            downscale_delay_s=0, autoscale_window_s=1, **small), hook),
        "tight": build_application(replace(config, engine=replace(config.engine, cache=replace(
            config.engine.cache, block_size=TIGHT_BLOCK_SIZE))),
            FleetOptions(replicas=1, max_queued_per_replica=1, **small), FailWhileFlag(str(fail_flag), hook)),
    }
    try:
        serve.run_many([RunTarget(app, name=name, route_prefix=f"/{name}") for name, app in apps.items()])
        fleets = {name: Fleet(name, f"http://127.0.0.1:{port}/{name}", flag, fail_flag if name == "tight" else None)
                  for name in apps}
        for fleet in fleets.values():
            fleet.wait_for(f"{fleet.name} to be healthy", lambda f=fleet: f.get("/health").status_code == 200,
                           STARTUP_TIMEOUT_S)
        yield fleets
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="package")
def affinity_fleet(fleets: dict[str, Fleet]) -> Fleet:
    return fleets["affinity"]


@pytest.fixture(scope="package")
def rr_fleet(fleets: dict[str, Fleet]) -> Fleet:
    return fleets["rr"]


@pytest.fixture(scope="package")
def pools_fleet(fleets: dict[str, Fleet]) -> Fleet:
    return fleets["pools"]


@pytest.fixture(scope="package")
def scale_fleet(fleets: dict[str, Fleet]) -> Fleet:
    return fleets["scale"]


@pytest.fixture(scope="package")
def tight_fleet(fleets: dict[str, Fleet]) -> Fleet:
    return fleets["tight"]
