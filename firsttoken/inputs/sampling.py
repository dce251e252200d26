"""A request's sampling fields as SamplingParams, over the checkpoint's generation_config defaults;
every value checked against the model (token ids inside its vocabulary) with the field named."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from firsttoken.config import GenerationDefaults
from firsttoken.inputs.errors import InputError
from firsttoken.inputs.prompt import SamplingRequest
from firsttoken.models.model_config import ModelConfig
from firsttoken.quoting import quote
from firsttoken.types import SamplingParams

_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
# stop_token_ids a request may add (each generated token is checked against them all)
MAX_STOP_TOKEN_IDS = 64


def or_default(value: Any, default: Any) -> Any:
    return default if value is None else value


def sampling_params(
    req: SamplingRequest, max_tokens: int, defaults: GenerationDefaults, model: ModelConfig
) -> SamplingParams:
    """Request values over the checkpoint's generation_config defaults. ValueError ->
    InputError(param)."""
    if req.top_logprobs and not req.logprobs:
        raise InputError("top_logprobs requires logprobs to be true", req.name("top_logprobs"))
    _check_stop_token_ids(req.stop_token_ids, model.vocab_size)
    eos = defaults.eos_token_ids or model.eos_token_ids
    values: dict[str, Any] = dict(
        max_tokens=max_tokens,
        temperature=or_default(req.temperature, defaults.temperature),
        top_p=or_default(req.top_p, defaults.top_p),
        top_k=or_default(req.top_k, defaults.top_k),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=tuple(dict.fromkeys(req.stop_token_ids)),
        ignore_eos=req.ignore_eos,
        eos_token_ids=tuple(eos),
        presence_penalty=or_default(req.presence_penalty, 0.0),
        frequency_penalty=or_default(req.frequency_penalty, 0.0),
        repetition_penalty=or_default(req.repetition_penalty, defaults.repetition_penalty),
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        logit_bias=_checked_bias(req.logit_bias, model.vocab_size),
        prompt_logprobs=req.prompt_logprobs,
    )
    try:
        return SamplingParams(**values)
    except ValueError as err:
        message = str(err)
        name = message.split(" ", 1)[0]
        if name not in _SAMPLING_FIELDS:
            raise InputError(message) from None
        param = req.name(name)
        value = values[name]
        # numbers only, bounded
        got = f", got {quote(value)}" if isinstance(value, (int, float)) else ""
        raise InputError(f"{param}{message[len(name) :]}{got}", param) from None


def _checked_bias(
    bias: tuple[tuple[int, float], ...], vocab: int
) -> tuple[tuple[int, float], ...]:
    for token_id, _ in bias:
        if not 0 <= token_id < vocab:
            raise InputError(f"logit_bias names token {token_id}, not a token id of this model (0 to {vocab - 1})",
                             "logit_bias")
    return bias


def _check_stop_token_ids(ids: Sequence[int], vocab: int) -> None:
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InputError(
            f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
            "stop_token_ids",
        )
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab:
            raise InputError(
                f"stop_token_ids[{i}] = {token_id} is not a token id of this model (0 to {vocab - 1})",
                f"stop_token_ids[{i}]",
            )
