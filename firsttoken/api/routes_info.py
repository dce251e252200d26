"""The information routes: /tokenize, /v1/models, /health, /v1/engine/stats and /v1/engine/config,
each a handler over the server's state (api/state.py)."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from firsttoken.api.body import read_model
from firsttoken.api.errors import error_response
from firsttoken.api.openapi import body_route, errors
from firsttoken.api.protocol import (
    Health,
    ImageTokenInfo,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VideoTokenInfo,
)
from firsttoken.api.state import check_model, off_loop, state_of

router = APIRouter()


@router.post("/tokenize", **body_route(TokenizeRequest, TokenizeResponse, 404))
async def tokenize(raw: Request) -> Response:
    state = state_of(raw)
    req = await read_model(raw, TokenizeRequest)
    check_model(state, req.model)
    pool = state.pools.for_request(req)
    count = await off_loop(pool, state.intake.count, req.to_prompt())
    return JSONResponse(
        TokenizeResponse(
            count=count.total,
            max_model_len=state.model.max_model_len,
            tokens=list(count.token_ids),
            token_strs=[state.processor.token_piece(t)[0] for t in count.token_ids]
            if req.return_token_strs
            else None,
            num_text_tokens=count.num_text_tokens,
            images=[ImageTokenInfo(**dataclasses.asdict(im)) for im in count.images],
            videos=[VideoTokenInfo(**dataclasses.asdict(v)) for v in count.videos],
            max_input_tokens=state.processor.max_input_tokens,
            predicted_ttft_s=count.predicted_ttft_s,
        ).model_dump()
    )


@router.get("/v1/models")
async def models(raw: Request) -> ModelList:
    state = state_of(raw)
    card = ModelCard(id=state.model.name, root=state.model.root, max_model_len=state.model.max_model_len)
    return ModelList(data=[card])


@router.get("/v1/models/{model_id:path}", responses=errors(404))
async def model_card(raw: Request, model_id: str) -> ModelCard:
    """``client.models.retrieve(name)``: the served model's card, or 404 in OpenAI's shape."""
    state = state_of(raw)
    check_model(state, model_id)
    return ModelCard(id=state.model.name, root=state.model.root, max_model_len=state.model.max_model_len)


@router.get("/health", response_model=Health, responses=errors(503))
async def health(raw: Request) -> Health | Response:
    state = state_of(raw)
    if not state.engine.is_alive:
        return error_response(503, "the engine is not running")
    if state.engine.is_draining:
        return error_response(503, "the server is shutting down")
    return Health()


@router.get("/v1/engine/stats")
async def engine_stats(raw: Request) -> dict[str, object]:
    state = state_of(raw)
    return dataclasses.asdict(state.engine.stats())


@router.get("/v1/engine/config", responses=errors(404))
async def engine_config(raw: Request) -> Response:
    state = state_of(raw)
    if state.model.engine_config is None:
        return error_response(404, "this server fronts no single engine: ask a replica")
    return JSONResponse(dict(state.model.engine_config))
