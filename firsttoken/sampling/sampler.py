"""Turns the last-position logits of a batch into one token per sequence.

Greedy rows take their argmax (the first maximum). Rows with temperature draw from their own
torch.Generator when the request carries a seed (same seed, same output, whatever else shares the
batch), else from the sampler's. Penalties follow OpenAI (presence/frequency on generated tokens)
and transformers (repetition penalty on prompt + generated tokens), applied to every penalised row
of the step at once. Logprobs are reported from the model's distribution before temperature.

A sampled row never sorts the vocabulary: top-k takes the k largest logits (sorted) and the softmax,
top-p and the draw run over those k; top-p alone takes the most probable 64, 256, ... tokens until
they hold more than top_p of the mass (the tokens top-p keeps are always among them); the draw is
one uniform number against the candidates' cumulative mass (the first token whose cumulative mass
exceeds it: token i with probability p_i / sum p). The tokens kept and their probabilities are those
of a full sort (vLLM's and transformers' top-k/top-p), but the draws from a given seed differ from
theirs. No row sorts the vocabulary: that cost grows with the vocabulary, this one with the
candidates kept (why: docs/runs/notes/sampler.md).

Numerically safe for every value SamplingParams accepts: a temperature below ``SAMPLING_EPS`` is
greedy (as in vLLM), penalised or temperature-scaled logits are clamped to finite values before the
softmax, and a row whose probabilities still come out unusable falls back to its argmax. A row that
raises anyway fails alone: its index lands in ``SampleResult.failed`` and every other row is sampled
as usual.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

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
    # the same tokens kept incrementally (the runner's); built when absent
    history: TokenHistory | None = None


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]  # a failed row's entry is meaningless
    logprobs: list[TokenLogprob | None]
    failed: dict[int, str] = field(default_factory=dict)  # row index -> user-safe message


# (logits, rows, skip=row indices already done) -> penalised logits
Penalties = Callable[..., torch.Tensor]


class Sampler:
    def __init__(
        self, seed: int | None = None, kernels: bool = True, penalties: Penalties | None = None
    ) -> None:
        """``kernels``: top-k and argmax through firsttoken's CPU kernel (one vectorized pass;
        torch's are scalar loops on the CPU) where it is built, else torch's
        (``--cpu-kernels off``); the same tokens either way. ``penalties``: how the rows' repetition
        penalties are applied (default ``apply_penalties``; a test passes one that also records
        which rows it was asked for)."""
        self._penalties: Penalties = penalties or apply_penalties
        self._generator = torch.Generator()
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()
        self._kernels = kernels
        # resolved on first use (building it is the loader's business, normally done)
        self._kernel: Any = None

    def _cpu_kernel(self, x: torch.Tensor) -> Any:
        """firsttoken's CPU kernel library for a tensor on the CPU, when it is to be used and is
        built, else None."""
        if not self._kernels or x.device.type != "cpu":
            return None
        if self._kernel is None:
            from firsttoken.kernels.cpu_linear import _kernel

            self._kernel = _kernel()[0] or False
        return self._kernel or None

    def _topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """torch.topk(x, k) of one row (largest first)."""
        kernel = self._cpu_kernel(x)
        got = kernel.topk(x, k) if kernel is not None else None
        return got if got is not None else torch.topk(x, k)

    def _argmax(self, logits: torch.Tensor, rows: list[int]) -> list[int]:
        """The first maximum of each of these rows: the kernel row by row, else one batched
        torch.argmax."""
        if self._cpu_kernel(logits) is not None:
            return [int(self._topk(logits[i], 1)[1][0]) for i in rows]
        picked = logits if len(rows) == logits.shape[0] else logits[rows]
        return torch.argmax(picked, dim=-1).tolist()

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
        """logits: [num_rows, vocab] float32."""
        logits = logits.float()
        raw = logits
        token_ids = [0] * len(rows)
        done = self._greedy_unseen_maximum(raw, rows, token_ids)
        if any(r.params.has_penalties for i, r in enumerate(rows) if i not in done):
            logits = self._penalties(logits.clone(), rows, skip=done)
            _clamp_finite(logits)  # a tiny repetition penalty divides by ~0
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        if biased:  # after the penalties, as vLLM; the logprobs stay the model's (raw)
            logits = logits.clone() if logits is raw else logits
            for i in biased:
                ids, bias = zip(*rows[i].params.logit_bias)
                logits[i, list(ids)] += torch.tensor(bias, dtype=logits.dtype)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy and i not in done]
        for i, token in zip(greedy, self._argmax(logits, greedy) if greedy else ()):
            token_ids[i] = token
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

    def _greedy_unseen_maximum(
        self, raw: torch.Tensor, rows: Sequence[SampleRow], token_ids: list[int]
    ) -> set[int]:
        """Greedy rows whose only penalty is a repetition penalty > 1 (Qwen2-VL's default: top-k 1,
        1.05): such a penalty only lowers the logits of tokens the request has seen, so when the
        first maximum of the raw logits is a token it has not seen, that token is also the first
        maximum of the penalised ones (every earlier logit was below it and can only go lower;
        clamping changes nothing finite). Those rows take it without the penalty's clone,
        gather/scatter and clamp over the vocabulary; the others go the whole way. Only where the
        CPU kernel takes the argmax (it never picks a NaN, as the clamped path never does). Returns
        the rows done."""
        done: set[int] = set()
        if self._cpu_kernel(raw) is None:
            return done
        for i, r in enumerate(rows):
            p = r.params
            if (
                r.history is None
                or not p.is_greedy
                or p.repetition_penalty <= 1.0
                or p.presence_penalty
                or p.frequency_penalty
                or p.logit_bias
            ):
                continue
            token = self._argmax(raw, [i])[0]
            if not r.history.has_seen(token):
                token_ids[i] = token
                done.add(i)
        return done

    def _sample_row(self, logits: torch.Tensor, row: SampleRow) -> int:
        p = row.params
        scaled = _clamp_finite(logits / p.temperature)
        ids = None  # the candidates' token ids, when not the whole vocabulary
        if 0 < p.top_k < scaled.numel():
            scaled, ids = self._topk(scaled, p.top_k)  # sorted, largest first
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            if ids is None:
                probs, ids = self._top_p_candidates(probs, p.top_p)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
            probs = probs.masked_fill(drop, 0.0)
        cdf = probs.cumsum(-1)
        total = float(cdf[-1])
        # nothing left to draw from: the most likely token
        if not math.isfinite(total) or total <= 0.0:
            return int(torch.argmax(logits))
        gen = row.generator or self._generator
        # the first token whose cumulative mass passes u
        u = torch.rand(1, generator=gen, dtype=cdf.dtype) * total
        choice = min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)
        return choice if ids is None else int(ids[choice])

    def _top_p_candidates(
        self, probs: torch.Tensor, top_p: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The most probable tokens, sorted, enough of them that top-p keeps none beyond: 64, then
        4x more until they hold more than top_p of the mass (top-p keeps a token while the mass
        before it is at most top_p)."""
        n = probs.numel()
        k = min(64, n)
        while True:
            vals, ids = self._topk(probs, k)
            if k == n or float(vals.cumsum(-1)[-1]) > top_p:
                return vals, ids
            k = min(n, k * 4)

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
                # a token an output constraint masked (-inf) is no alternative, and JSON has no -inf
                top = tuple((t, v) for t, v in zip(idx.tolist(), vals.tolist()) if v != -math.inf)
            out.append(TokenLogprob(token_ids[i], float(logp[i, token_ids[i]]), top))
        return out


def _clamp_finite(x: torch.Tensor) -> torch.Tensor:
    """In place: +-inf -> the dtype's largest finite magnitude, NaN -> its lowest (never chosen)."""
    info = torch.finfo(x.dtype)
    return torch.nan_to_num_(x, nan=info.min, posinf=info.max, neginf=info.min)


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SampleRow], skip: set[int] = frozenset()
) -> torch.Tensor:
    """In place on logits [rows, vocab], every penalised row at once (but those in ``skip``): one
    gather and one scatter for the repetition penalty, one index_put for presence/frequency. Returns
    logits."""
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    seen: list[torch.Tensor] = []
    penalties: list[float] = []
    out_idx: list[torch.Tensor] = []
    out_sub: list[torch.Tensor] = []
    for i, r in enumerate(rows):
        p = r.params
        if not p.has_penalties or i in skip:
            continue
        history = r.history or TokenHistory(r.prompt_token_ids, r.output_token_ids)
        if p.repetition_penalty != 1.0 and history.seen_ids.numel():
            seen.append(history.seen_ids + i * vocab if i else history.seen_ids)
            penalties.append(p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and history.output_ids.numel():
            out_idx.append(history.output_ids + i * vocab if i else history.output_ids)
            out_sub.append(
                p.presence_penalty + p.frequency_penalty * history.output_counts.to(logits.dtype)
            )
    if seen:
        idx = _cat(seen)
        pen: float | torch.Tensor = penalties[0]
        if len(set(penalties)) > 1:  # one value per index, from its row
            pen = torch.repeat_interleave(torch.tensor(penalties, dtype=logits.dtype),
                                          torch.tensor([t.numel() for t in seen]))
        vals = flat[idx]
        flat[idx] = torch.where(vals > 0, vals / pen, vals * pen)
    if out_idx:
        flat.index_put_((_cat(out_idx),), -_cat(out_sub), accumulate=True)
    return logits


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g
