"""The ingress deployment: the ordinary firsttoken HTTP app (api/server.py: the same OpenAI routes,
body checks, schema and limits, errors in OpenAI's shape, SSE, disconnect -> abort) over a
``FleetEngineClient`` instead of an in-process engine. Serve's HTTP proxy hands it every request
(``@serve.ingress()``, the app built at replica start by ``__serve_build_asgi_app__``, once a
replica has told it the model's facts).

Everything cheap happens here before a replica is asked: the body and schema, the sampling fields,
text size, token and image counting from headers, the context and KV limits, the pool's queue bound
(429); images are decoded and patchified here too (the replica receives pixel patches, never URLs or
bytes), on the ingress's own preprocessing pools.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI

from firsttoken.api.observability import observability_from_config
from firsttoken.api.server import build_app
from firsttoken.api.settings import ServedModel
from firsttoken.config import ServeConfig
from firsttoken.inputs.processor import load_tokenizer
from firsttoken.serving.options import ReplicaCount
from firsttoken.assembly import build_processor, model_dir_of
from firsttoken.serving.fleet import FleetEngineClient, Pool
from firsttoken.serving.metrics import merge_expositions
from firsttoken.serving.replica import ReplicaFacts


class Ingress:
    def __init__(
        self, config: ServeConfig, pools: Mapping[str, tuple[Any, ReplicaCount]], capacity: int
    ) -> None:
        """``pools``: pool name -> (handle to its EngineReplica deployment, its replica count);
        ``capacity``: requests one replica holds (running + waiting)."""
        self.config = config
        self.pools = {
            name: Pool(name, handle, count, capacity) for name, (handle, count) in pools.items()
        }
        self._refresh: asyncio.Task | None = None

    async def __serve_build_asgi_app__(self) -> FastAPI:
        first = next(iter(self.pools.values()))
        facts: ReplicaFacts = await first.handle.facts.remote()
        sched = self.config.engine.scheduler
        fleet = FleetEngineClient(
            self.pools, facts, sched.long_prompt_threshold, sched.decode_reserve_tokens
        )
        model_dir = model_dir_of(self.config)
        tokenizer = load_tokenizer(model_dir, self.config.chat_template)

        async def with_replicas(own: bytes) -> bytes:
            reports = await fleet.reports("metrics")
            return merge_expositions([(r.replica, r.metrics) for r in reports], ingress=own)

        observability = observability_from_config(
            self.config.server, tokenizer, merge_metrics=with_replicas
        )
        processor = build_processor(
            self.config,
            model_dir,
            tokenizer,
            facts.model_config,
            facts.max_model_len,
        )
        served = ServedModel(facts.served_model_name, facts.max_model_len, facts.model_dir)
        await fleet.refresh()
        self._refresh = asyncio.get_running_loop().create_task(fleet.refresh_forever())
        return build_app(fleet, processor, served, self.config.server, observability)
