"""The ingress's /metrics: every engine replica's own exposition (its firsttoken_* families, the
vllm:* gauges, its process) merged into one, each series labelled ``replica="<pool>/<id>"``, so a
gateway or Prometheus sees one target and can still tell replicas apart (``sum by (replica)``). The
ingress adds what only it sees: the requests it refused before any replica was asked
(``firsttoken_rejections``, ``replica="ingress"``).

Request histograms (TTFT, phases, tokens) are the replicas' records, completed from the engine's
stamps: the ingress-to-client leg is not in them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"
INGRESS = "ingress"  # the replica label of the ingress's own series
# what the ingress contributes from its own registry
INGRESS_FAMILIES = frozenset({"firsttoken_rejections"})


class _Merged:
    """An unchecked collector over families already parsed and relabelled."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_expositions(parts: Sequence[tuple[str, bytes]], ingress: bytes = b"") -> bytes:
    """Prometheus text of ``parts`` ((replica, its exposition)) as one exposition, each series
    labelled with its replica; ``ingress``'s families named in INGRESS_FAMILIES (by name as parsed:
    counters without ``_total``) join labelled ``replica="ingress"``."""
    merged: dict[str, Metric] = {}
    sources = [(INGRESS, ingress, INGRESS_FAMILIES), *((name, text, None) for name, text in parts)]
    for replica, text, keep in sources:
        for family in text_string_to_metric_families(text.decode("utf-8")):
            if keep is not None and family.name not in keep:
                continue
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            target.samples.extend(
                Sample(
                    s.name, {**s.labels, REPLICA_LABEL: replica}, s.value, s.timestamp, s.exemplar
                )
                for s in family.samples
            )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)
