"""The OpenAI-compatible HTTP app. Routes stay thin: check the model, take a slot, preprocess off
the event loop, hand the EngineRequest to the engine, frame what comes back.

    POST /v1/chat/completions   stream and non-stream
    POST /v1/completions        plain text prompt
    POST /v1/responses          OpenAI's Responses API, stateless (api/responses_api.py), stream and non-stream;
                                GET /v1/responses/{id} is a 404 saying nothing is stored
    POST /tokenize              chat body or {"prompt"}: token ids + per-image token counts, no model run
    GET  /v1/models             the served model with max_model_len
    GET  /health                200 while engine.is_alive, else 503
    GET  /v1/engine/stats       EngineStats as JSON (KV blocks used/free/cached, running, waiting)
    GET  /v1/engine/config      the configuration the engine runs with, every ``auto`` settled (engine/resolve.py)
    GET  /metrics, /stats, /dashboard   with an Observability: see api/observability.py (also --api-key)

Everything the app uses arrives through ``build_app`` (engine, processor, the served model, the
server's config): tests pass fakes there. It builds the server's state (api/state.py) and includes
the routes, module-level handlers over that state grouped by concern: generation
(api/routes_generation.py) and information (api/routes_info.py).
Bodies are read by api/body.py (each malformed body gets a message that says what is wrong);
preprocessing runs on api/preprocess_pools.py's pools (a light request never waits behind a heavy
one).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from firsttoken.api.errors import install_error_handlers
from firsttoken.api.intake import Intake
from firsttoken.api.middleware import RequestContextMiddleware
from firsttoken.api.observability import Observability
from firsttoken.api.openapi import openapi_schema
from firsttoken.api.preprocess_pools import PreprocessPools
from firsttoken.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from firsttoken.api.responses_api import ResponseObject, ResponsesRequest
from firsttoken.api.routes_generation import router as generation_routes
from firsttoken.api.routes_info import router as info_routes
from firsttoken.api.settings import ServedModel
from firsttoken.api.state import ServerState, Slots
from firsttoken.config import ServerConfig
from firsttoken.engine.client import EngineClient
from firsttoken.inputs.processor import InputProcessor
from firsttoken.version import __version__

DOCUMENTED_MODELS = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, ResponsesRequest,
                     ChatCompletionResponse, CompletionResponse, ResponseObject, TokenizeResponse)


def build_app(
    engine: EngineClient,
    processor: InputProcessor,
    model: ServedModel,
    server: ServerConfig = ServerConfig(),
    observability: Observability | None = None,
) -> FastAPI:
    """The app: middleware, error handlers, the observability routes where given, the state, the
    routes."""
    pools = PreprocessPools(server.num_preprocess_threads)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        pools.shutdown()

    app = FastAPI(title="firsttoken", version=__version__, lifespan=lifespan, redoc_url=None)
    guarded = observability.guards if observability is not None else lambda _: False
    app.openapi = functools.partial(openapi_schema, app, DOCUMENTED_MODELS, guarded)  # type: ignore[method-assign]
    app.add_middleware(
        RequestContextMiddleware,
        max_body_bytes=server.max_request_bytes,
        body_timeout_s=server.request_body_timeout_s,
    )
    install_error_handlers(app)
    if observability is not None:  # /metrics /stats /dashboard, API key, per-token timing
        engine = observability.install(app, engine, model.name)
    state = ServerState(
        engine,
        processor,
        Intake(processor, engine),
        model,
        pools,
        Slots(server.max_concurrent_requests),
        observability.request_done if observability else lambda *_: None,
    )
    app.state.server = state
    app.state.slots = state.slots  # what a graceful shutdown waits on (cli/serve.py)
    app.include_router(generation_routes)
    app.include_router(info_routes)
    return app
