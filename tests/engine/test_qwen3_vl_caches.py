"""Qwen3-VL through the engine: the long lane splits every image's encode one vision block per step (DeepStack
blocks included) and answers as whole encodes do. What its caches keep (DeepStack tensors with the main ones) is
test_caches.py's, run on every family."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from firsttoken.config import SchedulerConfig
from firsttoken.models.checkpoint import make_model
from tests.engine.test_caches import Harness, pictures, user  # noqa: F401  (pictures: its fixture)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("qwen3-vl-tiny"), size="tiny", seed=0, family="qwen3-vl")


class EncodeSteps:
    """A fault hook that only counts the steps in which each request ran vision-tower units."""

    def __init__(self) -> None:
        self.by_request: Counter[str] = Counter()

    def __call__(self, stage: str, request_id: str) -> None:
        if stage == "encode":
            self.by_request[request_id] += 1


def test_long_lane_splits_each_encode_one_block_per_step_and_answers_as_whole_encodes(qwen3_dir, pictures):
    """16 tokens of long-lane work per step and images of 20+ visual tokens (a vision block costs that many):
    every image's 4 blocks run in 4 steps, so the encode is split after each DeepStack block too."""
    hook = EncodeSteps()
    lanes = Harness(qwen3_dir, fault_hook=hook, scheduler=SchedulerConfig(
        max_batched_tokens=96, long_prompt_threshold=1, long_step_tokens=16, step_time_target="off"))
    whole = Harness(qwen3_dir, scheduler=SchedulerConfig(max_batched_tokens=4096, scheduling="fcfs"))
    messages = [user("Describe both.", pictures[0], pictures[1])]
    ids, _, _ = lanes.run(messages)
    depth = lanes.engine.model_config.vision.depth
    assert list(hook.by_request.values()) == [2 * depth]  # (image, step) pairs: one block of one image per step
    assert ids == whole.run(messages)[0]
