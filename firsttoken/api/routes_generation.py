"""The generation routes: /v1/chat/completions, /v1/completions and /v1/responses (stream and
non-stream), each a handler over the server's state (api/state.py): read the body, ``start``
(preprocess and admit each choice), then stream the engine's outputs or ``respond`` with the whole
answer."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from firsttoken.api.body import read_model
from firsttoken.api.errors import error_response
from firsttoken.api.logprobs_usage import chat_logprobs, completion_logprobs, usage_of
from firsttoken.api.openapi import body_route, errors
from firsttoken.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallOut,
)
from firsttoken.api.responses_api import (
    ResponseObject,
    ResponsesRequest,
    finished_response,
    responses_sse,
)
from firsttoken.api.state import closer, respond, start, state_of
from firsttoken.api.streaming import (
    Collected,
    Echo,
    EngineStreamResponse,
    chat_sse,
    completion_sse,
)
from firsttoken.api.tool_calls import ToolOutput
from firsttoken.inputs.prompt import TextPrompt

# what a generation route's handler may answer besides 400 (the body) and the layers' errors
# (api/openapi.py): an unknown model, a full server or lane, a stopped or draining engine, a request
# past --request-timeout
GENERATION_ERRORS = (404, 429, 503, 504)

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    **body_route(
        ChatCompletionRequest, ChatCompletionResponse, *GENERATION_ERRORS, stream=True
    ),
)
async def chat_completions(raw: Request) -> Response:
    state = state_of(raw)
    req = await read_model(raw, ChatCompletionRequest)
    requests, after, ctx = await start(state, req, "chatcmpl-")
    if req.stream:
        tools = functools.partial(tool_output, req) if req.tool_mode != "none" else None
        return EngineStreamResponse(
            chat_sse(state.engine, requests, ctx, state.processor.token_piece, tools, after), closer(state, ctx)
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
            logprobs=chat_logprobs(c.logprobs, state.processor.token_piece),
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

    return await respond(state, raw, requests, after, ctx, build)


@router.post(
    "/v1/completions",
    **body_route(CompletionRequest, CompletionResponse, *GENERATION_ERRORS, stream=True),
)
async def completions(raw: Request) -> Response:
    state = state_of(raw)
    req = await read_model(raw, CompletionRequest)
    requests, after, ctx = await start(state, req, "cmpl-")
    prompts = req.prompts()
    echo = (
        [
            Echo(
                p.text if isinstance(p, TextPrompt) else state.processor.decode(p.token_ids),
                r.prompt_token_ids,
            )
            for p, r in zip((prompts[k // req.n] for k in range(len(requests))), requests)
        ]
        if req.echo
        else []
    )
    if req.stream:
        return EngineStreamResponse(
            completion_sse(state.engine, requests, ctx, state.processor.token_piece, after, echo),
            closer(state, ctx),
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
            logprobs=completion_logprobs(scores, state.processor.token_piece, 0, first),
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

    return await respond(state, raw, requests, after, ctx, build)


@router.post(
    "/v1/responses",
    **body_route(ResponsesRequest, ResponseObject, *GENERATION_ERRORS, stream=True),
)
async def responses(raw: Request) -> Response:
    """Stateless: nothing is stored, so a response cannot be retrieved or continued by its id."""
    state = state_of(raw)
    req = await read_model(raw, ResponsesRequest)
    requests, after, ctx = await start(state, req, "resp_")
    if req.stream:
        return EngineStreamResponse(responses_sse(state.engine, requests[0], req, ctx), closer(state, ctx))

    def build(collected: list[Collected]) -> Response:
        return JSONResponse(
            finished_response(req, ctx, collected[0].text, collected[0].final).model_dump()
        )

    return await respond(state, raw, requests, after, ctx, build)


@router.get(
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


def tool_output(req: ChatCompletionRequest) -> ToolOutput | None:
    """The answer's tool-call parser, when its tools may be called (api/tool_calls.py)."""
    mode = req.tool_mode
    if mode == "none":
        return None
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    return ToolOutput(mode, frozenset(t.function.name for t in req.tools or ()), named)
