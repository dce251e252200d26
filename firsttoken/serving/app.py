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

Each replica loads the checkpoint itself; the ingress loads only the tokenizer and asks one replica
for the facts. ``cli/serve_ray.app_builder`` is the same application for a Serve config file
(``serve run``/``serve deploy``).
"""

from __future__ import annotations

import warnings
from typing import Any

from firsttoken.config import ServeConfig
from firsttoken.serving.options import FleetOptions, ReplicaCount

APP_NAME = "firsttoken"
# how often Serve asks each replica for its load (running, waiting, free KV blocks)
ROUTING_STATS_PERIOD_S = 1.0
# Serve counts every call to a replica against max_ongoing_requests, the ingress's fan-outs (stats,
# metrics, health) too: a replica holding its capacity in requests would leave them waiting (and
# /health at 503). So replicas take this many calls beyond their capacity, and the router
# (serving/router.py) never sends a request past capacity.
CONTROL_SLOTS = 4


# -> serve.Application
def build_application(config: ServeConfig, options: FleetOptions, fault_hook: Any = None):
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
            # the router keeps requests to `capacity`
            max_ongoing_requests=capacity + CONTROL_SLOTS,
            # the ingress bounds what it sends (fleet.py): never more than the pool holds
            max_queued_requests=-1,
            ray_actor_options={"num_cpus": options.replica_cpus},
            # one line per call: the ingress's fan-out each second
            logging_config={"enable_access_log": False},
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


def replica_count_options(
    count: ReplicaCount, options: FleetOptions, max_num_seqs: int
) -> dict[str, Any]:
    """Serve's deployment options for a pool of ``count`` replicas: a fixed number, or an
    autoscaling config whose policy is serving/autoscale.py's (on queued requests, with the fleet's
    delays and window)."""
    if not count.autoscaled:
        return {"num_replicas": count.low}
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    from firsttoken.serving.autoscale import QueuedRequestsPolicy

    window = options.autoscale_window_s
    with warnings.catch_warnings():
        # metrics_interval_s (how often replicas push their queue lengths) is deprecated in favour
        # of a cluster-wide environment variable, but Serve 2.60 (pinned) honours it per deployment:
        # a window needs several samples
        warnings.filterwarnings(
            "ignore", message=".*metrics_interval_s.*", category=DeprecationWarning
        )
        config = AutoscalingConfig(
            min_replicas=count.low, max_replicas=count.high, initial_replicas=count.low,
            look_back_period_s=window, metrics_interval_s=min(window / 4, 10.0),
            upscale_delay_s=options.upscale_delay_s, downscale_delay_s=options.downscale_delay_s,
            policy=AutoscalingPolicy(policy_function=QueuedRequestsPolicy, policy_kwargs={
                "target_queued": options.autoscale_target_queued, "max_num_seqs": max_num_seqs}))
    return {"autoscaling_config": config}
