"""Output grammars in the engine: a grammar whose work is slow holds no batch-mate back, and one over its work budget
or failing mid-answer ends only its own request, with a clear error; the mask holds through chunked prefill,
penalties, seeds and preemption by recompute (the runner keeps the matcher in step with the tokens it keeps)."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from firsttoken.api.protocol import ChatCompletionRequest
from firsttoken.batch import RunnerOutput, ScheduledBatch
from firsttoken.config import GrammarConfig
from firsttoken.runner.executor import InProcessExecutor
from firsttoken.types import FinishReason, RequestOutput
from tests.engine.test_faults import build, requests, run_all
from tests.helpers import process


class RejectAfter:
    """A grammar whose matcher allows every token but refuses the n-th it is given (a library failing mid-stream)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def matcher(self) -> RejectAfter.Matcher:
        return RejectAfter.Matcher(self.n)

    class Matcher:
        def __init__(self, n: int) -> None:
            self.n, self.seen = n, 0

        @property
        def error(self) -> str | None:
            return "parser limit reached" if self.seen >= self.n else None

        def fill_bitmask(self, bitmask, row: int) -> None:
            bitmask[row] = -1  # every token allowed

        def accept(self, token_id: int) -> bool:
            self.seen += 1
            return self.seen < self.n


class RaiseOnFill(RejectAfter):
    """A grammar whose library raises while filling the mask of its n-th token, and on accepting after it."""

    def matcher(self) -> RaiseOnFill.Matcher:
        return RaiseOnFill.Matcher(self.n)

    class Matcher(RejectAfter.Matcher):
        error = None  # type: ignore[assignment]

        def fill_bitmask(self, bitmask, row: int) -> None:
            if self.seen + 1 >= self.n:
                raise RuntimeError("library crashed")
            bitmask[row] = -1

        def accept(self, token_id: int) -> bool:
            self.seen += 1
            return True


EVEN_IDS = np.int32(0x55555555)  # a bitmask word allowing the even token ids of its 32
HELD_AT_MOST_S = 60.0  # how long a held mask waits to be released (only code that waits for it reaches this)


class EvenTokens:
    """A grammar that allows the even token ids; with ``release``, each mask is filled only once the test releases
    it (a library stuck on an ambiguous grammar)."""

    def __init__(self, release: threading.Event | None = None) -> None:
        self.release = release

    def matcher(self) -> EvenTokens.Matcher:
        return EvenTokens.Matcher(self.release)

    class Matcher:
        error = None

        def __init__(self, release: threading.Event | None) -> None:
            self.release = release

        def fill_bitmask(self, bitmask, row: int) -> None:
            if self.release is not None and not self.release.wait(HELD_AT_MOST_S):
                self.release.set()  # (a step waiting for it never ends: let it, once, so the test can fail)
            bitmask[row] = EVEN_IDS

        def accept(self, token_id: int) -> bool:
            return token_id % 2 == 0


class Recording(InProcessExecutor):
    """The in-process executor, keeping what the runner reported of each step (the engine's executor seam)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: list[RunnerOutput] = []

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        out = super().execute(batch)
        self.outputs.append(out)
        return out


def steps_until(engine, reqs, rid: str) -> tuple[int, dict[str, list[int]], dict[str, RequestOutput]]:
    """Add ``reqs`` and step until ``rid`` has finished: (steps, tokens so far per request, final outputs)."""
    for r in reqs:
        engine.add_request(r)
    ids: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    finals: dict[str, RequestOutput] = {}
    steps = 0
    while rid not in finals:
        steps += 1
        for o in engine.step():
            ids[o.request_id] += o.new_token_ids
            if o.finished:
                finals[o.request_id] = o
    return steps, ids, finals


def constrained(req, grammar):
    return replace(req, sampling=replace(req.sampling, grammar=grammar))


def test_an_unconstrained_request_never_waits_for_a_batch_mates_mask(tiny_model_dir: Path) -> None:
    """A constrained request whose masks are held back (its grammar's work outlasting every step) samples nothing
    and holds no one back: its unconstrained batch-mate finishes in as many steps, with the same tokens, as alone,
    and only the first step that asks for the held mask waits for it (reported, so the cost model leaves it out).
    Once its masks come, it answers exactly what it answers alone (a row never samples without its mask)."""
    engine, proc = build(tiny_model_dir)
    free, slow = requests(proc)[0], requests(proc)[2]
    alone_steps, alone_ids, _ = steps_until(engine, [free], free.request_id)
    engine, proc = build(tiny_model_dir)
    _, reference, _ = steps_until(engine, [constrained(slow, EvenTokens())], slow.request_id)
    assert reference[slow.request_id] and all(t % 2 == 0 for t in reference[slow.request_id])

    release = threading.Event()
    engine, proc = build(tiny_model_dir, executor_factory=Recording)
    try:
        steps, ids, finals = steps_until(engine, [free, constrained(slow, EvenTokens(release))], free.request_id)
        assert steps == alone_steps and ids[free.request_id] == alone_ids[free.request_id]
        assert finals[free.request_id].finish_reason == FinishReason.LENGTH
        assert ids[slow.request_id] == []  # no mask, no token
        held = engine.executor.outputs
        assert sum(slow.request_id in o.mask_pending_request_ids for o in held) >= 3  # pending for several steps
        assert sum(o.mask_wait_s > 0 for o in held) == 1  # ... waited for in one of them
    finally:
        release.set()
    while engine.has_unfinished():
        for o in engine.step():
            ids[o.request_id] += o.new_token_ids
        engine.scheduler.check_invariants()
    assert ids[slow.request_id] == reference[slow.request_id]
    assert engine.stats().kv_blocks_used == 0


def test_a_grammar_over_its_work_budget_ends_its_request_with_a_400_and_no_one_else(tiny_model_dir: Path) -> None:
    """A mask held back longer than the budget allows (twice it, in wall time: its CPU is counted only once the job
    ends) ends its request with a 400 naming the bound; its batch-mate goes on as alone."""
    engine, proc = build(tiny_model_dir)
    free, slow = requests(proc)[0], requests(proc)[2]
    alone_steps, alone_ids, _ = steps_until(engine, [free], free.request_id)
    release = threading.Event()
    engine, proc = build(tiny_model_dir, grammar=GrammarConfig(request_mask_s=0.05))
    try:
        steps, ids, finals = steps_until(engine, [free, constrained(slow, EvenTokens(release))], free.request_id)
        assert steps == alone_steps and ids[free.request_id] == alone_ids[free.request_id]
        while slow.request_id not in finals:
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
    finally:
        release.set()
    out = finals[slow.request_id]
    assert out.finish_reason == FinishReason.ERROR and out.error_status == 400 and out.num_output_tokens == 0
    assert "waited more than 0.1 s" in out.error and "twice --grammar-mask-budget" in out.error
    assert engine.stats().kv_blocks_used == 0 and engine.stats().num_running == 0


# the grammar takes each token off the step's thread, after it went out: a token refused there (within its mask, so
# by a parser limit) is sent, and the request ends at its next step; a mask that fails ends it before its token
@pytest.mark.parametrize("grammar, says, sent", [(RejectAfter(3), "parser limit", 3), (RaiseOnFill(3), "library", 2)])
def test_a_grammar_failing_mid_answer_ends_only_its_request(tiny_model_dir: Path, grammar, says: str,
                                                            sent: int) -> None:
    engine, proc = build(tiny_model_dir)
    reference = run_all(engine, requests(proc))
    engine, proc = build(tiny_model_dir)
    reqs = requests(proc)
    victim = reqs[2]
    reqs[2] = replace(victim, sampling=replace(victim.sampling, grammar=grammar))
    out = run_all(engine, reqs)
    ids, reason, error = out[victim.request_id]
    assert reason == FinishReason.ERROR and "output constraint failed" in error and says in error
    assert ids == reference[victim.request_id][0][:sent]
    for rid in reference:
        if rid != victim.request_id:
            assert out[rid] == reference[rid]  # batch-mates: same tokens, same finish
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


def test_a_schema_holds_through_chunked_prefill_penalties_seeds_and_preemption(tiny_model_dir: Path) -> None:
    from firsttoken.config import CacheConfig, EngineConfig, GenerationDefaults, SchedulerConfig
    from firsttoken.engine.engine import LLMEngine
    from firsttoken.inputs.processor import InputProcessor
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # a small pool and chunks: prompts are prefilled in pieces and decodes preempt each other
    cfg = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_bytes=2**17, block_size=16),
                       scheduler=SchedulerConfig(max_batched_tokens=32, step_time_target="off",
                                                 kv_admission="optimistic", decode_reserve_tokens=0))
    engine = LLMEngine(tiny_model_dir, cfg, tok.backend_tokenizer)
    proc = InputProcessor(tok, engine.model_config, GenerationDefaults.from_pretrained(tiny_model_dir),
                          max_model_len=engine.max_model_len)
    schema = {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 4,
                                                        "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["tags", "n"], "additionalProperties": False}
    reqs = [process(proc, ChatCompletionRequest.model_validate({
        "model": "m", "max_tokens": 60, "temperature": 1.0, "seed": i, "repetition_penalty": 1.3,
        "presence_penalty": 0.5, "messages": [{"role": "user", "content": f"question {i} " + "about dogs " * 12}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}), f"r{i}")
        for i in range(6)]
    texts = {r.request_id: "" for r in reqs}
    for r in reqs:
        engine.add_request(r)
    finished = {}
    while engine.has_unfinished():
        for o in engine.step():
            texts[o.request_id] += o.new_text
            if o.finished:
                finished[o.request_id] = o.finish_reason
        engine.scheduler.check_invariants()
    assert engine.stats().num_preemptions > 0  # the matcher went through recompute
    for rid, text in texts.items():
        assert finished[rid] == FinishReason.STOP, (rid, text)
        jsonschema.validate(json.loads(text), schema)
