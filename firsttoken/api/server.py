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
server's config): tests pass fakes there.
Bodies are read by api/body.py (each malformed body gets a message that says what is wrong);
preprocessing runs on api/preprocess_pools.py's pools (a light request never waits behind a heavy
one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from dataclasses import replace
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from firsttoken.api.body import read_model
from firsttoken.api.errors import (
    APIError,
    error_response,
    install_error_handlers,
    model_not_found,
)
from firsttoken.api.middleware import RequestContextMiddleware, client_left
from firsttoken.api.observability import Observability
from firsttoken.api.openapi import body_route, errors, openapi_schema
from firsttoken.api.preprocess_pools import PreprocessPools
from firsttoken.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    FunctionCallOut,
    Health,
    ImageTokenInfo,
    VideoTokenInfo,
    ModelCard,
    ModelList,
    NamedToolChoice,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallOut,
)
from firsttoken.api.responses import chat_logprobs, completion_logprobs, usage_of
from firsttoken.api.responses_api import (
    ResponseObject,
    ResponsesRequest,
    finished_response,
    responses_sse,
)
from firsttoken.api.settings import ServedModel
from firsttoken.api.tools import ToolOutput
from firsttoken.api.streaming import (
    ClientDisconnected,
    Collected,
    Echo,
    EngineStreamResponse,
    StreamContext,
    chat_sse,
    collect_outputs,
    completion_sse,
    engine_failure,
)
from firsttoken.config import ServerConfig
from firsttoken.engine.client import EngineClient
from firsttoken.inputs.processor import InputProcessor
from firsttoken.api.intake import Intake
from firsttoken.inputs.prompt import TextPrompt
from firsttoken.metrics.timeline import Timeline
from firsttoken.types import EngineRequest, FinishReason
from firsttoken.version import __version__

T = TypeVar("T")
# nginx's status for "the client went away"; nobody receives it, logs do
CLIENT_CLOSED_REQUEST = 499


class _Slots:
    """Requests in flight, capped (0 = no cap). Owned by one app; touched only on the event loop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def take(self) -> None:
        if self.limit and self.in_use >= self.limit:
            raise APIError(429, f"too many requests in flight (limit {self.limit}); retry later")
        self.in_use += 1

    def give_back(self) -> None:
        self.in_use -= 1


def build_app(
    engine: EngineClient,
    processor: InputProcessor,
    model: ServedModel,
    server: ServerConfig = ServerConfig(),
    observability: Observability | None = None,
) -> FastAPI:
    pools = PreprocessPools(server.num_preprocess_threads)
    # also what a graceful shutdown waits on (app.state.slots)
    slots = _Slots(server.max_concurrent_requests)

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
    app.state.slots = slots
    if observability is not None:  # /metrics /stats /dashboard, API key, per-token timing
        engine = observability.install(app, engine, model.name)
    intake = Intake(processor, engine)
    done: Callable[[str, Timeline], None] = (
        observability.request_done if observability else lambda *_: None
    )

    def closer(ctx: StreamContext) -> Callable[[], None]:
        """A stream's on_close: give back its slot, then complete its metrics record."""

        def close() -> None:
            slots.give_back()
            done(ctx.response_id, ctx.timeline)

        return close

    async def off_loop(pool: Executor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model.name:
            raise model_not_found(requested, model.name)

    def check_alive() -> None:
        if not engine.is_alive:
            raise APIError(503, "the engine is not running")
        if engine.is_draining:
            raise APIError(503, "the server is shutting down; retry on another replica")

    async def start(
        req: ChatCompletionRequest | CompletionRequest | ResponsesRequest, prefix: str
    ) -> tuple[list[EngineRequest], list[int | None], StreamContext]:
        """Common head of both generation routes: one engine request per choice (prompt k // n; a
        seed given is the first choice's, seed + j the j-th's, as vLLM), each preprocessed and
        admitted here, and the choice each waits for (streaming.fan_in). The caller owns the slot
        taken here once this returns."""
        timeline = Timeline(arrival_s=time.monotonic())
        check_model(req.model)
        check_alive()
        slots.take()
        response_id = f"{prefix}{uuid.uuid4().hex}"
        prompts, n, sampling = req.prompts(), req.n, req.to_sampling()
        count = len(prompts) * n
        ids = [response_id] if count == 1 else [f"{response_id}-{k}" for k in range(count)]
        requests: list[EngineRequest] = []
        try:
            for k, request_id in enumerate(ids):
                j = k % n
                choice = (
                    sampling
                    if j == 0 or sampling.seed is None
                    else replace(sampling, seed=sampling.seed + j)
                )
                requests.append(
                    await off_loop(
                        pools.for_request(req),
                        intake.request,
                        prompts[k // n],
                        choice,
                        request_id,
                        timeline.arrival_s,
                    )
                )
        except BaseException:
            slots.give_back()
            for request_id in ids[: len(requests) + 1]:
                engine.release(request_id)  # its admission place, if preprocessing got that far
            raise
        timeline.take_request(requests[0])
        ctx = StreamContext(
            response_id,
            int(time.time()),
            model.name,
            req.include_usage,
            timeline,
            n,
            req.continuous_usage,
        )
        return requests, [None if k % n == 0 else k - k % n for k in range(count)], ctx

    async def respond(
        raw: Request, requests: list[EngineRequest], after: list[int | None], ctx: StreamContext,
        build: Callable[[list[Collected]], Response],
    ) -> Response:
        try:
            collected = await collect_outputs(
                engine, requests, functools.partial(_wait_disconnect, raw), after
            )
        except ClientDisconnected:
            client_left(raw.scope, "answer")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:
            return error_response(*engine_failure(engine, requests[0], exc))
        finally:
            slots.give_back()
        final = collected[0].final
        if final.finish_reason is FinishReason.ERROR:
            return error_response(final.error_status, final.error or "the request failed")
        ctx.timeline.observe(final)
        ctx.timeline.mark_first_byte()
        response = build(collected)
        done(ctx.response_id, ctx.timeline)
        return response

    @app.post(
        "/v1/chat/completions",
        **body_route(
            ChatCompletionRequest, ChatCompletionResponse, *GENERATION_ERRORS, stream=True
        ),
    )
    async def chat_completions(raw: Request) -> Response:
        req = await read_model(raw, ChatCompletionRequest)
        requests, after, ctx = await start(req, "chatcmpl-")
        if req.stream:
            tools = functools.partial(tool_output, req) if req.tool_mode != "none" else None
            return EngineStreamResponse(
                chat_sse(engine, requests, ctx, processor.token_piece, tools, after), closer(ctx)
            )

        def choice(index: int, c: Collected) -> ChatChoice:
            tools = tool_output(req)
            reason = c.final.finish_reason.value if c.final.finish_reason else None
            content, calls = (c.text, []) if tools is None else tools.complete(c.text)
            message = AssistantMessage(
                content=content,
                tool_calls=[
                    ToolCallOut(
                        id=call.id,
                        function=FunctionCallOut(name=call.name, arguments=call.arguments),
                    )
                    for call in calls
                ]
                or None,
            )
            return ChatChoice(
                index=index,
                message=message,
                logprobs=chat_logprobs(c.logprobs, processor.token_piece),
                finish_reason=tools.finish_reason(reason) if tools is not None else reason,
            )

        def build(collected: list[Collected]) -> Response:
            body = ChatCompletionResponse(
                id=ctx.response_id,
                created=ctx.created,
                model=ctx.model,
                choices=[choice(i, c) for i, c in enumerate(collected)],
                usage=usage_of([c.final for c in collected], ctx.timeline, ctx.n),
            )
            return JSONResponse(body.model_dump())

        return await respond(raw, requests, after, ctx, build)

    @app.post(
        "/v1/completions",
        **body_route(CompletionRequest, CompletionResponse, *GENERATION_ERRORS, stream=True),
    )
    async def completions(raw: Request) -> Response:
        req = await read_model(raw, CompletionRequest)
        requests, after, ctx = await start(req, "cmpl-")
        prompts = req.prompts()
        echo = (
            [
                Echo(
                    p.text if isinstance(p, TextPrompt) else processor.decode(p.token_ids),
                    r.prompt_token_ids,
                )
                for p, r in zip((prompts[k // req.n] for k in range(len(requests))), requests)
            ]
            if req.echo
            else []
        )
        if req.stream:
            return EngineStreamResponse(
                completion_sse(engine, requests, ctx, processor.token_piece, after, echo),
                closer(ctx),
            )

        def choice(i: int, c: Collected) -> CompletionChoice:
            lead = echo[i] if echo else None
            scores = (
                [*c.prompt_logprobs, *c.logprobs] if lead is not None and c.logprobs else c.logprobs
            )
            first = lead.token_ids[0] if lead is not None and c.logprobs else None
            return CompletionChoice(
                index=i,
                text=(lead.text if lead is not None else "") + c.text,
                logprobs=completion_logprobs(scores, processor.token_piece, 0, first),
                finish_reason=c.final.finish_reason.value if c.final.finish_reason else None,
            )

        def build(collected: list[Collected]) -> Response:
            choices = [choice(i, c) for i, c in enumerate(collected)]
            body = CompletionResponse(
                id=ctx.response_id,
                created=ctx.created,
                model=ctx.model,
                choices=choices,
                usage=usage_of([c.final for c in collected], ctx.timeline, ctx.n),
            )
            return JSONResponse(body.model_dump())

        return await respond(raw, requests, after, ctx, build)

    @app.post(
        "/v1/responses",
        **body_route(ResponsesRequest, ResponseObject, *GENERATION_ERRORS, stream=True),
    )
    async def responses(raw: Request) -> Response:
        """Stateless: nothing is stored, so a response cannot be retrieved or continued by its id."""
        req = await read_model(raw, ResponsesRequest)
        requests, after, ctx = await start(req, "resp_")
        if req.stream:
            return EngineStreamResponse(responses_sse(engine, requests[0], req, ctx), closer(ctx))

        def build(collected: list[Collected]) -> Response:
            return JSONResponse(
                finished_response(req, ctx, collected[0].text, collected[0].final).model_dump()
            )

        return await respond(raw, requests, after, ctx, build)

    @app.get(
        "/v1/responses/{response_id}",
        status_code=404,
        response_class=Response,
        responses=errors(404),
    )
    async def stored_response(response_id: str) -> Response:
        """``client.responses.retrieve``: nothing is stored, so every id is unknown (with a message that says why)."""
        return error_response(
            404,
            "responses are not stored on this server (it is stateless), so none can be "
            "retrieved by id",
            "response_id",
        )

    @app.post("/tokenize", **body_route(TokenizeRequest, TokenizeResponse, 404))
    async def tokenize(raw: Request) -> Response:
        req = await read_model(raw, TokenizeRequest)
        check_model(req.model)
        pool = pools.for_request(req)
        count = await off_loop(pool, intake.count, req.to_prompt())
        return JSONResponse(
            TokenizeResponse(
                count=count.total,
                max_model_len=model.max_model_len,
                tokens=list(count.token_ids),
                token_strs=[processor.token_piece(t)[0] for t in count.token_ids]
                if req.return_token_strs
                else None,
                num_text_tokens=count.num_text_tokens,
                images=[ImageTokenInfo(**dataclasses.asdict(im)) for im in count.images],
                videos=[VideoTokenInfo(**dataclasses.asdict(v)) for v in count.videos],
                max_input_tokens=processor.max_input_tokens,
                predicted_ttft_s=count.predicted_ttft_s,
            ).model_dump()
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=model.name, root=model.root, max_model_len=model.max_model_len)
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}", responses=errors(404))
    async def model_card(model_id: str) -> ModelCard:
        """``client.models.retrieve(name)``: the served model's card, or 404 in OpenAI's shape."""
        check_model(model_id)
        return ModelCard(id=model.name, root=model.root, max_model_len=model.max_model_len)

    @app.get("/health", response_model=Health, responses=errors(503))
    async def health() -> Health | Response:
        if not engine.is_alive:
            return error_response(503, "the engine is not running")
        if engine.is_draining:
            return error_response(503, "the server is shutting down")
        return Health()

    @app.get("/v1/engine/stats")
    async def engine_stats() -> dict[str, object]:
        return dataclasses.asdict(engine.stats())

    @app.get("/v1/engine/config", responses=errors(404))
    async def engine_config() -> Response:
        if model.engine_config is None:
            return error_response(404, "this server fronts no single engine: ask a replica")
        return JSONResponse(dict(model.engine_config))

    return app


# what a generation route's handler may answer besides 400 (the body) and the layers' errors
# (api/openapi.py): an unknown model, a full server or lane, a stopped or draining engine, a request
# past --request-timeout
GENERATION_ERRORS = (404, 429, 503, 504)
DOCUMENTED_MODELS = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, ResponsesRequest,
                     ChatCompletionResponse, CompletionResponse, ResponseObject, TokenizeResponse)


def tool_output(req: ChatCompletionRequest) -> ToolOutput | None:
    """The answer's tool-call parser, when its tools may be called (api/tools.py)."""
    mode = req.tool_mode
    if mode == "none":
        return None
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    return ToolOutput(mode, frozenset(t.function.name for t in req.tools or ()), named)


async def _wait_disconnect(raw: Request) -> None:
    """Returns when the client disconnects (the body has been read; the next ASGI message is the
    disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass
