"""Output grammars in the engine: a grammar that fails mid-answer ends only its own request, with a clear error; the
mask holds through chunked prefill, penalties, seeds and preemption by recompute (the runner keeps the matcher in
step with the tokens it keeps)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from firsttoken.api.protocol import ChatCompletionRequest
from firsttoken.types import FinishReason
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

        error = "parser limit reached"

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
        error = None

        def fill_bitmask(self, bitmask, row: int) -> None:
            if self.seen + 1 >= self.n:
                raise RuntimeError("library crashed")
            bitmask[row] = -1

        def accept(self, token_id: int) -> bool:
            self.seen += 1
            return True


@pytest.mark.parametrize("grammar, says", [(RejectAfter(3), "parser limit"), (RaiseOnFill(3), "library")])
def test_a_grammar_failing_mid_answer_ends_only_its_request(tiny_model_dir: Path, grammar, says: str) -> None:
    engine, proc = build(tiny_model_dir)
    reference = run_all(engine, requests(proc))
    engine, proc = build(tiny_model_dir)
    reqs = requests(proc)
    victim = reqs[2]
    reqs[2] = replace(victim, sampling=replace(victim.sampling, grammar=grammar))
    out = run_all(engine, reqs)
    ids, reason, error = out[victim.request_id]
    assert reason == FinishReason.ERROR and "output constraint failed" in error and says in error
    assert ids == reference[victim.request_id][0][:2]  # the two tokens it accepted went out
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
