"""An autoscaled pool (--replicas 1:2) on Ray Serve: a queue on its one replica brings a second, which takes the
next request; when nothing is queued or running any more, the pool goes back to one. Order of events, read from
the fleet's /metrics (one series per live replica), never time."""

from __future__ import annotations

from contextlib import ExitStack

import httpx

from tests.ray.conftest import STARTUP_TIMEOUT_S, Fleet
from tests.ray.test_fleet import _hold

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


def test_a_queue_adds_a_replica_which_takes_the_next_request_and_an_idle_pool_shrinks_back(
        scale_fleet: Fleet) -> None:
    scale_fleet.wait_idle()
    assert len(scale_fleet.gauges(RUNNING)) == 1  # starts at its minimum
    with scale_fleet.paced(), ExitStack() as clients:
        # one replica (--max-num-seqs 1): one running, two waiting -> 2 queued > 1 per replica
        held = [_hold(scale_fleet, clients.enter_context(httpx.Client(timeout=STARTUP_TIMEOUT_S)), f"scale-{i}")
                for i in range(3)]
        first = next(iter(scale_fleet.gauges(RUNNING)))
        # the role chunk is streamed before the replica's engine has queued the request (seen once: 1 running,
        # 1 waiting right after the third chunk): poll until the gauges show all three on the first replica
        scale_fleet.wait_for("1 running + 2 waiting on the first replica", lambda: (
            scale_fleet.gauges(RUNNING).get(first), scale_fleet.gauges(WAITING).get(first)) == (1, 2))
        scale_fleet.wait_for("a second replica", lambda: len(scale_fleet.gauges(RUNNING)) == 2, STARTUP_TIMEOUT_S)
        (second,) = set(scale_fleet.gauges(RUNNING)) - {first}
        # the first replica holds its capacity (1 + 2): the next request can only go to the new one
        held.append(_hold(scale_fleet, clients.enter_context(httpx.Client(timeout=STARTUP_TIMEOUT_S)), "scale-3"))
        scale_fleet.wait_for("the new replica to run it", lambda: scale_fleet.gauges(RUNNING).get(second) == 1)
        assert scale_fleet.gauges(WAITING)[first] == 2  # nothing moved off the first replica
    del held  # the clients leave: every request is aborted
    scale_fleet.wait_idle()
    scale_fleet.wait_for("the pool to shrink to one replica", lambda: len(scale_fleet.gauges(RUNNING)) == 1,
                         STARTUP_TIMEOUT_S)
