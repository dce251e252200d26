"""One engine replica: a Ray Serve deployment that owns one firsttoken engine (the engine thread and
its asyncio bridge, engine/async_engine.py), no HTTP. It takes already-validated, preprocessed
requests (``EngineRequest``: token ids, decoded image patches, sampling) from the ingress and
streams ``RequestOutput`` values back through a streaming handle
(``handle.options(stream=True).generate.remote(request, hints=...)``).

Contract:
- ``generate`` never raises for a request's own failure: a refusal or failure is one final output
  with ``FinishReason.ERROR``, a client-safe ``error`` and its HTTP ``error_status`` (400 never
  fits, 503 the engine stopped: retryable, 500 anything else, logged here). Cancelling the call (the
  ingress's client left) cancels the generator, which aborts the request in the engine (its blocks
  freed within one step).
- ``record_routing_stats`` (called by Serve every ``request_routing_stats_period_s``) reports the
  load the router balances on: running, waiting, free KV blocks.
- ``record_autoscaling_stats`` (called by Serve every metrics interval of an autoscaled pool)
  reports waiting and running requests, what serving/autoscale.py's policy scales on.
- ``check_health`` (called by Serve) fails once the engine loop has died: Serve replaces the
  replica.
- ``facts``, ``stats`` and ``metrics`` answer the ingress's start-up question and its fan-out
  (``handle.broadcast``) for /v1/engine/stats and /metrics.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import generate_latest

from firsttoken.api.observability import engine_snapshot
from firsttoken.assembly import build_engine, model_dir_of, served_name_of
from firsttoken.config import ServeConfig
from firsttoken.engine.async_engine import AsyncEngine, EngineDeadError
from firsttoken.inputs.processor import load_tokenizer
from firsttoken.metrics.prometheus import make_registry
from firsttoken.metrics.recorder import Recorder
from firsttoken.models.model_config import ModelConfig
from firsttoken.serving.autoscale import NUM_RUNNING, NUM_WAITING
from firsttoken.serving.routing import RoutingHints
from firsttoken.types import EngineRequest, EngineStats, FinishReason, RequestOutput

log = logging.getLogger("firsttoken.serving")

ENGINE_STOPPED = "the engine replica serving this request stopped; retry the request"


@dataclass(frozen=True)
class ReplicaFacts:
    """What the ingress needs to know before its first request: the model's shape for the input
    processor and the limits every replica of a pool shares (same config, same checkpoint)."""

    model_config: ModelConfig
    max_model_len: int
    served_model_name: str
    model_dir: str
    kv_blocks_total: int
    block_size: int


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's answer to a fan-out: which replica (the ``replica`` label), and what it
    says."""

    replica: str  # "<pool>/<Serve's replica id>": a restarted replica is a new one
    stats: EngineStats
    metrics: bytes = b""  # Prometheus text of its own registry, when asked for


class EngineReplica:
    def __init__(self, config: ServeConfig, pool: str, fault_hook: Any = None) -> None:
        """``fault_hook``: the runner's test seam (runner.model_runner.FaultHook, pickled to the
        replica), None in production."""
        from ray import serve

        model_dir = model_dir_of(config)
        tokenizer = load_tokenizer(model_dir, config.chat_template)
        # Request records complete here from the engine's own stamps (no transport to wait for):
        # grace 0.
        self.recorder = Recorder(window_s=config.server.stats_window_s, grace_s=0.0)
        self.engine = AsyncEngine(build_engine(config, model_dir, tokenizer, self.recorder, fault_hook),
                                  on_abort=self.recorder.on_aborted)
        self.engine.start()
        engine = self.engine.engine
        self.name = f"{pool}/{serve.get_replica_context().replica_id.unique_id}"
        self._facts = ReplicaFacts(
            engine.model_config,
            engine.max_model_len,
            served_name_of(config, model_dir),
            str(model_dir),
            engine.stats().kv_blocks_total,
            config.engine.cache.block_size,
        )
        self.registry = make_registry(self.recorder, lambda: engine_snapshot(self.engine.stats()),
                                      self._facts.served_model_name)
        log.info("engine replica %s ready (%d KV blocks)", self.name, self._facts.kv_blocks_total)

    async def generate(
        self, request: EngineRequest, hints: RoutingHints | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, the last one finished. ``hints`` are the router's
        (serving/router.py)."""
        try:
            async for out in self.engine.generate(request):
                yield out
        except ValueError as exc:  # refused at admission: the message is written for the client
            yield error_output(request, str(exc), 400)
        except EngineDeadError:
            yield error_output(request, ENGINE_STOPPED, 503)
        except Exception:
            log.exception("engine replica %s failed on request %s", self.name, request.request_id)
            yield error_output(request, f"internal server error (request {request.request_id})", 500)

    def record_routing_stats(self) -> dict[str, int]:
        s = self.engine.stats()
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_free_kv_blocks": s.kv_blocks_free,
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What an autoscaled pool's policy reads (serving/autoscale.py); Serve asks every metrics
        interval."""
        s = self.engine.stats()
        return {NUM_WAITING: float(s.num_waiting), NUM_RUNNING: float(s.num_running)}

    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise RuntimeError(f"engine replica {self.name}: the engine loop has stopped")

    def facts(self) -> ReplicaFacts:
        return self._facts

    def stats(self) -> ReplicaReport:
        return ReplicaReport(self.name, self.engine.stats())

    def metrics(self) -> ReplicaReport:
        return ReplicaReport(self.name, self.engine.stats(), generate_latest(self.registry))

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)  # absent when __init__ failed
        if engine is not None:
            engine.shutdown(timeout_s=1.0)


def error_output(request: EngineRequest, message: str, status: int) -> RequestOutput:
    """The one output that ends ``request`` with an error (``status``: its HTTP status)."""
    return RequestOutput(
        request.request_id,
        (),
        "",
        True,
        FinishReason.ERROR,
        request.num_prompt_tokens,
        0,
        error=message,
        error_status=status,
    )
