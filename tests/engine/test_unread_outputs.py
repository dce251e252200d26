"""AsyncEngine bounds what a request may leave unread: a consumer that stops taking outputs gets its request
aborted (KV freed, counted once) instead of generating for nobody; one that keeps reading is never touched."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from transformers import AutoTokenizer

from firsttoken.api.protocol import ChatCompletionRequest
from firsttoken.config import (
    CacheConfig,
    EngineConfig,
    GenerationDefaults,
    SchedulerConfig,
)
from firsttoken.engine.async_engine import (
    ABORT_CLIENT_NOT_READING,
    AsyncEngine,
)
from firsttoken.engine.engine import LLMEngine
from firsttoken.inputs.processor import InputProcessor
from firsttoken.types import FinishReason
from tests.helpers import process

MAX_UNREAD = 4


def build(model_dir: Path, max_unread: int = MAX_UNREAD) -> tuple[AsyncEngine, InputProcessor, list[tuple[str, str]]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_bytes=8 * 2**20),
                       scheduler=SchedulerConfig(max_batched_tokens=128, step_time_target="off"), max_unread_outputs=max_unread)
    engine = LLMEngine(model_dir, cfg, tok.backend_tokenizer)
    aborts: list[tuple[str, str]] = []
    async_engine = AsyncEngine(engine, on_abort=lambda rid, why: aborts.append((rid, why)))
    proc = InputProcessor(tok, engine.model_config, GenerationDefaults.from_pretrained(model_dir),
                          max_model_len=engine.max_model_len)
    return async_engine, proc, aborts


def long_request(proc: InputProcessor, request_id: str, max_tokens: int):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Go on."}],
                                                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0})
    return process(proc, req, request_id)


async def wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_a_consumer_that_stops_reading_is_aborted_and_its_kv_freed(tiny_model_dir: Path) -> None:
    engine, proc, aborts = build(tiny_model_dir)
    engine.start()

    async def go():
        outputs = engine.generate(long_request(proc, "stalled", 2000))
        first = await outputs.__anext__()  # then read nothing more
        await wait_until(lambda: aborts)  # the engine noticed by itself
        stats = engine.engine.stats()
        rest = [out async for out in outputs]  # what was left in the queue, read late
        return first, stats, rest

    try:
        first, stats, rest = asyncio.run(go())
    finally:
        engine.shutdown()
    assert not first.finished and aborts == [("stalled", ABORT_CLIENT_NOT_READING)]
    assert stats.num_running == 0 and stats.kv_blocks_used == 0  # aborted while the consumer still held it
    assert len(rest) <= MAX_UNREAD + 1 and rest[-1].finished and rest[-1].finish_reason is FinishReason.ABORT
    assert rest[-1].num_output_tokens <= MAX_UNREAD + 2  # generated: the one read, the unread, the one dropped


def test_a_consumer_that_keeps_reading_is_never_aborted(tiny_model_dir: Path) -> None:
    engine, proc, aborts = build(tiny_model_dir, EngineConfig().max_unread_outputs)
    engine.start()

    async def go():
        return [out async for out in engine.generate(long_request(proc, "reader", 400))]

    try:
        outs = asyncio.run(go())
    finally:
        engine.shutdown()
    assert aborts == [] and outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == 400
