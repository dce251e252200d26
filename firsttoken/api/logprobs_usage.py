"""Engine outputs -> OpenAI response pieces (usage with the timing extension, logprobs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from firsttoken.api.protocol import (
    ChoiceLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
)
from firsttoken.metrics.timeline import Timeline
from firsttoken.types import RequestOutput, TokenLogprob

# token id -> (text, raw bytes); InputProcessor.token_piece
TokenPieceFn = Callable[[int], tuple[str, list[int]]]


def usage_of(finals: Sequence[RequestOutput], timeline: Timeline, n: int = 1) -> Usage:
    """A response's usage from its choices' last outputs (choice k answers prompt k // n): each
    prompt's tokens once, every choice's output tokens; the timeline (and its cached tokens) is
    choice 0's."""
    prompt_tokens = sum(f.num_prompt_tokens for f in finals[::n])
    completion_tokens = sum(f.num_output_tokens for f in finals)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=timeline.num_cached_prompt_tokens),
        firsttoken=timeline.to_dict(),
    )


def chat_logprobs(logprobs: Sequence[TokenLogprob], piece: TokenPieceFn) -> ChoiceLogprobs | None:
    if not logprobs:
        return None
    entries = []
    for lp in logprobs:
        token, raw = piece(lp.token_id)
        top = [TopLogprob(token=(p := piece(tid))[0], logprob=v, bytes=p[1]) for tid, v in lp.top]
        entries.append(
            TokenLogprobEntry(token=token, logprob=lp.logprob, bytes=raw, top_logprobs=top)
        )
    return ChoiceLogprobs(content=entries)


def completion_logprobs(
    logprobs: Sequence[TokenLogprob | None], piece: TokenPieceFn, text_offset: int,
    first_token: int | None = None,
) -> CompletionLogprobs | None:
    """OpenAI's legacy shape; ``text_offset`` is where this delta's first token starts in the output
    text. ``first_token``: an echoed prompt's first token, which leads with no logprob (``echoed``
    builds the list)."""
    if not logprobs and first_token is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    entries: list[tuple[int, float | None, tuple]] = (
        [] if first_token is None else [(first_token, None, ())]
    )
    entries += [(lp.token_id, lp.logprob, lp.top) for lp in logprobs if lp is not None]
    for i, (token_id, value, top) in enumerate(entries):
        token = piece(token_id)[0]
        tokens.append(token)
        values.append(value)
        tops.append(
            None if first_token is not None and i == 0 else {piece(tid)[0]: v for tid, v in top}
        )
        offsets.append(text_offset)
        text_offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
    )
