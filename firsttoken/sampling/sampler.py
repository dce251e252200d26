"""Turns the last-position logits of a batch into one token per sequence.

Greedy rows are one batched argmax. Rows with temperature draw from their own torch.Generator when the
request carries a seed (same seed, same output, whatever else shares the batch), else from the sampler's.
Penalties follow OpenAI (presence/frequency on generated tokens) and transformers (repetition penalty on
prompt + generated tokens). Logprobs are reported from the model's distribution before temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from firsttoken.engine.request import TokenLogprob
from firsttoken.sampling.params import SamplingParams


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs of one sequence."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request, when params.seed is set
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


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
        token_ids = torch.argmax(logits, dim=-1).tolist()
        for i, r in enumerate(rows):
            if not r.params.is_greedy:
                token_ids[i] = self._sample_row(logits[i], r)
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if any(r.params.logprobs for r in rows):
            logprobs = self._logprobs(raw, rows, token_ids)
        return SampleResult(token_ids=token_ids, logprobs=logprobs)

    def _sample_row(self, logits: torch.Tensor, row: SampleRow) -> int:
        p = row.params
        scaled = logits / p.temperature
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
        gen = row.generator or self._generator
        return int(torch.multinomial(probs, 1, generator=gen).item())

    @staticmethod
    def _logprobs(raw: torch.Tensor, rows: Sequence[SampleRow], token_ids: list[int]) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = []
        logp = torch.log_softmax(raw, dim=-1)
        for i, r in enumerate(rows):
            if not r.params.logprobs:
                out.append(None)
                continue
            top: tuple[tuple[int, float], ...] = ()
            if r.params.top_logprobs:
                vals, idx = torch.topk(logp[i], r.params.top_logprobs)
                top = tuple(zip(idx.tolist(), vals.tolist()))
            out.append(TokenLogprob(token_ids[i], float(logp[i, token_ids[i]]), top))
        return out


def _apply_penalties(logits: torch.Tensor, row: SampleRow) -> None:
    """In place on one row [vocab]."""
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        ids, counts = torch.unique(torch.tensor(list(row.output_token_ids), dtype=torch.long), return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g
