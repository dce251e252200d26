"""Qwen2.5-VL through the real engine: the long lane splits its vision tower across steps by each block's cost (a
windowed block costs a fraction of a full one), with the same greedy tokens as running the whole prompt in one
step; the same frames at another fps answer as they do cold (their time positions differ). Its caches are
test_caches.py's, run on every family."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from firsttoken.api.protocol import ChatCompletionRequest
from firsttoken.config import SchedulerConfig
from firsttoken.engine.engine import LLMEngine
from firsttoken.models.checkpoint import make_model
from tests.e2e.conftest import make_image
from tests.engine.test_caches import Harness, frames, user, video  # noqa: F401  (frames: its fixture)
from tests.helpers import RecordingExecutor, process

FAMILY = "qwen2.5-vl"
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Overrides the session's Qwen2-VL checkpoint for this module: the tests imported from test_caches.py below
    run on Qwen2.5-VL."""
    return make_model(tmp_path_factory.mktemp("q25-engine"), size="tiny", seed=0, family=FAMILY)


# ---------------------------------------------------------------- lanes: the tower split across steps


def build(model_dir: Path, **scheduler) -> tuple[Harness, RecordingExecutor]:
    h = Harness(model_dir, scheduler=SchedulerConfig(**{"step_time_target": "off", **scheduler}))
    recorder = RecordingExecutor(h.engine.executor)
    h.engine.executor = recorder
    return h, recorder


def request(h: Harness, messages: list[dict], max_tokens: int = 8):
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0})
    return process(h.processor, body, f"r{next(_ids)}")


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.scheduler.check_invariants()
    return tokens


LONG_STEP_TOKENS = 320


def test_long_lane_splits_the_tower_by_block_cost_and_answers_like_one_whole_step(tiny_model_dir):
    picture = make_image(448, 448, seed=7)  # 32 x 32 patches: 256 visual tokens, 16 whole windows
    messages = [user("Describe every detail of this picture.", picture)]
    lanes, recorder = build(tiny_model_dir, max_batched_tokens=512, long_prompt_threshold=64,
                            long_step_tokens=LONG_STEP_TOKENS)
    long_request = request(lanes, messages)
    (image,) = long_request.images
    costs = [u.cost_tokens for u in image.encoder_units]
    assert costs[1] == costs[3] == 256 and costs[0] == costs[2] < 256 / 3  # full blocks 1, 3; windowed 0, 2
    lanes.engine.add_request(long_request)
    lanes.engine.step()  # the image's first unit(s) run
    short = request(lanes, [user("Hi")], max_tokens=1)
    lanes.engine.add_request(short)
    got = run_to_end(lanes.engine)

    units = [[w for w in b.encoder_work if w.content_hash == image.content_hash] for b in recorder.batches]
    units_per_step = [sum(w.num_units for w in ws) for ws in units if ws]
    assert sum(units_per_step) == len(costs) == 4
    assert 2 <= len(units_per_step) < len(costs)  # split; a windowed block shares a step with a full one
    for ws in units:
        for w in ws:
            spent = sum(costs[w.start_unit : w.start_unit + w.num_units])
            assert w.num_units == 1 or spent <= LONG_STEP_TOKENS
    first_encode = next(i for i, ws in enumerate(units) if ws)
    last_encode = max(i for i, ws in enumerate(units) if ws)
    short_steps = [i for i, b in enumerate(recorder.batches) if short.request_id in {c.request_id for c in b.chunks}]
    assert short_steps[0] <= last_encode and short_steps[0] > first_encode  # answered while the image encodes

    whole, recorder2 = build(tiny_model_dir, max_batched_tokens=4096, scheduling="fcfs")
    whole.engine.add_request(request(whole, messages))
    (expected,) = run_to_end(whole.engine).values()
    assert got[long_request.request_id] == expected
    assert [sum(w.num_units for w in b.encoder_work) for b in recorder2.batches if b.encoder_work] == [4]  # one step


# ---------------------------------------------------------------- caches: the same frames at another fps


def test_the_same_frames_at_another_fps_answer_as_a_cold_run_at_that_fps(tiny_model_dir, frames):
    """Qwen2.5-VL plays temporal grid g at time g * tokens_per_second * 2 / fps: the frames' pixels and so their
    encoder outputs are the same at any fps, their KV is not past grid 0."""
    at_two, at_half = [video("What happens?", frames, 2.0)], [video("What happens?", frames, 0.5)]
    cold = Harness(tiny_model_dir).run(at_half, max_tokens=12)[0]
    warm = Harness(tiny_model_dir)
    first = warm.run(at_two, max_tokens=12)[0]
    assert first != cold  # the model answers the two fps differently, so a wrong reuse shows in the answer
    ids, _, stats = warm.run(at_half, max_tokens=12)
    assert ids == cold
    grids = [im for im in request(warm, at_half).images if im.kind == "video"]
    assert len(grids) == 4 and (stats.num_images_encoded, stats.num_encoder_cache_hits) == (0, 4)
    # KV reuse stops at the first block holding a token of grid 1, the first at another time position
    block_size = warm.engine.scheduler.kv.block_size
    assert stats.num_cached_prompt_tokens == grids[1].offset // block_size * block_size > 0
