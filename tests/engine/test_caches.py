"""Reuse of computed work, seen from the engine, for every family the registry serves: the vision tower's own call
count, cached prompt tokens, what the encoder cache holds of an image (every ImageEmbeddings tensor: DeepStack
features too), and greedy outputs that do not change when the caches are switched off."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from firsttoken.api.protocol import ChatCompletionRequest
from firsttoken.config import (
    CacheConfig,
    EngineConfig,
    GenerationDefaults,
    SchedulerConfig,
)
from firsttoken.engine.engine import LLMEngine
from firsttoken.inputs.processor import InputProcessor
from firsttoken.models.checkpoint import make_model
from firsttoken.models.registry import families, family_named, load_model_config
from tests.e2e.conftest import image_data_url, make_image
from tests.helpers import assert_equal_keys_mean_equal_inputs, make_processor, process

_ids = itertools.count()


@pytest.fixture(scope="module", params=[f.name for f in families()])
def tiny_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Overrides the session's Qwen2-VL checkpoint here: each family's tiny checkpoint."""
    return make_model(tmp_path_factory.mktemp(f"caches-{request.param}"), size="tiny", seed=0, family=request.param)


class Harness:
    def __init__(self, model_dir: Path, prefix_cache: bool = True, encoder_cache: bool = True,
                 scheduler: SchedulerConfig | None = None, fault_hook=None) -> None:
        tok = AutoTokenizer.from_pretrained(model_dir)
        cfg = EngineConfig(
            dtype="float32",
            cache=CacheConfig(kv_cache_memory_bytes=8 * 2**20, enable_prefix_caching=prefix_cache,
                              enable_encoder_cache=encoder_cache),
            scheduler=scheduler or SchedulerConfig(max_batched_tokens=96, step_time_target="off"),
        )
        self.engine = LLMEngine(model_dir, cfg, tok.backend_tokenizer, fault_hook=fault_hook)
        self.processor = InputProcessor(tok, self.engine.model_config, GenerationDefaults.from_pretrained(model_dir),
                                        max_model_len=self.engine.max_model_len)

    def run(self, messages: list[dict], max_tokens: int = 8):
        """Greedy-generate one chat request to completion; returns (token ids, text, the engine's stats)."""
        body = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        )
        request = process(self.processor, body, f"r{next(_ids)}")
        self.engine.add_request(request)
        ids, text, stats = [], "", None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                ids += out.new_token_ids
                text += out.new_text
                stats = out.stats
            self.engine.scheduler.check_invariants()
        assert self.engine.stats().kv_blocks_used == 0
        return ids, text, stats

    def prompt_len(self, messages: list[dict]) -> int:
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "max_tokens": 1})
        return process(self.processor, body, "count").num_prompt_tokens

    @property
    def vision_calls(self) -> int:
        return self.engine.stats().num_images_encoded


def user(text: str, *images) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": image_data_url(im)}} for im in images]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def video(text: str, frames: list[str], fps: float, *images) -> dict:
    """A user turn of a video given as frames (data URLs) played at ``fps``, then ``images``, then the text."""
    parts = [{"type": "video", "video": frames, "fps": fps}]
    parts += [{"type": "image_url", "image_url": {"url": image_data_url(im)}} for im in images]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def frames() -> list[str]:
    """8 frames of one size (4 temporal grids): the same pixels whatever fps a request plays them at."""
    return [image_data_url(make_image(112, 84, seed=20 + k)) for k in range(8)]


@pytest.fixture(scope="module")
def pictures():
    return [make_image(168, 112, seed=1), make_image(112, 196, seed=2), make_image(140, 140, seed=3)]


def test_same_image_from_five_users_is_encoded_once(tiny_model_dir, pictures):
    h = Harness(tiny_model_dir)
    timelines = [h.run([system(f"You are assistant number {i}."), user("What is shown?", pictures[0])])[2]
                 for i in range(5)]
    assert h.vision_calls == 1
    assert [t.num_images_encoded for t in timelines] == [1, 0, 0, 0, 0]
    assert [t.num_encoder_cache_hits for t in timelines] == [0, 1, 1, 1, 1]


def test_the_encoder_cache_holds_every_tensor_of_an_image_as_its_family_sizes_it(tiny_model_dir, pictures):
    """The main rows and, for DeepStack families, one tensor per feature: what the engine's capacity assumed."""
    h = Harness(tiny_model_dir)
    messages = [user("What is shown?", pictures[0])]
    h.run(messages)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "max_tokens": 1})
    num_tokens = process(h.processor, body, "probe").images[0].num_tokens
    config = h.engine.model_config
    per_token = family_named(config.family).encoder_bytes_per_token(config, 4)  # float32
    assert h.engine.stats().encoder_cache_bytes == num_tokens * per_token >= num_tokens * config.hidden_size * 4


def test_switching_the_encoder_cache_off_encodes_every_time(tiny_model_dir, pictures):
    h = Harness(tiny_model_dir, prefix_cache=False, encoder_cache=False)
    for i in range(3):
        h.run([system(f"Assistant {i}."), user("What is shown?", pictures[0])])
    assert h.vision_calls == 3


@pytest.mark.parametrize("encoder_cache", [True, False], ids=["encoder cache on", "encoder cache off"])
def test_the_same_image_twice_in_one_prompt_is_encoded_once_and_counted_once(tiny_model_dir, pictures,
                                                                              encoder_cache):
    # the prompt's chunks (16 tokens a step) pass the first copy before they reach the second: its embeddings
    # must still be there, with the cache off too, and the request's stats count each unique image once
    h = Harness(tiny_model_dir, prefix_cache=False, encoder_cache=encoder_cache,
                scheduler=SchedulerConfig(max_batched_tokens=16, step_time_target="off"))
    messages = [user("Are these the same?", pictures[0], pictures[1], pictures[0])]
    assert h.prompt_len(messages) > 4 * 16
    _, _, stats = h.run(messages)
    assert h.vision_calls == 2 and stats.num_images_encoded == 2
    assert stats.num_encoder_cache_hits == 0
    assert h.engine.stats().encoder_cache_hits == 0
    _, _, again = h.run(messages)  # the same prompt again: with the cache, both unique images are hits
    assert (again.num_images_encoded, again.num_encoder_cache_hits) == ((0, 2) if encoder_cache else (2, 0))


def test_follow_up_turn_prefills_only_its_new_tokens(tiny_model_dir, pictures):
    h = Harness(tiny_model_dir)
    first = [user("Compare these three pictures.", *pictures)]
    ids, text, t1 = h.run(first)
    assert h.vision_calls == 3
    follow = first + [{"role": "assistant", "content": text}, user("And the second one?")]
    _, _, t2 = h.run(follow)
    assert h.vision_calls == 3  # no image encoded again
    prompt_len, first_len = h.prompt_len(follow), h.prompt_len(first)
    # every full block of the first turn's prompt is reused; only the rest is prefilled
    assert t2.num_cached_prompt_tokens == (first_len // 16) * 16
    assert prompt_len - t2.num_cached_prompt_tokens < prompt_len // 2


def test_two_different_images_of_the_same_size_share_neither_kv_nor_embeddings(tiny_model_dir):
    h = Harness(tiny_model_dir)
    a, b = make_image(140, 140, seed=10), make_image(140, 140, seed=11)
    h.run([user("Describe.", a)])
    _, _, t = h.run([user("Describe.", b)])
    assert h.vision_calls == 2
    assert t.num_encoder_cache_hits == 0
    # the shared template head may be reused, but no block that covers image tokens
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [user("Describe.", b)], "max_tokens": 1})
    request = process(h.processor, body, "probe")
    assert t.num_cached_prompt_tokens <= (request.images[0].offset // 16) * 16


@pytest.mark.parametrize("case", ["text", "one_image", "three_images", "multi_turn"])
def test_greedy_outputs_identical_with_caches_on_and_off(tiny_model_dir, pictures, case):
    on, off = Harness(tiny_model_dir), Harness(tiny_model_dir, prefix_cache=False, encoder_cache=False)
    conversations = {
        "text": [[user("Tell me a story about a robot.")]] * 2,
        "one_image": [[user("What is it?", pictures[0])], [system("Be brief."), user("What is it?", pictures[0])]],
        "three_images": [[user("Which differ?", *pictures)]] * 2,
    }
    if case == "multi_turn":
        first = [user("Look.", pictures[1])]
        _, text, _ = on.run(first)
        turns = [first, first + [{"role": "assistant", "content": text}, user("More detail?")]]
    else:
        turns = conversations[case]
    for messages in turns:
        assert on.run(messages)[0] == off.run(messages)[0]


def test_blocks_that_share_a_prefix_key_feed_the_model_the_same_inputs(tiny_model_dir, pictures, frames):
    """Over prompts that share much (the template head, pictures, the same frames at other fps, the same picture at
    another grid), every pair of blocks with one key holds the same token ids, vision rows and M-RoPE positions."""
    processor = make_processor(tiny_model_dir)
    config = load_model_config(tiny_model_dir)
    # the least a picture may cost: 4 tokens, or one tile where the family tiles
    least = config.image_processor.tokens_per_tile if config.image_processor.tiles else 4
    low = {"type": "image_url", "image_url": {"url": image_data_url(pictures[0]), "max_visual_tokens": least}}
    conversations = {
        "text": [user("Describe.")],
        "system+text": [system("Be brief."), user("Describe.")],
        "picture": [user("Describe.", pictures[0])],
        "picture at a smaller grid": [{"role": "user", "content": [low, {"type": "text", "text": "Describe."}]}],
        "other picture": [user("Describe.", pictures[2])],
        "two pictures": [user("Describe.", pictures[0], pictures[1])],
        "frames at 2 fps": [video("Describe.", frames, 2.0)],
        "frames at 0.5 fps": [video("Describe.", frames, 0.5)],
        "frames at 1 fps": [video("Describe.", frames, 1.0)],
        "frames at 2 fps, picture": [video("Describe.", frames, 2.0, pictures[0])],
        "frames at 0.5 fps, picture": [video("Describe.", frames, 0.5, pictures[0])],
        "picture, then frames at 0.5 fps": [user("Look.", pictures[0]), video("Describe.", frames, 0.5)],
        "picture, then frames at 2 fps": [user("Look.", pictures[0]), video("Describe.", frames, 2.0)],
    }
    if not family_named(config.family).video:
        conversations = {name: messages for name, messages in conversations.items() if "frames" not in name}
    requests = []
    for name, messages in conversations.items():
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "max_tokens": 1})
        requests.append(process(processor, body, name))
    block_size = CacheConfig().block_size
    num_shared = [assert_equal_keys_mean_equal_inputs(a, b, block_size)
                  for i, a in enumerate(requests) for b in requests[i + 1:]]
    assert sum(num_shared) > len(num_shared)  # the invariant was put to the test: many blocks shared a key


def test_a_repeated_image_is_not_decoded_again(tiny_model_dir, pictures):
    h = Harness(tiny_model_dir)
    messages = [user("What is shown?", pictures[2])]
    h.run(messages)
    h.run([system("Another user."), user("And here?", pictures[2])])
    cache = h.processor.image_cache
    assert (cache.num_misses, cache.num_hits) == (1, 1)  # the second request skipped decode, resize and patchify
