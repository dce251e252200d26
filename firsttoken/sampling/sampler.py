"""Turns the last-position logits of a batch into one token per sequence.

Greedy rows are one batched argmax. Rows with temperature draw from their own torch.Generator when the
request carries a seed (same seed, same output, whatever else shares the batch), else from the sampler's.
Penalties follow OpenAI (presence/frequency on generated tokens) and transformers (repetition penalty on
prompt + generated tokens). Logprobs are reported from the model's distribution before temperature.

Numerically safe for every value SamplingParams accepts: a temperature below ``SAMPLING_EPS`` is greedy (as in
vLLM), penalised or temperature-scaled logits are clamped to finite values before the softmax, and a row whose
probabilities still come out unusable falls back to its argmax. A row that raises anyway fails alone: its index
lands in ``SampleResult.failed`` and every other row is sampled as usual.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from firsttoken.sampling.penalties import TokenHistory
from firsttoken.types import SamplingParams, TokenLogprob

log = logging.getLogger("firsttoken.sampling")


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs of one sequence."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request, when params.seed is set
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    history: TokenHistory | None = None  # the same tokens kept incrementally (the runner's); built when absent


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]  # a failed row's entry is meaningless
    logprobs: list[TokenLogprob | None]
    failed: dict[int, str] = field(default_factory=dict)  # row index -> user-safe message


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
        """logits: [num_rows, vocab] float32."""
        logits = logits.float()
        raw = logits
        if any(r.params.has_penalties for r in rows):
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.params.has_penalties:
                    _apply_penalties(logits[i], r)
            _clamp_finite(logits)  # a tiny repetition penalty divides by ~0
        token_ids = torch.argmax(logits, dim=-1).tolist()
        failed: dict[int, str] = {}
        for i, r in enumerate(rows):
            if r.params.is_greedy:
                continue
            try:
                token_ids[i] = self._sample_row(logits[i], r)
            except Exception:  # this row's failure is this request's alone
                log.exception("sampling failed for one row")
                failed[i] = "internal error while sampling this request's next token"
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if any(r.params.logprobs for r in rows):
            logprobs = self._logprobs(raw, rows, token_ids, failed)
        return SampleResult(token_ids=token_ids, logprobs=logprobs, failed=failed)

    def _sample_row(self, logits: torch.Tensor, row: SampleRow) -> int:
        p = row.params
        scaled = _clamp_finite(logits / p.temperature)
        if p.top_k > 0 and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return int(torch.argmax(scaled))  # nothing left to draw from: the most likely token
        gen = row.generator or self._generator
        return int(torch.multinomial(probs, 1, generator=gen).item())

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, rows: Sequence[SampleRow], token_ids: list[int], failed: dict[int, str]
    ) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = []
        logp = torch.log_softmax(raw, dim=-1)
        for i, r in enumerate(rows):
            if not r.params.logprobs or i in failed:
                out.append(None)
                continue
            top: tuple[tuple[int, float], ...] = ()
            if r.params.top_logprobs:
                vals, idx = torch.topk(logp[i], min(r.params.top_logprobs, logp.shape[-1]))
                top = tuple(zip(idx.tolist(), vals.tolist()))
            out.append(TokenLogprob(token_ids[i], float(logp[i, token_ids[i]]), top))
        return out


def _clamp_finite(x: torch.Tensor) -> torch.Tensor:
    """In place: +-inf -> the dtype's largest finite magnitude, NaN -> its lowest (never chosen)."""
    info = torch.finfo(x.dtype)
    return torch.nan_to_num_(x, nan=info.min, posinf=info.max, neginf=info.min)


def _apply_penalties(logits: torch.Tensor, row: SampleRow) -> None:
    """In place on one row [vocab]."""
    p = row.params
    history = row.history or TokenHistory(row.prompt_token_ids, row.output_token_ids)
    if p.repetition_penalty != 1.0:
        seen = history.seen_ids
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and history.output_ids.numel():
        ids, counts = history.output_ids, history.output_counts
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g
