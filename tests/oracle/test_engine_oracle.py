"""The production engine (real Scheduler + ModelRunner: their own position and image-row slicing, encoder work split
across steps, prefix cache, preemption) against transformers on the same weights, for every family the registry
serves (conftest.py's ``family`` and its ``model_dir``, as test_family_parity.py's): fp32, 12 greedy tokens, exact
ids (``generate`` where it agrees with transformers' own forward; see ``reference``).

The parity tests in test_family_parity.py drive a test-only runner; these go through ``LLMEngine.step`` as the
server does, with step budgets of 7 and 13 tokens so chunk boundaries fall inside images and the vision tower runs
a unit at a time across steps (every prompt is routed to the long lane). Prompts are built from token ids and
transformers' own image processor output (as the checkpoint configures it), so both sides see identical inputs.
Image sizes are in visual tokens, so every family's prompts have the same lengths.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from firsttoken.config import CacheConfig, EngineConfig, SchedulerConfig
from firsttoken.engine.engine import LLMEngine
from firsttoken.models.family import ModelFamily
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.registry import family_named, load_model_config
from firsttoken.types import EngineRequest, FinishReason, ImageItem, SamplingParams
from tests.helpers import RecordingExecutor
from tests.oracle.parity import image_kwargs, image_pixel_rows, preprocess

NUM_NEW = 12
torch.set_num_threads(2)


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    pixel_values: torch.Tensor | None  # [num_patches, C*T*P*P], images back to back
    grids: tuple[tuple[int, int, int], ...]


@pytest.fixture(scope="module")
def config(model_dir: Path) -> ModelConfig:
    return load_model_config(model_dir)


@pytest.fixture(scope="module")
def reference(family: ModelFamily, model_dir: Path, config: ModelConfig):
    model_class = family.checkpoint.hf_model_class()
    model = model_class.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return greedy_oracle(model.eval(), config)


def greedy_oracle(model, config: ModelConfig) -> Callable[[Prompt], list[int]]:
    """Greedy tokens by transformers' ``model``: ``generate`` for prompts with at most one image, else greedy by
    repeated full forwards without a KV cache (the model's definition). transformers 5.24's ``generate`` (with or
    without its cache) departs from its own forward on prompts with two images after a few tokens (two images,
    seed 2: at the 4th token), so it cannot be the oracle there; where it is, the oracle checks both agree."""
    cache: dict[Prompt, list[int]] = {}

    def inputs(ids: list[int], prompt: Prompt) -> dict:
        input_ids = torch.tensor([ids])
        return dict(input_ids=input_ids, **image_kwargs(config, input_ids, prompt.pixel_values, list(prompt.grids)))

    def greedy(prompt: Prompt) -> list[int]:
        if prompt not in cache:
            out: list[int] = []
            with torch.no_grad():
                for _ in range(NUM_NEW):
                    out.append(int(model(**inputs(list(prompt.ids) + out, prompt)).logits[0, -1].argmax()))
                if len(prompt.grids) <= 1:
                    kw = inputs(list(prompt.ids), prompt)
                    generated = model.generate(kw.pop("input_ids"), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                                               do_sample=False, repetition_penalty=1.0, **kw)
                    assert generated[0, len(prompt.ids):].tolist() == out
            cache[prompt] = out
        return cache[prompt]

    return greedy


def make_prompt(config: ModelConfig, processor, image_tokens: list[tuple[int, int]], seed: int,
                text_after: list[int] | None = None, lead: int = 9) -> Prompt:
    """text(``lead``), then per image: vision_start, its pads, vision_end, text(5); then ``text_after`` or text(4).
    ``image_tokens``: each image's (width, height) in visual tokens, drawn at the family's pixels per token and
    preprocessed by transformers' ``processor``."""
    rng = random.Random(seed)
    side_px = config.image_processor.pixels_per_token

    def text(n: int) -> list[int]:
        return [rng.randrange(0, 15000) for _ in range(n)]

    ids = text(lead)
    pixel_values, grids = None, []
    if image_tokens:
        np_rng = np.random.default_rng(seed)
        images = [Image.fromarray(np_rng.integers(0, 256, (h * side_px, w * side_px, 3), dtype=np.uint8))
                  for w, h in image_tokens]
        pixel_values, grids = preprocess(images, processor, config)
        for t, h, w in grids:
            n = t * h * w // config.vision.spatial_merge_size**2
            ids += [config.vision_start_token_id] + [config.image_token_id] * n + [config.vision_end_token_id]
            ids += text(5)
    ids += text_after if text_after is not None else text(4)
    return Prompt(tuple(ids), pixel_values, tuple(grids))


def engine_request(config: ModelConfig, prompt: Prompt, rid: str) -> EngineRequest:
    images, offsets = [], [i for i, t in enumerate(prompt.ids)
                           if t == config.image_token_id and (i == 0 or prompt.ids[i - 1] != config.image_token_id)]
    start = 0
    for (t, h, w), offset in zip(prompt.grids, offsets):
        rows = image_pixel_rows(config, (t, h, w))
        pixels = prompt.pixel_values[start : start + rows]
        start += rows
        digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
        units = family_named(config.family).encoder_units(config.vision, (t, h, w))
        images.append(ImageItem(digest, offset, t * h * w // config.vision.spatial_merge_size**2, (t, h, w), units,
                                pixels))
    mrope = family_named(config.family).positions(prompt.ids, prompt.grids, config)
    return EngineRequest(rid, prompt.ids, tuple(images), mrope.positions, mrope.delta,
                         SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True), 0.0, 0.0)


def make_engine(model_dir: Path, step_tokens: int, num_blocks: int = 256, **scheduler) -> LLMEngine:
    """``num_blocks`` 16-token KV blocks, at most ``step_tokens`` of work per step, every prompt in the long lane."""
    from transformers import AutoTokenizer

    # step_time_target off: steps budgeted in tokens, so which work shares a step is the same on every machine
    options = dict(max_batched_tokens=step_tokens, long_prompt_threshold=1, long_step_tokens=step_tokens,
                   decode_reserve_tokens=4, step_time_target="off")
    options.update(scheduler)
    enable_encoder_cache = options.pop("enable_encoder_cache", True)
    cache = CacheConfig(kv_cache_memory_bytes=num_blocks * 16 * load_model_config(model_dir).kv_bytes_per_token(4),
                        enable_encoder_cache=enable_encoder_cache)
    cfg = EngineConfig(dtype="float32", cache=cache, scheduler=SchedulerConfig(**options))
    return LLMEngine(model_dir, cfg, AutoTokenizer.from_pretrained(model_dir).backend_tokenizer)


def run(engine: LLMEngine, requests: list[EngineRequest], stats: dict | None = None) -> dict[str, list[int]]:
    """Greedy tokens per request; ``stats`` (when given) receives each request's final RequestStats."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason in (None, FinishReason.LENGTH), out.error
            tokens[out.request_id] += out.new_token_ids
            if stats is not None:
                stats[out.request_id] = out.stats
        engine.scheduler.check_invariants()
    assert engine.stats().kv_blocks_used == 0
    return tokens


TWO_IMAGES = [(6, 4), (3, 5)]  # (width, height) in visual tokens: 24 and 15, different aspect ratios
ONE_IMAGE = [(6, 4)]


@pytest.mark.parametrize("step_tokens", [7, 13])
def test_engine_matches_generate_with_chunks_inside_images_and_encodes_split_across_steps(
    model_dir, config, processor, reference, step_tokens
):
    prompts = {"text": make_prompt(config, processor, [], seed=1),
               "two_images": make_prompt(config, processor, TWO_IMAGES, seed=2)}
    engine = make_engine(model_dir, step_tokens)
    requests = [engine_request(config, p, name) for name, p in prompts.items()]
    recorder = RecordingExecutor(engine.executor)
    engine.executor = recorder
    got = run(engine, requests)  # one mixed batch
    for name, prompt in prompts.items():
        assert got[name] == reference(prompt), name
    assert engine.stats().num_images_encoded == 2
    assert engine.scheduler.num_steps > 20  # really chunked: ~90 prompt tokens at most 13 per step
    for image in requests[1].images:  # every unit ran once; a unit over the step's budget ran in a step of its own
        steps = [w.num_units for b in recorder.batches for w in b.encoder_work if w.content_hash == image.content_hash]
        assert sum(steps) == len(image.encoder_units)
        if min(u.cost_tokens for u in image.encoder_units) > step_tokens:
            assert steps == [1] * len(image.encoder_units)


def test_engine_matches_generate_when_the_prefix_cache_hit_ends_inside_an_image(model_dir, config, processor,
                                                                                 reference):
    # the first prompt's whole 16-token blocks are cached and the last of them ends inside its image (Qwen: 9 + 1 +
    # 24 pads + 1 + 5 + 4 = 44 tokens -> blocks 0..31, pads 10..33; a tiling family leads with more text). The
    # follow-up shares everything up to its last text and reuses those blocks; the image rows past them (and
    # DeepStack features' rows) come from the encoder cache or a re-encode.
    lead, cached = _lead_ending_inside_the_image(config, processor)
    first = make_prompt(config, processor, ONE_IMAGE, seed=4, text_after=[11, 12, 13, 14], lead=lead)
    follow = make_prompt(config, processor, ONE_IMAGE, seed=4, text_after=[21, 22, 23, 24, 25, 26, 27], lead=lead)
    for encoder_cache in (True, False):
        engine = make_engine(model_dir, 13, enable_encoder_cache=encoder_cache)
        run(engine, [engine_request(config, first, "first")])
        stats: dict = {}
        got = run(engine, [engine_request(config, follow, "follow")], stats)
        assert stats["follow"].num_cached_prompt_tokens == cached
        assert got["follow"] == reference(follow)
        assert engine.stats().num_images_encoded == (1 if encoder_cache else 2)


def _lead_ending_inside_the_image(config: ModelConfig, processor) -> tuple[int, int]:
    """(leading text tokens, tokens in whole 16-token blocks) for which ONE_IMAGE's prompt's last whole block ends
    inside its image."""
    for lead in range(9, 9 + 16):
        ids = make_prompt(config, processor, ONE_IMAGE, seed=4, text_after=[11, 12, 13, 14], lead=lead).ids
        pads = [i for i, t in enumerate(ids) if t == config.image_token_id]
        cached = len(ids) // 16 * 16
        if pads[0] < cached <= pads[-1]:
            return lead, cached
    raise AssertionError("no lead puts a block boundary inside the image")


def test_engine_matches_generate_after_preemption_by_recompute(model_dir, config, processor, reference):
    # Three prompts of 16k + 12 tokens (Qwen: 44) that grow by 12 into one more block each, in a pool of two
    # prompts' blocks (Qwen: 6 blocks): optimistic admission runs two side by side and preempts by recompute when
    # decodes outgrow the pool. Recomputed requests must give the same tokens.
    prompts = {f"r{i}": _prompt_ending_at_12_mod_16(config, processor, 10 + i) for i in range(3)}
    length = len(prompts["r0"].ids)
    # a prompt prefills in about four steps, so two decode side by side before the first finishes (Qwen: 13)
    engine = make_engine(model_dir, max(13, -(-length // 4)), num_blocks=2 * -(-length // 16),
                         kv_admission="optimistic", long_prompt_threshold=10_000)
    got = run(engine, [engine_request(config, p, name) for name, p in prompts.items()])
    assert engine.scheduler.num_preemptions > 0
    print(f"preemptions by reason: {engine.scheduler.preemptions_by_reason}")
    for name, prompt in prompts.items():
        assert got[name] == reference(prompt), name


def _prompt_ending_at_12_mod_16(config: ModelConfig, processor, seed: int) -> Prompt:
    """ONE_IMAGE's prompt with the trailing text that makes it 12 tokens past a block boundary (Qwen: text(4))."""
    for n in (4, *range(1, 17)):
        prompt = make_prompt(config, processor, ONE_IMAGE, seed=seed, text_after=list(range(40, 40 + n)))
        if len(prompt.ids) % 16 == 12:
            return prompt if n != 4 else make_prompt(config, processor, ONE_IMAGE, seed=seed)
    raise AssertionError("no trailing text makes the prompt 12 past a block boundary")


@pytest.fixture(scope="module")
def hf_model(family: ModelFamily, model_dir: Path):
    model_class = family.checkpoint.hf_model_class()
    return model_class.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("step_tokens", [7, 64])
def test_prompt_logprobs_match_transformers_across_chunks_and_a_cached_prefix(
    model_dir, config, processor, hf_model, step_tokens
):
    # what lm-eval's loglikelihood tasks read (echo + logprobs): each prompt token's logprob given the tokens before
    # it, scored chunk by chunk (chunks of 7 end inside the image), and again for the same prompt once its KV is
    # in the prefix cache (a scored prompt is computed whole); max_tokens 1, as lm-eval asks
    prompt = make_prompt(config, processor, ONE_IMAGE, seed=5)
    engine = make_engine(model_dir, step_tokens)
    scored: dict[str, tuple] = {}
    for rid in ("first", "again"):
        request = engine_request(config, prompt, rid)
        engine.add_request(replace(request, sampling=replace(request.sampling, max_tokens=1, prompt_logprobs=2)))
        while engine.has_unfinished():
            for out in engine.step():
                if out.prompt_logprobs:
                    scored[rid] = out.prompt_logprobs
    input_ids = torch.tensor([prompt.ids])
    with torch.no_grad():
        logits = hf_model(input_ids=input_ids,
                          **image_kwargs(config, input_ids, prompt.pixel_values, list(prompt.grids))).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for rid, got in scored.items():
        assert [lp.token_id for lp in got] == list(prompt.ids[1:]), rid
        want = expected[torch.arange(len(prompt.ids) - 1), torch.tensor(prompt.ids[1:])]
        assert torch.allclose(torch.tensor([lp.logprob for lp in got]), want, atol=1e-4), rid
        best = expected[: len(prompt.ids) - 1].topk(2, dim=-1)
        assert [[t for t, _ in lp.top] for lp in got] == best.indices.tolist(), rid
    assert set(scored) == {"first", "again"}
