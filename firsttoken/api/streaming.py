"""Server-sent events in vLLM's framing, and the guarantee that a vanished client aborts its request.

Chat stream (fixtures/vllm-0.32/chat-stream-image.txt):
    data: chunk  delta {"role": "assistant", "content": ""}          role only, sent before any token
    data: chunk  delta {"content": "..."}                            one per engine output with text
    data: chunk  delta {"content": "..."}, finish_reason             the last output
    data: chunk  choices [], usage {... "firsttoken": timings}       only with stream_options.include_usage
    data: [DONE]
A request the engine fails mid-stream sends ``data: {"error": {...}}`` then ``data: [DONE]``.

Abort guarantee: ``stream_outputs`` calls ``engine.abort`` in a ``finally`` unless the engine reported the
request finished. It runs whether the client leaves while the request waits, prefills or decodes:
- the task iterating the engine is cancelled (Starlette cancels the response when the client disconnects):
  CancelledError surfaces inside ``stream_outputs``;
- the SSE generator is suspended at a ``yield`` when the transport fails: ``EngineStreamResponse`` always
  ``aclose()``s it, and every generator here closes the one it iterates (``aclosing``).
The abort itself is shielded, so a second cancellation while unwinding cannot skip it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from firsttoken.api.errors import error_body
from firsttoken.api.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    FunctionCallDelta,
    StreamFrames,
    ToolCallDelta,
)
from firsttoken.api.tools import Piece, ToolOutput
from firsttoken.api.responses import (
    TokenPieceFn,
    chat_logprobs,
    completion_logprobs,
    usage_of,
)
from firsttoken.engine.client import EngineClient
from firsttoken.metrics.timeline import Timeline
from firsttoken.types import EngineRequest, FinishReason, RequestOutput, TokenLogprob

logger = logging.getLogger("firsttoken.api")

DONE = "data: [DONE]\n\n"


def sse(data: str) -> str:
    return f"data: {data}\n\n"


@dataclass(frozen=True)
class StreamContext:
    response_id: str  # chatcmpl-... / cmpl-...: the same on every chunk
    created: int  # unix seconds, the same on every chunk
    model: str
    include_usage: bool
    timeline: Timeline  # this request's, owned by the event loop: engine stamps arrive on each output

class EngineStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator (so its ``finally`` blocks run now, not at
    garbage collection) and then calls ``on_close`` (releases the request's concurrency slot)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self._generator = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await asyncio.shield(self._generator.aclose())  # type: ignore[attr-defined]
            finally:
                self._on_close()


async def stream_outputs(engine: EngineClient, request: EngineRequest) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request; ends after the finished one. Aborts unless it finished."""
    outputs = engine.generate(request)
    finished = False
    try:
        async for out in outputs:
            finished = out.finished
            yield out
            if finished:
                return
    finally:
        if not finished:
            await _shielded(engine.abort(request.request_id))
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await _shielded(aclose())


async def _shielded(awaitable: Awaitable[None]) -> None:
    """Run to completion even if the caller is cancelled meanwhile (the caller still sees its cancellation)."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})  # let the abort land, then keep unwinding
        raise


@dataclass
class Collected:
    text: str
    logprobs: list[TokenLogprob]
    final: RequestOutput


class ClientDisconnected(Exception):
    pass


async def collect_outputs(
    engine: EngineClient, request: EngineRequest, wait_disconnect: Callable[[], Awaitable[None]]
) -> Collected:
    """Run a non-streaming request to the end, aborting it if the client disconnects first."""

    async def run() -> Collected:
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        async with aclosing(stream_outputs(engine, request)) as outputs:
            async for out in outputs:
                parts.append(out.new_text)
                logprobs.extend(out.logprobs)
                if out.finished:
                    return Collected("".join(parts), logprobs, out)
        raise RuntimeError("engine stream ended without a finished output")

    generation = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not generation.done():
            generation.cancel()  # stream_outputs aborts the request in its finally
            await asyncio.wait({generation})
    if generation.cancelled():
        raise ClientDisconnected()
    return generation.result()


async def chat_sse(
    engine: EngineClient, request: EngineRequest, ctx: StreamContext, piece: TokenPieceFn,
    tools: ToolOutput | None = None,
) -> AsyncIterator[str]:
    frames = StreamFrames("chat.completion.chunk", ctx.response_id, ctx.created, ctx.model)

    def chunk(out: RequestOutput, finish_reason: str | None) -> str:
        content = out.new_text or None
        if not out.logprobs:
            return frames.chat(content, finish_reason)
        logprobs = chat_logprobs(out.logprobs, piece)
        choice = ChatChunkChoice(delta=DeltaMessage(content=content), logprobs=logprobs, finish_reason=finish_reason)
        return sse(
            ChatCompletionChunk(id=ctx.response_id, created=ctx.created, model=ctx.model, choices=[choice]).to_json()
        )

    def tool_chunks(out: RequestOutput, finish_reason: str | None) -> list[str]:
        """The output's text through the tool-call parser: content deltas and tool-call deltas."""
        assert tools is not None
        pieces = tools.feed(out.new_text) + (tools.finish() if out.finished else [])
        frames_out = [frames.chat(p.content) if p.content is not None else sse(ChatCompletionChunk(
            id=ctx.response_id, created=ctx.created, model=ctx.model, choices=[ChatChunkChoice(delta=DeltaMessage(
                tool_calls=[tool_delta(p)]))]).to_json()) for p in pieces]
        if finish_reason is not None:
            frames_out.append(frames.chat(None, tools.finish_reason(finish_reason)))
        return frames_out

    yield frames.chat("", role=True)
    async with aclosing(_guarded(engine, request)) as outputs:
        async for out in outputs:
            if isinstance(out, str):  # an error event
                yield out
                yield DONE
                return
            finish = out.finish_reason.value if out.finished and out.finish_reason else None
            ctx.timeline.observe(out)
            if tools is not None:
                for frame in tool_chunks(out, finish):
                    yield frame
                    ctx.timeline.mark_first_byte()
            elif out.new_text or out.logprobs or finish:
                yield chunk(out, finish)
                if out.new_text:
                    ctx.timeline.mark_first_byte()  # resumed: the chunk has been handed to the transport
            if out.finished and ctx.include_usage:
                usage = usage_of(out, ctx.timeline)
                yield sse(
                    ChatCompletionChunk(
                        id=ctx.response_id, created=ctx.created, model=ctx.model, choices=[], usage=usage
                    ).to_json()
                )
    yield DONE


def tool_delta(p: Piece) -> ToolCallDelta:
    """A parser piece of a call as OpenAI's delta: id, type and name on a call's first delta, arguments after."""
    return ToolCallDelta(index=p.index or 0, id=p.call_id, type="function" if p.call_id else None,
                         function=FunctionCallDelta(name=p.name, arguments=p.arguments))


async def completion_sse(
    engine: EngineClient, request: EngineRequest, ctx: StreamContext, piece: TokenPieceFn
) -> AsyncIterator[str]:
    text_len = 0
    frames = StreamFrames("text_completion", ctx.response_id, ctx.created, ctx.model)
    async with aclosing(_guarded(engine, request)) as outputs:
        async for out in outputs:
            if isinstance(out, str):
                yield out
                yield DONE
                return
            ctx.timeline.observe(out)
            finish = out.finish_reason.value if out.finished and out.finish_reason else None
            if out.new_text or out.logprobs or finish:
                if out.logprobs:
                    choice = CompletionChoice(text=out.new_text, finish_reason=finish,
                                              logprobs=completion_logprobs(out.logprobs, piece, text_len))
                    body = CompletionResponse(id=ctx.response_id, created=ctx.created, model=ctx.model,
                                              choices=[choice])
                    yield sse(body.to_json())
                else:
                    yield frames.completion(out.new_text, finish)
                text_len += len(out.new_text)
                if out.new_text:
                    ctx.timeline.mark_first_byte()
            if out.finished and ctx.include_usage:
                usage = usage_of(out, ctx.timeline)
                body = CompletionResponse(
                    id=ctx.response_id, created=ctx.created, model=ctx.model, choices=[], usage=usage
                )
                yield sse(body.to_json())
    yield DONE


async def _guarded(engine: EngineClient, request: EngineRequest) -> AsyncIterator[RequestOutput | str]:
    """Outputs, with an engine failure turned into one SSE error event (str) instead of a broken stream."""
    try:
        async with aclosing(stream_outputs(engine, request)) as outputs:
            async for out in outputs:
                if out.finish_reason is FinishReason.ERROR:
                    yield sse(json.dumps(error_body(out.error_status, out.error or "the request failed")))
                    return
                yield out
    except Exception as exc:
        yield sse(json.dumps(error_body(*engine_failure(engine, request, exc))))


def engine_failure(engine: EngineClient, request: EngineRequest, exc: Exception) -> tuple[int, str]:
    """(status, client-safe message) for an exception raised by ``engine.generate``:
    a stopped engine is 503; a ValueError is the engine refusing the request at admission (its message is
    written for the client), 400; anything else is logged and becomes a generic 500."""
    if not engine.is_alive:
        return 503, "the engine is not running"
    if isinstance(exc, ValueError):
        return 400, str(exc)
    logger.error("engine failed on request %s", request.request_id, exc_info=exc)
    return 500, f"internal server error (request {request.request_id})"
