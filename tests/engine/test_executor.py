"""The scheduler -> runner boundary is plain data, and the runner owns per-request state for exactly as long as the
request lives."""

from __future__ import annotations

import pickle

from firsttoken.batch import RunnerOutput, ScheduledBatch
from firsttoken.types import FinishReason
from tests.engine.test_faults import build, chat, image_question, run_all


class PickledExecutor:
    """Every batch and every output crosses a pickle round trip, as it would to another process or a Ray actor."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_batches = 0

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        self.num_batches += 1
        batch = pickle.loads(pickle.dumps(batch))
        return pickle.loads(pickle.dumps(self.inner.execute(batch)))

    def finish_step(self) -> RunnerOutput | None:
        return pickle.loads(pickle.dumps(self.inner.finish_step()))

    @property
    def encoder_cache_bytes(self) -> int:
        return self.inner.encoder_cache_bytes


def requests(proc):
    return [chat(proc, "text", "Tell me about the sea."), chat(proc, "img", image_question()),
            chat(proc, "seeded", "Roll a die", temperature=1.0, seed=7)]


def test_batches_that_cross_a_process_boundary_give_the_same_tokens(tiny_model_dir):
    engine, proc = build(tiny_model_dir)
    reference = run_all(engine, requests(proc))
    engine, proc = build(tiny_model_dir)
    engine.executor = PickledExecutor(engine.executor)
    assert run_all(engine, requests(proc)) == reference
    assert engine.executor.num_batches > 3


def test_the_runner_drops_a_request_state_when_it_finishes_or_is_aborted(tiny_model_dir):
    engine, proc = build(tiny_model_dir)
    runner = engine.executor.runner
    for r in requests(proc):
        engine.add_request(r)
    engine.step()  # admitted: the runner has seen all three
    assert set(runner.requests) == {"text", "img", "seeded"}
    engine.abort("img")
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason in (None, FinishReason.STOP, FinishReason.LENGTH)
    assert runner.requests == {}
    assert engine.stats().kv_blocks_used == 0
