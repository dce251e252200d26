"""The Ray Serve application: engine-replica deployments (one per pool) behind one ingress.

    pools                               deployments (one Serve application, "firsttoken")
    --replicas N                        engine-all   x N
    --replicas MIN:MAX                  engine-all, autoscaled between MIN and MAX on queued requests
                                        (serving/autoscale.py)
    --short-replicas N --long-replicas M engine-short x N, engine-long x M (prompts routed by counted length,
                                        the engine's --long-prompt-threshold); each may be MIN:MAX too
    every pool                          request router: serving/router.py (--routing); it sends a replica at most
                                        --max-num-seqs + --max-queued-per-replica requests (its capacity)
    ingress                             serving/ingress.py: the OpenAI routes on Serve's HTTP proxy
                                        (--host/--port)

Each replica loads the checkpoint itself; the ingress loads only the tokenizer and asks one replica for the facts.
``cli/serve_ray.app_builder`` is the same application for a Serve config file (``serve run``/``serve deploy``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from firsttoken.config import ServeConfig
from firsttoken.serving.routing import LONG_POOL, POLICIES, SHORT_POOL, SINGLE_POOL

APP_NAME = "firsttoken"
ROUTING_STATS_PERIOD_S = 1.0  # how often Serve asks each replica for its load (running, waiting, free KV blocks)
# Serve counts every call to a replica against max_ongoing_requests, the ingress's fan-outs (stats, metrics, health)
# too: a replica holding its capacity in requests would leave them waiting (and /health at 503). So replicas take
# this many calls beyond their capacity, and the router (serving/router.py) never sends a request past capacity.
CONTROL_SLOTS = 4


@dataclass(frozen=True)
class ReplicaCount:
    """How many engine replicas a pool has: ``low == high`` fixed, else autoscaled between them."""

    low: int
    high: int

    @classmethod
    def parse(cls, value: ReplicaCount | int | str) -> ReplicaCount:
        """``2`` or ``"2"``: two replicas; ``"1:4"``: autoscaled from one to four."""
        if isinstance(value, ReplicaCount):
            return value
        text = str(value).strip()
        low, sep, high = text.partition(":")
        try:
            count = cls(int(low), int(high) if sep else int(low))
        except ValueError:
            raise ValueError(f"must be N or MIN:MAX, not {text!r}") from None
        if count.low < 0 or count.high < count.low:
            raise ValueError(f"must be N or MIN:MAX with 0 <= MIN <= MAX, not {text!r}")
        return count

    @property
    def autoscaled(self) -> bool:
        return self.high > self.low

    def __str__(self) -> str:
        return f"{self.low}:{self.high}" if self.autoscaled else str(self.low)


@dataclass(frozen=True)
class FleetOptions:
    """The ``firsttoken serve-ray`` flags beyond the config tree's (whose defaults are here, once). Replica counts
    may be given as ``N``, ``"N"`` or ``"MIN:MAX"``; they are held as ``ReplicaCount``."""

    replicas: ReplicaCount | int | str = 2  # one pool of this many (ignored when short/long pools are given)
    short_replicas: ReplicaCount | int | str = 0
    long_replicas: ReplicaCount | int | str = 0
    routing: str = "affinity"
    max_queued_per_replica: int | None = None  # None: the engine's --max-queued-requests
    replica_cpus: float = 1.0  # Ray CPUs reserved per engine replica (its torch threads: --num-threads)
    ingress_cpus: float = 0.0  # the ingress is scheduled anywhere; its preprocessing threads take what is free
    autoscale_target_queued: float = 1.0  # requests queued per replica the autoscaler aims at (autoscale.py)
    upscale_delay_s: float = 10.0  # a scale-up decision must hold this long before replicas are added
    downscale_delay_s: float = 300.0  # ... and a scale-down decision this long before one is removed
    autoscale_window_s: float = 10.0  # replicas' queue lengths are averaged over this window

    def __post_init__(self) -> None:
        for name in ("replicas", "short_replicas", "long_replicas"):
            try:
                object.__setattr__(self, name, ReplicaCount.parse(getattr(self, name)))
            except ValueError as exc:
                raise ValueError(f"{name} {exc}") from None
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}")
        if (self.short_replicas.high > 0) != (self.long_replicas.high > 0):
            raise ValueError("short_replicas and long_replicas go together: give both, or neither for one pool")
        if self.short_replicas.high > 0 and (self.short_replicas.low < 1 or self.long_replicas.low < 1):
            raise ValueError("short_replicas and long_replicas must keep at least one replica each")
        if self.replicas.low < 1:
            raise ValueError("replicas must be >= 1")
        if self.max_queued_per_replica is not None and self.max_queued_per_replica < 0:
            raise ValueError("max_queued_per_replica must be >= 0")
        if not self.replica_cpus > 0 or self.ingress_cpus < 0:
            raise ValueError("replica_cpus must be > 0 and ingress_cpus >= 0")
        if not self.autoscale_target_queued > 0:
            raise ValueError("autoscale_target_queued must be > 0")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0 or not self.autoscale_window_s > 0:
            raise ValueError("upscale_delay_s and downscale_delay_s must be >= 0, autoscale_window_s > 0")

    def pools(self) -> dict[str, ReplicaCount]:
        """Pool name -> its replica count."""
        if self.short_replicas.high:
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
    for pool, count in options.pools().items():
        deployment = serve.deployment(EngineReplica).options(
            name=f"engine-{pool}",
            **replica_count_options(count, options, config.engine.scheduler.max_num_seqs),
            max_ongoing_requests=capacity + CONTROL_SLOTS,  # the router keeps requests to `capacity`
            max_queued_requests=-1,  # the ingress bounds what it sends (fleet.py): never more than the pool holds
            ray_actor_options={"num_cpus": options.replica_cpus},
            logging_config={"enable_access_log": False},  # one line per call: the ingress's fan-out each second
            request_router_config=RequestRouterConfig(
                request_router_class=FirsttokenRouter,
                request_router_kwargs={"policy": options.routing, "capacity": capacity},
                request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            ),
        )
        pools[pool] = (deployment.bind(config, pool, fault_hook), count)
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="ingress", ray_actor_options={"num_cpus": options.ingress_cpus})
    return ingress.bind(config, pools, capacity)


def replica_count_options(count: ReplicaCount, options: FleetOptions, max_num_seqs: int) -> dict[str, Any]:
    """Serve's deployment options for a pool of ``count`` replicas: a fixed number, or an autoscaling config whose
    policy is serving/autoscale.py's (on queued requests, with the fleet's delays and window)."""
    if not count.autoscaled:
        return {"num_replicas": count.low}
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    from firsttoken.serving.autoscale import QueuedRequestsPolicy

    window = options.autoscale_window_s
    with warnings.catch_warnings():
        # metrics_interval_s (how often replicas push their queue lengths) is deprecated in favour of a cluster-wide
        # environment variable, but Serve 2.60 (pinned) honours it per deployment: a window needs several samples
        warnings.filterwarnings("ignore", message=".*metrics_interval_s.*", category=DeprecationWarning)
        config = AutoscalingConfig(
            min_replicas=count.low, max_replicas=count.high, initial_replicas=count.low,
            look_back_period_s=window, metrics_interval_s=min(window / 4, 10.0),
            upscale_delay_s=options.upscale_delay_s, downscale_delay_s=options.downscale_delay_s,
            policy=AutoscalingPolicy(policy_function=QueuedRequestsPolicy, policy_kwargs={
                "target_queued": options.autoscale_target_queued, "max_num_seqs": max_num_seqs}))
    return {"autoscaling_config": config}
