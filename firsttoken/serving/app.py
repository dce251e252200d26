"""The Ray Serve application: engine-replica deployments (one per pool) behind one ingress.

    pools                               deployments (one Serve application, "firsttoken")
    --replicas N                        engine-all   x N
    --short-replicas N --long-replicas M engine-short x N, engine-long x M (prompts routed by counted length,
                                        the engine's --long-prompt-threshold)
    every pool                          request router: serving/router.py (--routing), max_ongoing_requests =
                                        --max-num-seqs + --max-queued-per-replica (a replica never holds more)
    ingress                             serving/ingress.py: the OpenAI routes on Serve's HTTP proxy
                                        (--host/--port)

Each replica loads the checkpoint itself; the ingress loads only the tokenizer and asks one replica for the facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from firsttoken.config import ServeConfig
from firsttoken.serving.routing import LONG_POOL, POLICIES, SHORT_POOL, SINGLE_POOL

APP_NAME = "firsttoken"
ROUTING_STATS_PERIOD_S = 1.0  # how often Serve asks each replica for its load (running, waiting, free KV blocks)


@dataclass(frozen=True)
class FleetOptions:
    """The ``firsttoken serve-ray`` flags beyond the config tree's (whose defaults are here, once)."""

    replicas: int = 2  # one pool of this many (ignored when short_replicas/long_replicas are given)
    short_replicas: int = 0
    long_replicas: int = 0
    routing: str = "affinity"
    max_queued_per_replica: int | None = None  # None: the engine's --max-queued-requests
    replica_cpus: float = 1.0  # Ray CPUs reserved per engine replica (its torch threads: --num-threads)
    ingress_cpus: float = 0.0  # the ingress is scheduled anywhere; its preprocessing threads take what is free

    def __post_init__(self) -> None:
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}")
        if self.short_replicas < 0 or self.long_replicas < 0:
            raise ValueError("short_replicas and long_replicas must be >= 0")
        if (self.short_replicas > 0) != (self.long_replicas > 0):
            raise ValueError("short_replicas and long_replicas go together: give both, or neither for one pool")
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.max_queued_per_replica is not None and self.max_queued_per_replica < 0:
            raise ValueError("max_queued_per_replica must be >= 0")
        if not self.replica_cpus > 0 or self.ingress_cpus < 0:
            raise ValueError("replica_cpus must be > 0 and ingress_cpus >= 0")

    def pools(self) -> dict[str, int]:
        """Pool name -> number of replicas."""
        if self.short_replicas:
            return {SHORT_POOL: self.short_replicas, LONG_POOL: self.long_replicas}
        return {SINGLE_POOL: self.replicas}

    def capacity(self, config: ServeConfig) -> int:
        """Requests one replica holds: a full running batch plus its queue."""
        sched = config.engine.scheduler
        queued = sched.max_queued_requests if self.max_queued_per_replica is None else self.max_queued_per_replica
        return sched.max_num_seqs + queued


def build_application(config: ServeConfig, options: FleetOptions, fault_hook: Any = None):  # -> serve.Application
    """``fault_hook``: every replica's runner test seam (serving/replica.py), None in production."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from firsttoken.serving.ingress import Ingress
    from firsttoken.serving.replica import EngineReplica
    from firsttoken.serving.router import FirsttokenRouter

    capacity = options.capacity(config)
    pools = {}
    for pool, num_replicas in options.pools().items():
        deployment = serve.deployment(EngineReplica).options(
            name=f"engine-{pool}",
            num_replicas=num_replicas,
            max_ongoing_requests=capacity,
            max_queued_requests=-1,  # the ingress bounds what it sends (fleet.py): never more than the pool holds
            ray_actor_options={"num_cpus": options.replica_cpus},
            logging_config={"enable_access_log": False},  # one line per call: the ingress's fan-out each second
            request_router_config=RequestRouterConfig(
                request_router_class=FirsttokenRouter,
                request_router_kwargs={"policy": options.routing},
                request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            ),
        )
        pools[pool] = (deployment.bind(config, pool, fault_hook), num_replicas)
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="ingress", ray_actor_options={"num_cpus": options.ingress_cpus})
    return ingress.bind(config, pools, capacity)
