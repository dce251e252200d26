"""The options of a Ray Serve fleet beyond the config tree's: how many replicas each pool has
(``ReplicaCount``) and the ``firsttoken serve-ray`` flags (``FleetOptions``). A leaf of serving/:
the application (app.py), the ingress and the fleet client (ingress.py, fleet.py) all read these
values, and none of them imports another for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.config import ServeConfig
from firsttoken.serving.routing import LONG_POOL, POLICIES, SHORT_POOL, SINGLE_POOL


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
    """The ``firsttoken serve-ray`` flags beyond the config tree's (whose defaults are here, once).
    Replica counts may be given as ``N``, ``"N"`` or ``"MIN:MAX"``; they are held as
    ``ReplicaCount``."""

    # one pool of this many (ignored when short/long pools are given)
    replicas: ReplicaCount | int | str = 2
    short_replicas: ReplicaCount | int | str = 0
    long_replicas: ReplicaCount | int | str = 0
    routing: str = "affinity"
    max_queued_per_replica: int | None = None  # None: the engine's --max-queued-requests
    # Ray CPUs reserved per engine replica (its torch threads: --num-threads)
    replica_cpus: float = 1.0
    # the ingress is scheduled anywhere; its preprocessing threads take what is free
    ingress_cpus: float = 0.0
    # requests queued per replica the autoscaler aims at (autoscale.py)
    autoscale_target_queued: float = 1.0
    # a scale-up decision must hold this long before replicas are added
    upscale_delay_s: float = 10.0
    # ... and a scale-down decision this long before one is removed
    downscale_delay_s: float = 300.0
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
            raise ValueError(
                "short_replicas and long_replicas go together: give both, or neither for one pool"
            )
        if self.short_replicas.high > 0 and (
            self.short_replicas.low < 1 or self.long_replicas.low < 1
        ):
            raise ValueError("short_replicas and long_replicas must keep at least one replica each")
        if self.replicas.low < 1:
            raise ValueError("replicas must be >= 1")
        if self.max_queued_per_replica is not None and self.max_queued_per_replica < 0:
            raise ValueError("max_queued_per_replica must be >= 0")
        if not self.replica_cpus > 0 or self.ingress_cpus < 0:
            raise ValueError("replica_cpus must be > 0 and ingress_cpus >= 0")
        if not self.autoscale_target_queued > 0:
            raise ValueError("autoscale_target_queued must be > 0")
        if (
            self.upscale_delay_s < 0
            or self.downscale_delay_s < 0
            or not self.autoscale_window_s > 0
        ):
            raise ValueError(
                "upscale_delay_s and downscale_delay_s must be >= 0, autoscale_window_s > 0"
            )

    def pools(self) -> dict[str, ReplicaCount]:
        """Pool name -> its replica count."""
        if self.short_replicas.high:
            return {SHORT_POOL: self.short_replicas, LONG_POOL: self.long_replicas}
        return {SINGLE_POOL: self.replicas}

    def capacity(self, config: ServeConfig) -> int:
        """Requests one replica holds: a full running batch plus its queue."""
        sched = config.engine.scheduler
        queued = (
            sched.max_queued_requests
            if self.max_queued_per_replica is None
            else self.max_queued_per_replica
        )
        return sched.max_num_seqs + queued
