"""Server-sent events in vLLM's framing, and the guarantee that a vanished client aborts its
request.

Chat stream (fixtures/vllm-0.32/chat-stream-image.txt):
    data: chunk  delta {"role": "assistant", "content": ""}          role only, sent before any token
    data: chunk  delta {"content": "..."}                            one per engine output with text
    data: chunk  delta {"content": "..."}, finish_reason             the last output
    data: chunk  choices [], usage {... "firsttoken": timings}       only with stream_options.include_usage
    data: [DONE]
Every token chunk of a choice, whatever made its delta (the text, or the tool-call parser), carries
that output's ``logprobs`` when asked, and with ``continuous_usage_stats`` every chunk (the role
chunk too) its choice's usage so far. A request the engine fails mid-stream sends
``data: {"error": {...}}`` then ``data: [DONE]``.

Abort guarantee: ``stream_outputs`` calls ``engine.abort`` in a ``finally`` unless the engine
reported the request finished. It runs whether the client leaves while the request waits, prefills
or decodes:
- the task iterating the engine is cancelled (Starlette cancels the response when the client
  disconnects): CancelledError surfaces inside ``stream_outputs``;
- the SSE generator is suspended at a ``yield`` when the transport fails: ``EngineStreamResponse``
  always ``aclose()``s it, and every generator here closes the one it iterates (``aclosing``).
The abort itself is shielded, so a second cancellation while unwinding cannot skip it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from firsttoken.api.errors import error_body
from firsttoken.api.middleware import client_left
from firsttoken.api.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    FunctionCallDelta,
    StreamFrames,
    ToolCallDelta,
    Usage,
)
from firsttoken.api.tool_calls import Piece, ToolOutput
from firsttoken.api.logprobs_usage import (
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
    timeline: Timeline  # choice 0's, owned by the event loop: engine stamps arrive on each output
    # choices per prompt (choice k is prompt k // n): a prompt's tokens count once in the usage
    n: int = 1
    # stream_options.continuous_usage_stats: every chunk carries its choice's usage
    continuous_usage: bool = False

class EngineStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator (so its ``finally`` blocks run now,
    not at garbage collection) and then calls ``on_close`` (releases the request's concurrency
    slot). A client that leaves before the stream's end (Starlette sees its ``http.disconnect``; an
    ASGI 2.4 server raises ClientDisconnect on the next send) is a disconnect at stage "answer"
    (middleware.client_left), never an error."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self._generator = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        left = False
        # the last body message is on its way: a disconnect from here on is the answer's end
        complete = False

        async def watched_send(message: Message) -> None:
            nonlocal complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # set before the send: the server reports the end as http.disconnect at once
                complete = True
            await send(message)

        # Starlette listens for the disconnect while it streams
        async def watched_receive() -> Message:
            nonlocal left
            message = await receive()
            left = left or (message["type"] == "http.disconnect" and not complete)
            return message

        try:
            await super().__call__(scope, watched_receive, watched_send)
        except ClientDisconnect:
            left = left or not complete
        finally:
            if left:
                client_left(scope, "answer")
            try:
                await asyncio.shield(self._generator.aclose())  # type: ignore[attr-defined]
            finally:
                self._on_close()


async def stream_outputs(
    engine: EngineClient, request: EngineRequest
) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request; ends after the finished one. Aborts unless it
    finished."""
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
    """Run to completion even if the caller is cancelled meanwhile (the caller still sees its
    cancellation)."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})  # let the abort land, then keep unwinding
        raise


async def fan_in(engine: EngineClient, requests: Sequence[EngineRequest],
                 after: Sequence[int | None] = ()) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of a response's requests (its choices) as (index, output), each request's in
    order; ends once all have finished. ``after[i]``: the choice whose first output request i waits
    for before it starts (an earlier choice of the same prompt: by then that prompt's KV blocks are
    in the prefix cache and its images encoded, so the prompt is prefilled once), or None. Leaving
    early aborts what still runs and releases what never started."""
    if len(requests) == 1:
        async with aclosing(stream_outputs(engine, requests[0])) as outputs:
            async for out in outputs:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue(
        maxsize=64 * len(requests)
    )
    started = [asyncio.Event() for _ in requests]

    async def pump(i: int) -> None:
        submitted = False
        try:
            first = after[i] if i < len(after) else None
            if first is not None:
                await started[first].wait()
            submitted = True
            async with aclosing(stream_outputs(engine, requests[i])) as outputs:
                async for out in outputs:
                    started[i].set()
                    await queue.put((i, out))
        except Exception as exc:  # (a refusal at admission: the response's error)
            await queue.put((i, exc))
        finally:
            started[i].set()
            if not submitted:
                engine.release(requests[i].request_id)  # its admission place

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(requests))]
    try:
        left = len(requests)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield i, item
            left -= item.finished
    finally:
        for task in tasks:
            task.cancel()
        await _shielded(asyncio.wait(tasks))


@dataclass
class Collected:
    text: str
    logprobs: list[TokenLogprob]
    final: RequestOutput
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.. (with echo + logprobs)


@dataclass(frozen=True)
class Echo:
    """An echoed prompt (completions' ``echo``): its text and token ids."""

    text: str
    token_ids: tuple[int, ...]


class ClientDisconnected(Exception):
    pass


async def collect_outputs(
    engine: EngineClient,
    requests: Sequence[EngineRequest],
    wait_disconnect: Callable[[], Awaitable[None]],
    after: Sequence[int | None] = (),
) -> list[Collected]:
    """Run a non-streaming response's requests to the end (``fan_in``), aborting them if the client
    disconnects first. One failed request ends the response: the list is then that one alone."""

    async def run() -> list[Collected]:
        parts: list[list[str]] = [[] for _ in requests]
        logprobs: list[list[TokenLogprob]] = [[] for _ in requests]
        scored: list[tuple[TokenLogprob, ...]] = [() for _ in requests]
        done: dict[int, Collected] = {}
        async with aclosing(fan_in(engine, requests, after)) as outputs:
            async for i, out in outputs:
                parts[i].append(out.new_text)
                logprobs[i].extend(out.logprobs)
                scored[i] = out.prompt_logprobs or scored[i]
                if out.finished:
                    done[i] = Collected("".join(parts[i]), logprobs[i], out, scored[i])
                    if out.finish_reason is FinishReason.ERROR:
                        return [done[i]]
        if len(done) < len(requests):
            raise RuntimeError("engine stream ended without a finished output")
        return [done[i] for i in range(len(requests))]

    generation = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not generation.done():
            generation.cancel()  # stream_outputs aborts the requests in its finally
            await asyncio.wait({generation})
    if generation.cancelled():
        raise ClientDisconnected()
    return generation.result()


class _ChatChunks:
    """Chat chunks of one streamed answer: each choice's deltas (its text as it comes, or what its
    tool-call parser makes of it) framed with what the request asked for beyond the text: each
    output's logprobs, and with continuous usage the choice's usage so far."""

    def __init__(self, ctx: StreamContext, piece: TokenPieceFn, num_choices: int,
                 tools: Callable[[], ToolOutput] | None) -> None:
        self.ctx = ctx
        self.piece = piece
        self.frames = StreamFrames("chat.completion.chunk", ctx.response_id, ctx.created, ctx.model)
        self.parsers = [tools() for _ in range(num_choices)] if tools is not None else None

    def deltas(self, i: int, out: RequestOutput) -> list[DeltaMessage]:
        """Choice i's deltas for one output: its new text, or what the choice's tool-call parser
        makes of it (content deltas and tool-call deltas)."""
        if self.parsers is None:
            return [DeltaMessage(content=out.new_text)] if out.new_text else []
        parser = self.parsers[i]
        pieces = parser.feed(out.new_text) + (parser.finish() if out.finished else [])
        return [
            DeltaMessage(content=p.content)
            if p.content is not None
            else DeltaMessage(tool_calls=[tool_delta(p)])
            for p in pieces
        ]

    def finish_reason(self, i: int, finish: str | None) -> str | None:
        # a tool-call parser decides once it has read the whole answer
        return self.parsers[i].finish_reason(finish) if self.parsers is not None else finish

    def chunks(
        self,
        i: int,
        deltas: list[DeltaMessage],
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprob],
        usage: Usage | None,
    ) -> list[str]:
        """Choice i's chunks, one per delta (an empty delta when there is none but logprobs or a
        finish reason to send): ``logprobs`` ride the first, ``finish_reason`` the last, ``usage``
        (None: not asked for) each."""
        ctx = self.ctx
        if not deltas and (logprobs or finish_reason):
            deltas = [DeltaMessage()]
        out: list[str] = []
        for k, delta in enumerate(deltas):
            reason = finish_reason if k == len(deltas) - 1 else None
            scores = logprobs if k == 0 else ()
            if not scores and usage is None and delta.tool_calls is None:
                out.append(self.frames.chat(delta.content, reason, role=delta.role is not None,
                                            index=i))
                continue
            choice = ChatChunkChoice(index=i, delta=delta, logprobs=chat_logprobs(scores, self.piece),
                                     finish_reason=reason)
            out.append(
                sse(
                    ChatCompletionChunk(
                        id=ctx.response_id,
                        created=ctx.created,
                        model=ctx.model,
                        choices=[choice],
                        usage=usage,
                    ).to_json()
                )
            )
        return out


async def chat_sse(
    engine: EngineClient,
    requests: Sequence[EngineRequest],
    ctx: StreamContext,
    piece: TokenPieceFn,
    tools: Callable[[], ToolOutput] | None = None,
    after: Sequence[int | None] = (),
) -> AsyncIterator[str]:
    """``tools``: a fresh tool-call parser per choice (None: no tools). Whatever makes a choice's
    deltas, every chunk is framed by ``_ChatChunks.chunks``."""
    framer = _ChatChunks(ctx, piece, len(requests), tools)
    finals: dict[int, RequestOutput] = {}
    for i, request in enumerate(requests):
        usage = running_usage(request.num_prompt_tokens, 0) if ctx.continuous_usage else None
        for frame in framer.chunks(i, [DeltaMessage(role="assistant", content="")], None, (), usage):
            yield frame
    async with aclosing(guarded_outputs(engine, requests, after)) as outputs:
        async for item in outputs:
            if isinstance(item, str):  # an error event
                yield item
                yield DONE
                return
            i, out = item
            finish = out.finish_reason.value if out.finished and out.finish_reason else None
            if i == 0:
                ctx.timeline.observe(out)
            new = framer.deltas(i, out)
            finish = framer.finish_reason(i, finish)
            usage = (
                running_usage(out.num_prompt_tokens, out.num_output_tokens)
                if ctx.continuous_usage
                else None
            )
            # choice 0's timeline: text or a call
            visible = i == 0 and any(d.content or d.tool_calls for d in new)
            for frame in framer.chunks(i, new, finish, out.logprobs, usage):
                yield frame
                if visible:
                    # resumed: the chunk has been handed to the transport
                    ctx.timeline.mark_first_byte()
            if out.finished:
                finals[i] = out
    if ctx.include_usage:
        usage = usage_of([finals[i] for i in range(len(requests))], ctx.timeline, ctx.n)
        yield sse(
            ChatCompletionChunk(
                id=ctx.response_id, created=ctx.created, model=ctx.model, choices=[], usage=usage
            ).to_json()
        )
    yield DONE


def running_usage(num_prompt_tokens: int, num_output_tokens: int) -> Usage:
    """A choice's usage so far (stream_options.continuous_usage_stats, as vLLM)."""
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_output_tokens,
                 total_tokens=num_prompt_tokens + num_output_tokens)


def tool_delta(p: Piece) -> ToolCallDelta:
    """A parser piece of a call as OpenAI's delta: id, type and name on a call's first delta,
    arguments after."""
    return ToolCallDelta(index=p.index or 0, id=p.call_id, type="function" if p.call_id else None,
                         function=FunctionCallDelta(name=p.name, arguments=p.arguments))


async def completion_sse(
    engine: EngineClient,
    requests: Sequence[EngineRequest],
    ctx: StreamContext,
    piece: TokenPieceFn,
    after: Sequence[int | None] = (),
    echo: Sequence[Echo] = (),
) -> AsyncIterator[str]:
    """``echo`` (one per choice, or none): each choice's first chunk leads with its prompt (and its
    scores)."""
    text_len = [0] * len(requests)
    finals: dict[int, RequestOutput] = {}
    echoed: set[int] = set()
    frames = StreamFrames("text_completion", ctx.response_id, ctx.created, ctx.model)
    async with aclosing(guarded_outputs(engine, requests, after)) as outputs:
        async for item in outputs:
            if isinstance(item, str):
                yield item
                yield DONE
                return
            i, out = item
            if i == 0:
                ctx.timeline.observe(out)
            finish = out.finish_reason.value if out.finished and out.finish_reason else None
            lead: Echo | None = None
            if echo and i not in echoed:
                echoed.add(i)
                lead = echo[i]
            if out.new_text or out.logprobs or finish or lead is not None:
                if out.logprobs or ctx.continuous_usage or lead is not None:
                    scores = out.logprobs
                    if lead is not None and out.logprobs:
                        scores = (*out.prompt_logprobs, *out.logprobs)
                    logprobs = completion_logprobs(
                        scores,
                        piece,
                        text_len[i],
                        lead.token_ids[0] if lead is not None and out.logprobs else None,
                    )
                    text = (lead.text if lead is not None else "") + out.new_text
                    choice = CompletionChoice(
                        index=i, text=text, finish_reason=finish, logprobs=logprobs
                    )
                    usage = (
                        running_usage(out.num_prompt_tokens, out.num_output_tokens)
                        if ctx.continuous_usage
                        else None
                    )
                    body = CompletionResponse(
                        id=ctx.response_id,
                        created=ctx.created,
                        model=ctx.model,
                        choices=[choice],
                        usage=usage,
                    )
                    yield sse(body.to_json())
                else:
                    yield frames.completion(out.new_text, finish, index=i)
                text_len[i] += len(out.new_text) + (len(lead.text) if lead is not None else 0)
                if out.new_text and i == 0:
                    ctx.timeline.mark_first_byte()
            if out.finished:
                finals[i] = out
    if ctx.include_usage:
        usage = usage_of([finals[i] for i in range(len(requests))], ctx.timeline, ctx.n)
        body = CompletionResponse(
            id=ctx.response_id, created=ctx.created, model=ctx.model, choices=[], usage=usage
        )
        yield sse(body.to_json())
    yield DONE


def error_event(status: int, message: str) -> str:
    """A failed stream's error event in chat and completions framing: ``data: {"error": {...}}``."""
    return sse(json.dumps(error_body(status, message)))


async def guarded_outputs(
    engine: EngineClient, requests: Sequence[EngineRequest], after: Sequence[int | None] = (),
    on_error: Callable[[int, str], str] = error_event,
) -> AsyncIterator[tuple[int, RequestOutput] | str]:
    """Outputs, with an engine failure turned into one SSE error event (str,
    ``on_error(status, message)``) instead of a broken stream."""
    try:
        async with aclosing(fan_in(engine, requests, after)) as outputs:
            async for i, out in outputs:
                if out.finish_reason is FinishReason.ERROR:
                    yield on_error(out.error_status, out.error or "the request failed")
                    return
                yield i, out
    except Exception as exc:
        yield on_error(*engine_failure(engine, requests[0], exc))


def engine_failure(engine: EngineClient, request: EngineRequest, exc: Exception) -> tuple[int, str]:
    """(status, client-safe message) for an exception raised by ``engine.generate``:
    a stopped engine is 503; a ValueError is the engine refusing the request at admission (its
    message is written for the client), 400; anything else is logged and becomes a generic 500."""
    if not engine.is_alive:
        return 503, "the engine is not running"
    if isinstance(exc, ValueError):
        return 400, str(exc)
    logger.error("engine failed on request %s", request.request_id, exc_info=exc)
    return 500, f"internal server error (request {request.request_id})"
