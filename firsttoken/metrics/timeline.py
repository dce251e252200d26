"""A request's timeline, assembled in one place from the stamps each layer put on what it handed on.

The API stamps arrival and the first byte sent; the input processor stamps the end of preprocessing
on the EngineRequest; the engine stamps everything else on the RequestStats it attaches to every
output. Phases are the gaps between consecutive marks, so preprocess + queue + encode + prefill +
sample + send == first_byte - arrival == TTFT exactly. The engine builds one too, for requests whose
response nobody sent (no first byte: TTFT ends at the first token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from firsttoken.types import EngineRequest, RequestOutput, RequestStats


@dataclass
class Timeline:
    """Owned by one layer at a time (the API's event loop, or the engine for its own record); never
    shared."""

    arrival_s: float
    preprocessed_s: float | None = None
    arrival_unix_s: float = field(default_factory=time.time)
    engine: RequestStats = field(default_factory=RequestStats)
    first_byte_s: float | None = None
    predicted_ttft_s: float | None = None  # the admission check's prediction (EngineRequest)
    # set when the image budget was lowered to meet the TTFT objective
    image_budget_note: str | None = None
    # compiling its output grammar, within preprocess (None: no grammar)
    grammar_compile_s: float | None = None

    def take_request(self, request: EngineRequest) -> None:
        """The input processor's stamps, carried on the EngineRequest it made."""
        self.preprocessed_s = request.preprocessed_s
        self.predicted_ttft_s = request.predicted_ttft_s
        self.image_budget_note = request.image_budget_note
        if request.sampling.grammar is not None:
            self.grammar_compile_s = request.grammar_compile_s

    def observe(self, output: RequestOutput) -> None:
        """Take the engine's latest stamps (every output carries all of them so far)."""
        self.engine = output.stats

    def mark_first_byte(self) -> None:
        if self.first_byte_s is None:
            self.first_byte_s = time.monotonic()

    @property
    def num_cached_prompt_tokens(self) -> int:
        return self.engine.num_cached_prompt_tokens

    def phases(self) -> dict[str, float]:
        """Seconds per phase, from arrival to the first byte (missing marks collapse to the previous
        one, a mark earlier than the one before counts from it: every phase is >= 0 and they add up
        to ``ttft_s``)."""
        e = self.engine
        marks = [
            ("preprocess", self.preprocessed_s),
            ("queue", e.first_scheduled_s),
            ("encode", e.encoder_done_s),
            ("prefill", e.prefill_done_s),
            ("sample", e.first_token_s),
            ("send", self.first_byte_s),
        ]
        out: dict[str, float] = {}
        prev = self.arrival_s
        for name, t in marks:
            t = prev if t is None else max(t, prev)
            out[name] = t - prev
            prev = t
        return out

    def ttft_s(self) -> float | None:
        """Arrival to the first byte sent (to the first token where nothing was sent): the phases'
        sum."""
        if (self.first_byte_s or self.engine.first_token_s) is None:
            return None
        return sum(self.phases().values())

    def e2e_s(self) -> float | None:
        """Arrival to the request's end: the engine finishing it, and never before its first byte (a
        response sent whole is built after the engine finished), so ``e2e_s >= ttft_s`` whenever
        both exist."""
        if self.engine.finished_s is None:
            return None
        return max(self.engine.finished_s - self.arrival_s, self.ttft_s() or 0.0)

    def to_dict(self) -> dict[str, float | int | None]:
        """The per-request timing report returned to clients and written to the request log."""
        e = self.engine
        phases = self.phases()
        return {
            "ttft_s": self.ttft_s(),
            "predicted_ttft_s": self.predicted_ttft_s,
            **{f"{k}_s": v for k, v in phases.items()},
            "e2e_s": self.e2e_s(),
            "encoder_compute_s": e.encoder_s,
            "prefill_steps": e.num_prefill_steps,
            "shared_prefill_steps": e.num_shared_prefill_steps,
            "images_encoded": e.num_images_encoded,
            "encoder_cache_hits": e.num_encoder_cache_hits,
            "cached_prompt_tokens": e.num_cached_prompt_tokens,
            "preemptions": e.num_preemptions,
            # from the end of preprocessing to the first token, every second accounted for (with
            # encoder_compute_s)
            "steps_to_first_token": e.num_steps_to_first_token,
            "handoff_s": e.handoff_s,
            "forward_s": e.forward_s,
            "step_overhead_s": e.step_overhead_s,
            "other_steps_s": e.other_steps_s,
            "engine_idle_s": e.engine_idle_s,
            **(
                {"grammar_compile_s": self.grammar_compile_s}
                if self.grammar_compile_s is not None
                else {}
            ),
            **({"image_budget": self.image_budget_note} if self.image_budget_note else {}),
        }
