"""The engine replicas' Ray Serve request router
(``RequestRouterConfig(request_router_class=FirsttokenRouter)``): Serve calls ``choose_replicas``
for every request a handle sends to a pool; the decision is ``routing.rank_replicas`` (affinity, p2c
or round-robin, see routing.py) over what this router knows:

- in flight per replica: Serve's own queue-length cache (requests sent and not finished, corrected
  by Serve's probes), else the replica's last ``record_routing_stats`` report (running + waiting); a
  replica holding its capacity (``--max-num-seqs`` + ``--max-queued-per-replica``) is left out of
  the ranking (Serve's max_ongoing_requests is higher by the ingress's control calls,
  serving/app.py);
- free KV blocks per replica: its last ``record_routing_stats`` report
  (``request_routing_stats_period_s``);
- where each prefix went: remembered here when a request is ranked (the first replica of the ranking
  is the one Serve takes unless it is full at that instant; the capacity check before ranking makes
  that rare), and forgotten for a replica that dies (its restart holds nothing).

One router per handle: the ingress holds one handle per pool, so each pool's memory lives in the
ingress process. The ranking gives one replica per rank, so Serve takes them in our order and moves
down only past a full one.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from firsttoken.serving.routing import (
    DEFAULT_MEMORY_ENTRIES,
    PrefixMemory,
    ReplicaLoad,
    RoutingHints,
    RoutingState,
    rank_replicas,
)

HINTS_KWARG = "hints"  # the keyword argument of EngineReplica.generate that carries RoutingHints
# in-flight requests the prefix holder may have beyond the least loaded replica
DEFAULT_MAX_IMBALANCE = 8


class FirsttokenRouter(RequestRouter):
    def initialize_state(
        self,
        capacity: int,
        policy: str = "affinity",
        max_imbalance: int = DEFAULT_MAX_IMBALANCE,
        memory_entries: int = DEFAULT_MEMORY_ENTRIES,
        seed: int | None = None,
        **_: Any,
    ) -> None:
        """``request_router_kwargs`` of the deployment (serving/app.py). ``capacity``: requests a
        replica may hold (Serve's max_ongoing_requests is higher by the ingress's control calls)."""
        self.policy = policy
        self.capacity = capacity
        self.max_imbalance = max_imbalance
        self.state = RoutingState(PrefixMemory(memory_entries))
        self.rng = random.Random(seed)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        hints = _hints_of(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        # only replicas with room: when none has any, the request waits at the handle (what an
        # autoscaled pool's policy counts as queued) and Serve asks again
        loads = [
            load
            for load in map(self._load, candidate_replicas)
            if load.num_in_flight < load.capacity
        ]
        ranked = rank_replicas(self.policy, loads, hints, self.state, self.max_imbalance, self.rng)
        if hints is not None and ranked:
            self.state.memory.remember(hints.prefix_keys, ranked[0])
        if pending_request is not None:
            # every candidate is in the ranking: wait, retry
            pending_request.routing_context.should_backoff = True
        return [[by_id[rid]] for rid in ranked]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.state.memory.forget(replica_id)

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        in_flight = self.replica_queue_len_cache.get(replica.replica_id)
        if in_flight is None:
            in_flight = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
        return ReplicaLoad(
            replica.replica_id, in_flight, self.capacity, int(stats.get("num_free_kv_blocks", 0))
        )


def _hints_of(pending_request: PendingRequest | None) -> RoutingHints | None:
    if pending_request is None:
        return None
    hints = pending_request.kwargs.get(HINTS_KWARG)
    return hints if isinstance(hints, RoutingHints) else None
