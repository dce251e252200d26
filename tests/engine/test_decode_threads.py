"""Steps that only decode run on fewer torch threads than prefill and vision steps (--decode-threads), while
firsttoken's own kernels keep every thread, and the answers do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from firsttoken.config import CacheConfig, EngineConfig, GenerationDefaults, SchedulerConfig
from firsttoken.engine.engine import LLMEngine
from firsttoken.inputs.processor import InputProcessor
from firsttoken.kernels import cpu_linear
from firsttoken.kernels.cpu_linear import kernel_pool_threads
from firsttoken.loading.fused_decode import FusedDecode
from firsttoken.runner.model_runner import DEFAULT_THREADS
from tests.engine.test_faults import chat, image_question, run_all


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def build(model_dir: Path, decode_threads: int | None, num_threads: int | None = 2, cpu_kernels: str = "auto"):
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = EngineConfig(dtype="float32", num_threads=num_threads, decode_threads=decode_threads, cpu_kernels=cpu_kernels,
                       cache=CacheConfig(kv_cache_memory_bytes=8 * 2**20),
                       scheduler=SchedulerConfig(max_batched_tokens=128, step_time_target="off"))
    engine = LLMEngine(model_dir, cfg, tok.backend_tokenizer)
    proc = InputProcessor(tok, engine.model_config, GenerationDefaults.from_pretrained(model_dir),
                          max_model_len=engine.max_model_len)
    return engine, proc


def record_threads(engine: LLMEngine, kernels: list[tuple[str, int, str]] | None = None) -> list[tuple[str, int]]:
    """(what ran, torch threads at that moment) for every forward and vision-tower call, in order; into ``kernels``
    (what ran, the kernels' own threads or None for torch's team, how long their idle workers spin) for every
    forward."""
    runner = engine.executor.runner
    calls: list[tuple[str, int]] = []
    forward, run_units = runner.model.forward_step, runner.model.visual.run_units  # the runner's forward

    def recorded_forward(input_ids, *args, **kwargs):
        calls.append((f"forward:{input_ids.shape[0]}", torch.get_num_threads()))
        if kernels is not None:
            kernels.append((f"forward:{input_ids.shape[0]}", kernel_pool_threads(), cpu_linear._spin[0]))
        return forward(input_ids, *args, **kwargs)

    def recorded_units(*args, **kwargs):
        calls.append(("vision", torch.get_num_threads()))
        return run_units(*args, **kwargs)

    runner.model.forward_step = recorded_forward
    runner.model.visual.run_units = recorded_units
    return calls


def requests(proc):
    return [chat(proc, "text", "Tell me about the sea."), chat(proc, "img", image_question())]


def test_decode_only_steps_run_on_one_thread_fewer_and_everything_else_on_all(tiny_model_dir):
    torch.set_num_threads(1)  # whatever the calling thread had, the engine's steps run on its plan
    # torch's product (no fused decode layers): decode steps on --decode-threads (default all but one)
    engine, proc = build(tiny_model_dir, decode_threads=None, cpu_kernels="off")
    calls = record_threads(engine)
    answers = run_all(engine, requests(proc))
    vision = [n for what, n in calls if what == "vision"]
    prefill = [n for what, n in calls if what.startswith("forward:") and int(what.split(":")[1]) > 2]
    decode = [n for what, n in calls if what in ("forward:1", "forward:2")]
    assert vision and set(vision) == {2}  # the image's tower ran on both threads
    assert prefill and set(prefill) == {2}  # so did every prefill forward
    assert len(decode) >= 7 and set(decode) == {1}  # 8 tokens each: the decode-only steps ran on one
    # The count changes only when a step's kind changes, not every step.
    assert engine.executor.runner.threads.switches <= 5

    engine, proc = build(tiny_model_dir, decode_threads=2, cpu_kernels="off")  # every step on all: the same answers
    calls = record_threads(engine)
    assert run_all(engine, requests(proc)) == answers
    assert {n for _, n in calls} == {2}
    assert engine.executor.runner.threads.switches == 1  # once: from the 1 the previous engine's decode left


def test_fused_decode_steps_give_the_kernels_every_thread_and_torch_one(tiny_model_dir):
    """A decode step the fused layers take gives torch's few ops one thread whatever --decode-threads says and the
    kernels all --num-threads as workers of their own, which spin between such steps; every other step leaves the
    kernels on torch's OpenMP team (None) and the workers' spin short."""
    assert cpu_linear.kernel_unavailable() is None  # CI's machines have AVX2 and gcc
    for decode_threads in (None, 2):
        engine, proc = build(tiny_model_dir, decode_threads=decode_threads, cpu_kernels="on")
        assert isinstance(engine.executor.runner.model.decode, FusedDecode)
        kernels: list[tuple[str, int, str]] = []
        calls = record_threads(engine, kernels)
        run_all(engine, requests(proc))
        decode = [n for what, n in calls if what in ("forward:1", "forward:2")]
        prefill = [n for what, n in calls if what.startswith("forward:") and int(what.split(":")[1]) > 2]
        assert len(decode) >= 7 and set(decode) == {1} and prefill and set(prefill) == {2}
        assert len(kernels) == len(decode) + len(prefill)
        is_decode = [what in ("forward:1", "forward:2") for what, _, _ in kernels]
        assert [n for _, n, _ in kernels] == [2 if d else None for d in is_decode]
        assert [spin for _, _, spin in kernels] == ["decode" if d else "other" for d in is_decode]


def test_one_thread_stays_one_and_no_engine_inherits_a_decode_step_count(tiny_model_dir):
    engine, proc = build(tiny_model_dir, decode_threads=None, num_threads=1)
    calls = record_threads(engine)
    run_all(engine, [chat(proc, "text", "Hello there.")])
    assert {n for _, n in calls} == {1}
    # No --num-threads: "all" is torch's count when firsttoken was imported, not what the last decode step left in
    # this thread (an engine built after another one in the same thread used to start one thread short).
    engine, proc = build(tiny_model_dir, decode_threads=8, num_threads=None, cpu_kernels="off")  # more than there
    assert engine.executor.runner.threads.threads == DEFAULT_THREADS  # are: all
    calls = record_threads(engine)
    run_all(engine, [chat(proc, "text", "Hello there.")])
    assert {n for _, n in calls} == {DEFAULT_THREADS}


def test_decode_threads_must_be_at_least_one_and_at_most_num_threads():
    with pytest.raises(ValueError, match="decode_threads"):
        EngineConfig(decode_threads=0)
    with pytest.raises(ValueError, match="must not exceed num_threads"):
        EngineConfig(num_threads=2, decode_threads=3)
