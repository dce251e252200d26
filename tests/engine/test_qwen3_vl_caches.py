"""Qwen3-VL through the engine and the input processor: the encoder cache holds each image's DeepStack tensors
with its main ones, so a repeated image or a follow-up turn runs no vision block and answers exactly as the same
request does alone; the long lane splits every image's encode one vision block per step (DeepStack blocks
included) and answers as whole encodes do."""

from __future__ import annotations

from collections import Counter
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


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("qwen3-vl-tiny"), size="tiny", seed=0, family="qwen3-vl")


@pytest.fixture(scope="module")
def pictures():
    return [make_image(168, 112, seed=1), make_image(112, 196, seed=2), make_image(140, 140, seed=3)]


class EncodeSteps:
    """A fault hook that only counts the steps in which each request ran vision-tower units."""

    def __init__(self) -> None:
        self.by_request: Counter[str] = Counter()

    def __call__(self, stage: str, request_id: str) -> None:
        if stage == "encode":
            self.by_request[request_id] += 1


class Qwen3Harness(Harness):
    """test_caches' harness with the scheduler, caches and fault hook chosen by the test."""

    def __init__(self, model_dir: Path, scheduler: SchedulerConfig = SchedulerConfig(max_batched_tokens=96, step_time_target="off"),
                 prefix_cache: bool = True, encoder_cache: bool = True, hook: EncodeSteps | None = None) -> None:
        tok = AutoTokenizer.from_pretrained(model_dir)
        cache = CacheConfig(kv_cache_memory_bytes=8 * 2**20, enable_prefix_caching=prefix_cache,
                            enable_encoder_cache=encoder_cache)
        self.engine = LLMEngine(model_dir, EngineConfig(dtype="float32", cache=cache, scheduler=scheduler),
                                tok.backend_tokenizer, fault_hook=hook)
        self.processor = InputProcessor(tok, self.engine.model_config, GenerationDefaults.from_pretrained(model_dir),
                                        max_model_len=self.engine.max_model_len)


def caches_off(model_dir: Path) -> Qwen3Harness:
    return Qwen3Harness(model_dir, prefix_cache=False, encoder_cache=False)


def test_the_same_image_again_is_not_encoded_and_answers_as_it_does_alone(qwen3_dir, pictures):
    h = Qwen3Harness(qwen3_dir)
    h.run([system("You are assistant one."), user("What is shown?", pictures[0])])
    second = [system("You are assistant two."), user("What is shown?", pictures[0])]
    ids, _, stats = h.run(second)
    assert h.vision_calls == 1
    assert (stats.num_images_encoded, stats.num_encoder_cache_hits) == (0, 1)
    assert ids == caches_off(qwen3_dir).run(second)[0]
    # the cache entry is the main tensor and one per DeepStack feature: 1 + 2 tensors of [tokens, hidden] fp32
    config = h.engine.model_config
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": second, "max_tokens": 1})
    num_tokens = process(h.processor, body, "probe").images[0].num_tokens
    tensors = 1 + len(config.vision.deepstack_visual_indexes)
    assert h.engine.stats().encoder_cache_bytes == num_tokens * config.hidden_size * 4 * tensors


def test_follow_up_turn_reuses_prompt_blocks_and_deepstack_features(qwen3_dir, pictures):
    h = Qwen3Harness(qwen3_dir)
    first = [user("Compare these three pictures.", *pictures)]
    _, text, _ = h.run(first)
    assert h.vision_calls == 3
    follow = first + [{"role": "assistant", "content": text}, user("And the second one?")]
    ids, _, stats = h.run(follow)
    assert h.vision_calls == 3  # no image encoded again
    assert stats.num_cached_prompt_tokens == (h.prompt_len(first) // 16) * 16
    assert ids == caches_off(qwen3_dir).run(follow)[0]


@pytest.mark.parametrize("case", ["one_image", "three_images"])
def test_greedy_outputs_identical_with_caches_on_and_off(qwen3_dir, pictures, case):
    on, off = Qwen3Harness(qwen3_dir), caches_off(qwen3_dir)
    images = pictures[:1] if case == "one_image" else pictures
    for messages in ([user("What is it?", *images)], [system("Be brief."), user("What is it?", *images)]):
        assert on.run(messages)[0] == off.run(messages)[0]


def test_long_lane_splits_each_encode_one_block_per_step_and_answers_as_whole_encodes(qwen3_dir, pictures):
    """16 tokens of long-lane work per step and images of 20+ visual tokens (a vision block costs that many):
    every image's 4 blocks run in 4 steps, so the encode is split after each DeepStack block too."""
    hook = EncodeSteps()
    lanes = Qwen3Harness(qwen3_dir, hook=hook, scheduler=SchedulerConfig(
        max_batched_tokens=96, long_prompt_threshold=1, long_step_tokens=16, step_time_target="off"))
    whole = Qwen3Harness(qwen3_dir, scheduler=SchedulerConfig(max_batched_tokens=4096, scheduling="fcfs"))
    messages = [user("Describe both.", pictures[0], pictures[1])]
    ids, _, _ = lanes.run(messages)
    depth = lanes.engine.model_config.vision.depth
    assert list(hook.by_request.values()) == [2 * depth]  # (image, step) pairs: one block of one image per step
    assert ids == whole.run(messages)[0]
