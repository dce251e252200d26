"""Qwen2.5-VL through the real engine: the encoder and prefix caches reuse its work, and the long lane splits its
vision tower across steps by each block's cost (a windowed block costs a fraction of a full one), with the same
greedy tokens as running the whole prompt in one step."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from firsttoken.api.protocol import ChatCompletionRequest
from firsttoken.config import CacheConfig, EngineConfig, GenerationDefaults, SchedulerConfig
from firsttoken.engine.engine import LLMEngine
from firsttoken.inputs.processor import InputProcessor
from firsttoken.models.checkpoint import make_model
from tests.e2e.conftest import make_image
from tests.engine.test_caches import Harness, system, user
from tests.helpers import process

FAMILY = "qwen2.5-vl"
_ids = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("q25-engine"), size="tiny", seed=0, family=FAMILY)


@pytest.fixture(scope="module")
def pictures():
    # 168x112: 6 x 4 merged tokens (a short last window); 112x196: 4 x 7; 140x140: 5 x 5
    return [make_image(168, 112, seed=1), make_image(112, 196, seed=2), make_image(140, 140, seed=3)]


# ---------------------------------------------------------------- encoder cache and prefix cache


def test_same_image_from_five_users_is_encoded_once(model_dir, pictures):
    h = Harness(model_dir)
    stats = [h.run([system(f"You are assistant number {i}."), user("What is shown?", pictures[0])])[2]
             for i in range(5)]
    assert h.vision_calls == 1
    assert [s.num_images_encoded for s in stats] == [1, 0, 0, 0, 0]
    assert [s.num_encoder_cache_hits for s in stats] == [0, 1, 1, 1, 1]


def test_follow_up_turn_reuses_every_cached_block_and_encodes_nothing(model_dir, pictures):
    h = Harness(model_dir)
    first = [user("Compare these three pictures.", *pictures)]
    _, text, _ = h.run(first)
    assert h.vision_calls == 3
    follow = first + [{"role": "assistant", "content": text}, user("And the second one?")]
    _, _, stats = h.run(follow)
    assert h.vision_calls == 3
    assert stats.num_cached_prompt_tokens == (h.prompt_len(first) // 16) * 16
    assert h.prompt_len(follow) - stats.num_cached_prompt_tokens < h.prompt_len(follow) // 2


@pytest.mark.parametrize("case", ["three_images", "multi_turn"])
def test_greedy_outputs_identical_with_caches_on_and_off(model_dir, pictures, case):
    on, off = Harness(model_dir), Harness(model_dir, prefix_cache=False, encoder_cache=False)
    if case == "multi_turn":
        first = [user("Look.", pictures[1])]
        _, text, _ = on.run(first)
        turns = [first, first + [{"role": "assistant", "content": text}, user("More detail?")]]
    else:
        turns = [[user("Which differ?", *pictures)]] * 2
    for messages in turns:
        assert on.run(messages)[0] == off.run(messages)[0]
    assert on.vision_calls == (len(pictures) if case == "three_images" else 1)


# ---------------------------------------------------------------- lanes: the tower split across steps


class RecordingExecutor:
    """The engine's executor, recording which request ids and encoder units each step carried."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.steps: list[tuple[set[str], list]] = []

    def execute(self, batch):
        self.steps.append(({c.request_id for c in batch.chunks}, list(batch.encoder_work)))
        return self.inner.execute(batch)

    @property
    def encoder_cache_bytes(self) -> int:
        return self.inner.encoder_cache_bytes


def build(model_dir: Path, **scheduler) -> tuple[LLMEngine, InputProcessor, RecordingExecutor]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_bytes=8 * 2**20),
                       scheduler=SchedulerConfig(**scheduler))
    engine = LLMEngine(model_dir, cfg, tok.backend_tokenizer)
    processor = InputProcessor(tok, engine.model_config, GenerationDefaults.from_pretrained(model_dir),
                               max_model_len=engine.max_model_len)
    recorder = RecordingExecutor(engine.executor)
    engine.executor = recorder
    return engine, processor, recorder


def request(processor: InputProcessor, messages: list[dict], max_tokens: int = 8):
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0})
    return process(processor, body, f"r{next(_ids)}")


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.scheduler.check_invariants()
    return tokens


LONG_STEP_TOKENS = 320


def test_long_lane_splits_the_tower_by_block_cost_and_answers_like_one_whole_step(model_dir):
    picture = make_image(448, 448, seed=7)  # 32 x 32 patches: 256 visual tokens, 16 whole windows
    messages = [user("Describe every detail of this picture.", picture)]
    lanes, proc, recorder = build(model_dir, max_batched_tokens=512, long_prompt_threshold=64,
                                  long_step_tokens=LONG_STEP_TOKENS)
    long_request = request(proc, messages)
    (image,) = long_request.images
    costs = [u.cost_tokens for u in image.encoder_units]
    assert costs[1] == costs[3] == 256 and costs[0] == costs[2] < 256 / 3  # full blocks 1, 3; windowed 0, 2
    lanes.add_request(long_request)
    lanes.step()  # the image's first unit(s) run
    short = request(proc, [user("Hi")], max_tokens=1)
    lanes.add_request(short)
    got = run_to_end(lanes)

    units = [[w for w in work if w.content_hash == image.content_hash] for _, work in recorder.steps]
    units_per_step = [sum(w.num_units for w in ws) for ws in units if ws]
    assert sum(units_per_step) == len(costs) == 4
    assert 2 <= len(units_per_step) < len(costs)  # split; a windowed block shares a step with a full one
    for ws in units:
        for w in ws:
            spent = sum(costs[w.start_unit : w.start_unit + w.num_units])
            assert w.num_units == 1 or spent <= LONG_STEP_TOKENS
    first_encode = next(i for i, ws in enumerate(units) if ws)
    last_encode = max(i for i, ws in enumerate(units) if ws)
    short_steps = [i for i, (ids, _) in enumerate(recorder.steps) if short.request_id in ids]
    assert short_steps[0] <= last_encode and short_steps[0] > first_encode  # answered while the image encodes

    whole, proc2, recorder2 = build(model_dir, max_batched_tokens=4096, scheduling="fcfs")
    whole.add_request(request(proc2, messages))
    (expected,) = run_to_end(whole).values()
    assert got[long_request.request_id] == expected
    assert [sum(w.num_units for w in work) for _, work in recorder2.steps if work] == [4]  # one step, whole tower
