"""What every route handler reads, and the steps the generation routes share.

``ServerState`` is built once by ``build_app`` (api/server.py) and kept on ``app.state.server``: the
engine client, the input processor and its intake, the served model, the preprocessing pools, the
request slots (what a graceful shutdown waits on) and what completes a request's metrics record.
Handlers are module-level functions (api/routes_generation.py, api/routes_info.py) that take it
with ``state_of(raw)``; ``start`` and ``respond`` are the head and tail of every generation route.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from firsttoken.api.errors import APIError, error_response, model_not_found
from firsttoken.api.intake import Intake
from firsttoken.api.middleware import client_left
from firsttoken.api.preprocess_pools import PreprocessPools
from firsttoken.api.protocol import ChatCompletionRequest, CompletionRequest
from firsttoken.api.responses_api import ResponsesRequest
from firsttoken.api.settings import ServedModel
from firsttoken.api.streaming import (
    ClientDisconnected,
    Collected,
    StreamContext,
    collect_outputs,
    engine_failure,
)
from firsttoken.engine.client import EngineClient
from firsttoken.inputs.processor import InputProcessor
from firsttoken.metrics.timeline import Timeline
from firsttoken.types import EngineRequest, FinishReason

T = TypeVar("T")
# nginx's status for "the client went away"; nobody receives it, logs do
CLIENT_CLOSED_REQUEST = 499


class Slots:
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


@dataclass
class ServerState:
    engine: EngineClient  # behind the observability's wrapper, where there is one
    processor: InputProcessor
    intake: Intake
    model: ServedModel
    pools: PreprocessPools
    slots: Slots
    # completes a request's metrics record (response id, its timeline)
    done: Callable[[str, Timeline], None]


def state_of(raw: Request) -> ServerState:
    return raw.app.state.server


def check_model(state: ServerState, requested: str | None) -> None:
    if requested is not None and requested != state.model.name:
        raise model_not_found(requested, state.model.name)


def check_alive(state: ServerState) -> None:
    if not state.engine.is_alive:
        raise APIError(503, "the engine is not running")
    if state.engine.is_draining:
        raise APIError(503, "the server is shutting down; retry on another replica")


def closer(state: ServerState, ctx: StreamContext) -> Callable[[], None]:
    """A stream's on_close: give back its slot, then complete its metrics record."""

    def close() -> None:
        state.slots.give_back()
        state.done(ctx.response_id, ctx.timeline)

    return close


async def off_loop(pool: Executor, fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


async def start(
    state: ServerState, req: ChatCompletionRequest | CompletionRequest | ResponsesRequest, prefix: str
) -> tuple[list[EngineRequest], list[int | None], StreamContext]:
    """Common head of both generation routes: one engine request per choice (prompt k // n; a
    seed given is the first choice's, seed + j the j-th's, as vLLM), each preprocessed and
    admitted here, and the choice each waits for (streaming.fan_in). The caller owns the slot
    taken here once this returns."""
    timeline = Timeline(arrival_s=time.monotonic())
    check_model(state, req.model)
    check_alive(state)
    state.slots.take()
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
                    state.pools.for_request(req),
                    state.intake.request,
                    prompts[k // n],
                    choice,
                    request_id,
                    timeline.arrival_s,
                )
            )
    except BaseException:
        state.slots.give_back()
        for request_id in ids[: len(requests) + 1]:
            state.engine.release(request_id)  # its admission place, if preprocessing got that far
        raise
    timeline.take_request(requests[0])
    ctx = StreamContext(
        response_id,
        int(time.time()),
        state.model.name,
        req.include_usage,
        timeline,
        n,
        req.continuous_usage,
    )
    return requests, [None if k % n == 0 else k - k % n for k in range(count)], ctx



async def respond(
    state: ServerState, raw: Request, requests: list[EngineRequest], after: list[int | None], ctx: StreamContext,
    build: Callable[[list[Collected]], Response],
) -> Response:
    try:
        collected = await collect_outputs(
            state.engine, requests, functools.partial(_wait_disconnect, raw), after
        )
    except ClientDisconnected:
        client_left(raw.scope, "answer")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except Exception as exc:
        return error_response(*engine_failure(state.engine, requests[0], exc))
    finally:
        state.slots.give_back()
    final = collected[0].final
    if final.finish_reason is FinishReason.ERROR:
        return error_response(final.error_status, final.error or "the request failed")
    ctx.timeline.observe(final)
    ctx.timeline.mark_first_byte()
    response = build(collected)
    state.done(ctx.response_id, ctx.timeline)
    return response



async def _wait_disconnect(raw: Request) -> None:
    """Returns when the client disconnects (the body has been read; the next ASGI message is the
    disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass
