"""One request's failure never hurts another: faults injected through the runner's designed seam."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from firsttoken.api.protocol import ChatCompletionRequest
from firsttoken.config import (
    CacheConfig,
    EngineConfig,
    GenerationDefaults,
    SchedulerConfig,
)
from firsttoken.engine.async_engine import AsyncEngine
from firsttoken.engine.engine import LLMEngine
from firsttoken.inputs.processor import InputProcessor
from firsttoken.runner.executor import InProcessExecutor
from firsttoken.types import FinishReason
from tests.e2e.conftest import image_data_url, make_image
from tests.helpers import process


class FailOne:
    """Raises for one request id at one stage, every time it is asked."""

    def __init__(self, request_id: str, stage: str) -> None:
        self.request_id = request_id
        self.stage = stage
        self.calls = 0

    def __call__(self, stage: str, request_id: str) -> None:
        if stage == self.stage and request_id == self.request_id:
            self.calls += 1
            raise RuntimeError("injected fault")


def build(model_dir: Path, hook=None, executor_factory=InProcessExecutor, **engine_options):
    """``engine_options``: more EngineConfig fields; ``executor_factory``: the engine's (a test's may record)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_bytes=8 * 2**20),
                       scheduler=SchedulerConfig(max_batched_tokens=128, step_time_target="off"), **engine_options)
    engine = LLMEngine(model_dir, cfg, tok.backend_tokenizer, fault_hook=hook, executor_factory=executor_factory)
    proc = InputProcessor(tok, engine.model_config, GenerationDefaults.from_pretrained(model_dir),
                          max_model_len=engine.max_model_len)
    return engine, proc


def requests(proc: InputProcessor):
    bodies = {
        "a": [{"role": "user", "content": "First question, about cats."}],
        "b": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(
            make_image(120, 120, seed=3))}}, {"type": "text", "text": "And this?"}]}],
        "c": [{"role": "user", "content": "A third, longer question about the history of dogs " * 5}],
        "d": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(
            make_image(90, 150, seed=4))}}, {"type": "text", "text": "Describe"}]}],
    }
    return [process(proc, ChatCompletionRequest.model_validate(
        {"model": "m", "messages": m, "max_tokens": 8, "temperature": 0.0}), rid)
        for rid, m in bodies.items()]


def run_all(engine: LLMEngine, reqs) -> dict[str, tuple[list[int], FinishReason | None, str | None]]:
    out: dict[str, tuple[list[int], FinishReason | None, str | None]] = {r.request_id: ([], None, None) for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        for o in engine.step():
            ids, _, _ = out[o.request_id]
            out[o.request_id] = (ids + list(o.new_token_ids), o.finish_reason, o.error)
        engine.scheduler.check_invariants()
    return out


@pytest.mark.parametrize("victim,stage", [("b", "encode"), ("c", "sample"), ("d", "encode")])
def test_a_fault_in_one_request_fails_only_that_request(tiny_model_dir, victim, stage):
    engine, proc = build(tiny_model_dir)
    reference = run_all(engine, requests(proc))
    hook = FailOne(victim, stage)
    engine, proc = build(tiny_model_dir, hook)
    faulty = run_all(engine, requests(proc))
    assert hook.calls >= 1
    ids, reason, error = faulty[victim]
    assert reason == FinishReason.ERROR and error and "injected" not in error  # user-safe message
    for rid in reference:
        if rid != victim:
            assert faulty[rid] == reference[rid]  # same tokens, same finish reason
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    # the engine keeps serving after the fault
    again = run_all(engine, requests(proc)[:1])
    assert again["a"][0] == reference["a"][0]


def test_a_request_past_the_timeout_fails_with_504_and_frees_its_blocks(tiny_model_dir):
    import time

    from transformers import AutoTokenizer

    class SlowFirstStep:
        def __init__(self) -> None:
            self.slept = False

        def __call__(self, stage: str, request_id: str) -> None:
            if stage == "sample" and not self.slept:
                self.slept = True
                time.sleep(0.3)

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_bytes=8 * 2**20), request_timeout_s=0.2)
    engine = LLMEngine(tiny_model_dir, cfg, tok.backend_tokenizer, fault_hook=SlowFirstStep())
    proc = InputProcessor(tok, engine.model_config, GenerationDefaults.from_pretrained(tiny_model_dir),
                          max_model_len=engine.max_model_len)
    req = requests(proc)[0]
    out = run_all(engine, [req])
    ids, reason, error = out[req.request_id]
    assert reason == FinishReason.ERROR and "0.2 s request timeout" in error
    assert len(ids) == 1  # it got its first token, then ran out of time
    assert engine.stats().kv_blocks_used == 0


class FailFirstEncode:
    """Raises at the first encode stage of one request only (a one-off fault, e.g. a transient allocation error)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.calls = 0

    def __call__(self, stage: str, request_id: str) -> None:
        if stage == "encode" and request_id == self.request_id and self.calls == 0:
            self.calls += 1
            raise RuntimeError("injected fault")


def chat(proc: InputProcessor, rid: str, content, **sampling):
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0.0}
    body.update(sampling)
    return process(proc, ChatCompletionRequest.model_validate(body), rid)


def image_question(seed: int = 7, text: str = "What is this?"):
    return [{"type": "image_url", "image_url": {"url": image_data_url(make_image(100, 140, seed=seed))}},
            {"type": "text", "text": text}]


def test_a_failed_encode_does_not_poison_the_encoder_cache_for_the_next_request(tiny_model_dir):
    # The audit's repro: an encode fault for an image, then the same image beside an unrelated text request.
    # Before the fix the scheduler counted the image as encoded when it was scheduled, so the next request skipped
    # the encoder, the runner found no embeddings and the whole batch (text request included) failed.
    engine, proc = build(tiny_model_dir)
    reference = run_all(engine, [chat(proc, "ref-img", image_question()), chat(proc, "ref-txt", "Tell me a story.")])
    engine, proc = build(tiny_model_dir, FailFirstEncode("first"))
    first = run_all(engine, [chat(proc, "first", image_question())])
    assert first["first"][1] == FinishReason.ERROR
    engine.scheduler.check_invariants()
    calls_before = engine.stats().num_images_encoded
    again = run_all(engine, [chat(proc, "again", image_question()), chat(proc, "text", "Tell me a story.")])
    assert again["again"] == reference["ref-img"]  # encoded afresh, same tokens
    assert again["text"] == reference["ref-txt"]
    assert engine.stats().num_images_encoded == calls_before + 1
    assert engine.stats().kv_blocks_used == 0


def test_when_a_shared_image_fails_to_encode_only_the_request_whose_encode_it_was_fails(tiny_model_dir):
    # Two requests send the same image in one step: the first one's encode of it fails. The second one's chunk needs
    # those embeddings: it is skipped for a step (not failed), its image is encoded afresh, and its tokens are right.
    engine, proc = build(tiny_model_dir)
    reference = run_all(engine, [chat(proc, "ref", image_question(text="Same picture, other question"))])
    engine, proc = build(tiny_model_dir, FailFirstEncode("x"))
    out = run_all(engine, [chat(proc, "x", image_question()), chat(proc, "y", image_question(text="Same picture, "
                                                                                            "other question"))])
    assert out["x"][1] == FinishReason.ERROR
    assert out["y"] == reference["ref"]
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("hostile", [
    {"temperature": 1e-40, "top_k": 0},  # dividing logits by it overflows to inf
    {"temperature": 1.0, "repetition_penalty": 1e-40},  # dividing positive logits by it overflows to inf
    {"temperature": 2.0, "top_p": 1e-40, "repetition_penalty": 1e-30, "presence_penalty": -2.0},
])
def test_sampling_values_the_schema_accepts_never_fail_their_batch_mates(tiny_model_dir, hostile):
    engine, proc = build(tiny_model_dir)
    reference = run_all(engine, [chat(proc, "a", "First question, about cats."),
                                 chat(proc, "b", image_question())])
    out = run_all(engine, [chat(proc, "a", "First question, about cats."), chat(proc, "h", "Odd sampling", **hostile),
                           chat(proc, "b", image_question())])
    assert out["h"][1] in (FinishReason.STOP, FinishReason.LENGTH) and out["h"][2] is None
    assert out["a"] == reference["a"] and out["b"] == reference["b"]


HANG_S = 300.0  # far beyond what these few tiny requests need on any machine: only a hang reaches it


class AddFails:
    """The engine, except that adding one request id raises an error that is not an admission refusal (a bug in
    building its bookkeeping, say). AsyncEngine only sees the engine it is given: this is its seam."""

    def __init__(self, engine: LLMEngine, request_id: str) -> None:
        self._engine = engine
        self._request_id = request_id

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def add_request(self, request) -> None:
        if request.request_id == self._request_id:
            raise RuntimeError("injected add failure")
        self._engine.add_request(request)


def test_a_request_that_fails_to_be_added_fails_alone_and_the_loop_keeps_serving(tiny_model_dir):
    engine, proc = build(tiny_model_dir)
    reference = run_all(engine, requests(proc))
    engine, proc = build(tiny_model_dir)
    async_engine = AsyncEngine(AddFails(engine, "b"))
    async_engine.start()

    async def collect(request):
        try:
            return [out async for out in async_engine.generate(request)]
        except Exception as e:  # noqa: BLE001 - the failed request's error is what the test looks at
            return e

    async def go():
        together = await asyncio.gather(*(collect(r) for r in requests(proc)))
        after = await collect(requests(proc)[0])  # the loop is still serving
        return together, after

    async def bounded():  # a dead loop would leave every stream waiting forever: fail instead of hanging
        return await asyncio.wait_for(go(), timeout=HANG_S)

    try:
        together, after = asyncio.run(bounded())
    finally:
        async_engine.shutdown()
    by_id = dict(zip("abcd", together, strict=True))
    assert isinstance(by_id["b"], RuntimeError)
    for rid in "acd":
        tokens = [t for out in by_id[rid] for t in out.new_token_ids]
        assert (tokens, by_id[rid][-1].finish_reason) == reference[rid][:2]
    assert [t for out in after for t in out.new_token_ids] == reference["a"][0]
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
