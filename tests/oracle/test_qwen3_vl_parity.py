"""Our Qwen3-VL (paged KV cache, SDPA backend, DeepStack, interleaved M-RoPE) against transformers'
Qwen3VLForConditionalGeneration on make_model's tiny checkpoint (see models/qwen3_vl_checkpoint.py: explicit
head_dim, 3 decoder layers of which 2 take DeepStack features, DeepStack after vision blocks 1 and 2 of 4, an 8x8
learned position table).

Tolerance: max |logit difference| <= 1e-4 in fp32 at every position compared (logits reach |50|), exact greedy ids.
Two drivers: the test-only ``TinyRunner`` of test_qwen2_vl_parity (whole-tower encode, chunks at any boundary,
mixed batches), and the production ``LLMEngine`` (its scheduler splits each image's encode one vision block per
step and puts chunk boundaries inside images; its runner slices every DeepStack tensor per chunk).
Images are preprocessed by transformers' own Qwen2VLImageProcessorPil loaded from the checkpoint (16-px patches,
0.5 mean/std), with a 64x64-pixel floor instead of the releases' 256x256 so the prompts stay small.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from firsttoken.config import CacheConfig, EngineConfig, SchedulerConfig
from firsttoken.engine.engine import LLMEngine
from firsttoken.inputs.image import preprocess_image
from firsttoken.models.checkpoint import make_model, random_state_dict
from firsttoken.models.config import ModelConfig
from firsttoken.models.interfaces import ImageEmbeddings
from firsttoken.models.layers import mrope_cos_sin
from firsttoken.models.loader import load_model
from firsttoken.models.mrope import compute_mrope_positions
from firsttoken.models.qwen3_vl import Qwen3VLModel
from firsttoken.models.qwen3_vl_checkpoint import SIZES, build_hf_config
from firsttoken.models.registry import load_model_config
from tests.oracle.test_engine_oracle import Prompt as EnginePrompt
from tests.oracle.test_engine_oracle import engine_request, run
from tests.oracle.test_qwen2_vl_parity import (
    Prompt,
    TinyRunner,
    generate_ids,
    greedy_ids,
    make_images,
    max_diff,
    ref_logits,
)

TOL = 1e-4  # max |Δlogit|, fp32
VISION_TOL = 1e-5
MIN_PIXELS = 64 * 64  # 4 visual tokens: small test images are not scaled up to the releases' 256 x 256
NUM_NEW_ENGINE = 12
torch.set_num_threads(2)


# ---------------------------------------------------------------- fixtures: checkpoints, reference, ours


def reference_model(model_dir: Path):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("qwen3-vl-tiny"), size="tiny", seed=0, family="qwen3-vl", shards=2)


@pytest.fixture(scope="module")
def ref(model_dir: Path):
    return reference_model(model_dir)


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> Qwen3VLModel:
    return load_model(model_dir, torch.float32)


@pytest.fixture(scope="module")
def tied_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied checkpoint as the 2B/4B releases ship it, written by transformers' own save_pretrained (no
    lm_head tensor on disk), with make_model's weights (seed 1) so the logits are peaked."""
    from transformers import Qwen3VLForConditionalGeneration

    out = tmp_path_factory.mktemp("qwen3-vl-tied")
    config = build_hf_config(SIZES["tiny"])
    config.tie_word_embeddings = True
    model = Qwen3VLForConditionalGeneration(config)
    state = random_state_dict(config, 1, torch.float32, Qwen3VLForConditionalGeneration)
    model.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"}, strict=False)
    model.save_pretrained(out)
    shutil.copyfile(model_dir / "preprocessor_config.json", out / "preprocessor_config.json")
    return out


class Qwen3Runner(TinyRunner):
    def encode(self, prompt: Prompt) -> ImageEmbeddings:
        return self.model.visual(prompt.pixel_values, prompt.grid_thw)  # main + DeepStack tensors


def preprocess(model_dir: Path, images: list[Image.Image]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(
        model_dir, size={"shortest_edge": MIN_PIXELS, "longest_edge": 16384 * 32 * 32}
    )
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]


def make_prompt(model_dir: Path, config: ModelConfig, image_sizes: list[tuple[int, int]], seed: int = 0,
                text_after: list[int] | None = None) -> EnginePrompt:
    """text(9), then per image: vision_start, its pads, vision_end, text(5); then ``text_after`` or text(4)."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(0, 15000) for _ in range(n)]

    ids, pixel_values, grids = text(9), None, []
    if image_sizes:
        pixel_values, grids = preprocess(model_dir, make_images(image_sizes, seed))
        for t, h, w in grids:
            n = t * h * w // config.vision.spatial_merge_size**2
            ids += [config.vision_start_token_id] + [config.image_token_id] * n + [config.vision_end_token_id]
            ids += text(5)
    ids += text_after if text_after is not None else text(4)
    return EnginePrompt(tuple(ids), pixel_values, tuple(grids))


def as_runner_prompt(prompt: EnginePrompt) -> Prompt:
    return Prompt(list(prompt.ids), prompt.pixel_values, list(prompt.grids))


# (width, height): 32 px per visual token
PROMPTS = {
    "text": [],
    "one_image": [(192, 128)],  # 6 x 4 = 24 visual tokens
    "three_images": [(288, 128), (128, 224), (64, 64)],  # wide 36, tall 28, smallest 4
}


# ---------------------------------------------------------------- the vision tower alone


@pytest.mark.parametrize("sizes", [[(64, 64)], [(192, 128), (96, 224)], [(480, 320)]])
def test_vision_tower_and_every_deepstack_feature_match_reference(ref, ours, model_dir, sizes) -> None:
    pixel_values, grids = preprocess(model_dir, make_images(sizes))
    with torch.no_grad():
        expected = ref.model.get_image_features(pixel_values, torch.tensor(grids))
        got = ours.visual(pixel_values, grids)
    assert len(got.deepstack) == len(expected.deepstack_features) == 2
    pairs = [(got.main, torch.cat(expected.pooler_output))]
    pairs += [(g, torch.cat(e)) for g, e in zip(got.deepstack, expected.deepstack_features)]
    diffs = [max_diff(g, e) for g, e in pairs]
    print(f"vision {sizes}: max|Δ| main {diffs[0]:.2e}, deepstack {', '.join(f'{d:.2e}' for d in diffs[1:])}")
    assert all(g.shape == e.shape for g, e in pairs)
    assert max(diffs) <= VISION_TOL


@pytest.mark.parametrize("units_per_step", [1, 2, 3, 4])
def test_unit_by_unit_encode_equals_the_whole_tower(ours, model_dir, units_per_step) -> None:
    """Every split of the 4 blocks (1 per step splits right after each DeepStack block, 1 and 2) gives the same
    main and DeepStack tensors as one pass, image by image."""
    sizes = [(192, 128), (96, 224)]
    pixel_values, grids = preprocess(model_dir, make_images(sizes, seed=3))
    visual = ours.visual
    with torch.no_grad():
        whole = visual(pixel_values, grids)
        start, lo = 0, 0
        for grid in grids:
            num_patches = grid[0] * grid[1] * grid[2]
            state = visual.start_encode(pixel_values[start : start + num_patches], grid)
            steps = 0
            while not state.done:
                visual.run_units(state, units_per_step)
                steps += 1
            got = visual.finish_encode(state)
            assert steps == -(-visual.config.depth // units_per_step)
            expected = whole.rows(lo, lo + got.num_tokens)
            for g, e in zip((got.main, *got.deepstack), (expected.main, *expected.deepstack)):
                assert max_diff(g, e) <= 1e-6
            start, lo = start + num_patches, lo + got.num_tokens
    assert lo == whole.num_tokens


# ---------------------------------------------------------------- positions and rotary


@pytest.mark.parametrize("name", list(PROMPTS))
def test_mrope_positions_match_get_rope_index(ref, ours, model_dir, name) -> None:
    prompt = make_prompt(model_dir, ours.config, PROMPTS[name])
    got = compute_mrope_positions(prompt.ids, prompt.grids, ours.config)
    input_ids = torch.tensor([prompt.ids])
    if prompt.grids:
        expected, delta = ref.model.get_rope_index(
            input_ids, (input_ids == ours.config.image_token_id).long(), torch.tensor(prompt.grids)
        )
        assert torch.equal(got.positions, expected[:, 0])
        assert got.delta == int(delta)
    else:
        assert torch.equal(got.positions, torch.arange(len(prompt.ids)).expand(3, -1))
        assert got.delta == 0


def test_interleaved_mrope_tables_equal_the_reference_rotary(ref, ours, model_dir) -> None:
    prompt = make_prompt(model_dir, ours.config, PROMPTS["three_images"])
    positions = compute_mrope_positions(prompt.ids, prompt.grids, ours.config).positions
    c = ours.config
    cos, sin = mrope_cos_sin(positions, c.head_dim, c.rope_theta, c.mrope_section, torch.float32, interleaved=True)
    rotary = ref.model.language_model.rotary_emb
    ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


# ---------------------------------------------------------------- logits, chunks, batches, greedy


@pytest.mark.parametrize("name", list(PROMPTS))
def test_full_prompt_logits_match(ref, ours, model_dir, name) -> None:
    prompt = as_runner_prompt(make_prompt(model_dir, ours.config, PROMPTS[name]))
    runner = Qwen3Runner(ours)
    got = runner.prefill(runner.add(prompt), chunk=len(prompt.ids))
    d = max_diff(got, ref_logits(ref, ours.config, prompt))
    print(f"full prompt {name} ({len(prompt.ids)} tokens): max|Δlogit| = {d:.2e}")
    assert d <= TOL


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_reference_at_every_position(ref, ours, model_dir, chunk) -> None:
    prompt = as_runner_prompt(make_prompt(model_dir, ours.config, PROMPTS["three_images"]))
    is_image = [t == ours.config.image_token_id for t in prompt.ids]
    assert any(is_image[b - 1] and is_image[b] for b in range(chunk, len(prompt.ids), chunk))
    runner = Qwen3Runner(ours, seed=chunk)
    got = runner.prefill(runner.add(prompt), chunk=chunk)
    d = max_diff(got, ref_logits(ref, ours.config, prompt))
    print(f"chunked prefill chunk={chunk} ({len(prompt.ids)} tokens): max|Δlogit| = {d:.2e}")
    assert d <= TOL


def test_mixed_batch_matches_each_sequence_alone_and_the_reference(ref, ours, model_dir) -> None:
    """One forward carrying a first prefill chunk, a later chunk that starts inside an image (so each DeepStack
    tensor is sliced from its middle), and two decodes."""
    config = ours.config
    prompts = [as_runner_prompt(make_prompt(model_dir, config, sizes, seed=10 + i))
               for i, sizes in enumerate([PROMPTS["one_image"], PROMPTS["three_images"], [], [(128, 128)]])]
    first_chunk = 20  # sequence 1 resumes at token 20, inside its first image (pads 10..45)
    assert prompts[1].ids[first_chunk] == config.image_token_id

    def setup(runner: TinyRunner) -> list:
        seqs = [runner.add(p) for p in prompts]
        runner.step([(seqs[1], first_chunk)])
        for s in seqs[2:]:
            runner.prefill(s, chunk=len(s.ids))
            s.ids.append(7)
        return seqs

    def work(seqs: list) -> list:
        return [(seqs[0], len(prompts[0].ids)), (seqs[1], len(prompts[1].ids) - first_chunk), (seqs[2], 1),
                (seqs[3], 1)]

    batched_runner = Qwen3Runner(ours, seed=21)
    batched = batched_runner.step(work(setup(batched_runner)))
    alone_runner = Qwen3Runner(ours, seed=22)
    alone = [alone_runner.step([w])[0] for w in work(setup(alone_runner))]
    d_alone = max(max_diff(b, a) for b, a in zip(batched, alone))
    d_ref = 0.0
    for i, (p, got) in enumerate(zip(prompts, batched)):
        full = Prompt(p.ids + ([7] if i >= 2 else []), p.pixel_values, p.grid_thw)
        d_ref = max(d_ref, max_diff(got, ref_logits(ref, config, full)[-got.shape[0] :]))
    print(f"mixed batch: max|Δlogit| batched vs alone = {d_alone:.2e}, vs reference = {d_ref:.2e}")
    assert d_alone <= TOL and d_ref <= TOL


@pytest.mark.parametrize("name", ["text", "one_image"])
def test_32_greedy_tokens_match_generate(ref, ours, model_dir, name) -> None:
    prompt = as_runner_prompt(make_prompt(model_dir, ours.config, PROMPTS[name], seed=3))
    assert greedy_ids(ours, prompt, 32, Qwen3Runner) == generate_ids(ref, ours.config, prompt, 32)


# ---------------------------------------------------------------- layouts, tying, bf16, preprocessing


def test_release_config_layout_loads_the_same_model(ours, tmp_path: Path) -> None:
    """The releases' config.json (rope_scaling + rope_theta, vision model_type "qwen3_vl") parses to the same
    architecture as transformers 5's, and both sides load it (transformers included) to the same logits."""
    original = make_model(tmp_path, size="tiny", seed=0, family="qwen3-vl", layout="original")
    config = load_model_config(original)
    assert config.layout == "original" and ours.config.layout == "transformers"
    assert config == dataclasses.replace(ours.config, layout="original")
    model = load_model(original, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ours.state_dict().values()))
    prompt = as_runner_prompt(make_prompt(original, config, PROMPTS["one_image"], seed=7))
    runner = Qwen3Runner(model, seed=7)
    d = max_diff(runner.prefill(runner.add(prompt), chunk=7), ref_logits(reference_model(original), config, prompt))
    print(f"release layout: max|Δlogit| = {d:.2e}")
    assert d <= TOL


def test_tied_embeddings_match_reference(tied_dir: Path) -> None:
    tied = load_model(tied_dir, torch.float32)
    assert tied.config.tie_word_embeddings
    assert tied.lm_head is None or tied.lm_head.weight is tied.embed_tokens.weight  # logits from the embeddings
    prompt = as_runner_prompt(make_prompt(tied_dir, tied.config, PROMPTS["one_image"], seed=4))
    runner = Qwen3Runner(tied)
    d = max_diff(runner.prefill(runner.add(prompt), chunk=13), ref_logits(reference_model(tied_dir), tied.config, prompt))
    print(f"tied embeddings: max|Δlogit| = {d:.2e}")
    assert d <= TOL


def test_bf16_load_tracks_fp32_reference(ref, model_dir: Path) -> None:
    model = load_model(model_dir, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    prompt = as_runner_prompt(make_prompt(model_dir, model.config, PROMPTS["three_images"], seed=6))
    runner = Qwen3Runner(model)
    got = runner.prefill(runner.add(prompt), chunk=32)
    expected = ref_logits(ref, model.config, prompt)
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(f"bf16: top-1 agreement {agree:.3f}, max|Δlogit| {max_diff(got, expected):.3f}")
    assert agree >= 0.9


@pytest.mark.parametrize("width, height, min_pixels", [(1024, 1024, 65536), (2048, 1536, 65536), (64, 64, 65536),
                                                       (333, 777, 4096), (1000, 30, 4096), (50, 50, 4096)])
def test_preprocessing_at_patch_16_is_bit_identical_to_transformers(model_dir, width, height, min_pixels) -> None:
    """Our preprocess_image with the checkpoint's ImageProcessorConfig (16 px, 0.5 mean/std) against transformers'
    processor loaded from the same preprocessor_config.json: same grid, bit-identical pixels. 1024 x 1024 is
    1024 visual tokens at 32 px per token (Qwen2-VL's 28 px would give 1369)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = load_model_config(model_dir)
    max_pixels = config.image_processor.max_pixels
    image = Image.fromarray(np.random.default_rng(width + height).integers(0, 256, (height, width, 3), dtype=np.uint8))
    reference = Qwen2VLImageProcessorPil.from_pretrained(
        model_dir, size={"shortest_edge": min_pixels, "longest_edge": max_pixels})(images=[image])
    got = preprocess_image(image, config.image_processor, min_pixels, max_pixels)
    expected = np.asarray(reference["pixel_values"])
    assert list(got.grid_thw) == np.asarray(reference["image_grid_thw"])[0].tolist()
    assert np.array_equal(got.pixel_values.numpy(), expected)
    if (width, height) == (1024, 1024):
        assert got.num_tokens == 1024
    if (width, height) == (2048, 1536):
        assert got.num_tokens == 3072


# ---------------------------------------------------------------- the production engine


_GREEDY: dict[tuple, list[int]] = {}  # (prompt ids, grids) -> the reference's greedy tokens, shared by the tests


def greedy_by_forward(ref, prompt: EnginePrompt, num_new: int = NUM_NEW_ENGINE) -> list[int]:
    """The model's definition: greedy by repeated full forwards, no KV cache (see test_engine_oracle's note on
    generate with several images)."""
    key = (prompt.ids, prompt.grids, num_new)
    if key not in _GREEDY:
        _GREEDY[key] = _greedy_by_forward(ref, prompt, num_new)
    return _GREEDY[key]


def _greedy_by_forward(ref, prompt: EnginePrompt, num_new: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(num_new):
            input_ids = torch.tensor([list(prompt.ids) + out])
            kwargs = dict(mm_token_type_ids=(input_ids == ref.config.image_token_id).long())
            if prompt.pixel_values is not None:
                kwargs.update(pixel_values=prompt.pixel_values, image_grid_thw=torch.tensor(prompt.grids))
            out.append(int(ref(input_ids=input_ids, logits_to_keep=1, **kwargs).logits[0, -1].argmax()))
    return out


class EncodeSteps:
    """A fault hook that only counts: (request id) -> steps in which that request's images ran encoder units."""

    def __init__(self) -> None:
        self.by_request: Counter[str] = Counter()

    def __call__(self, stage: str, request_id: str) -> None:
        if stage == "encode":
            self.by_request[request_id] += 1


def make_engine(model_dir: Path, step_tokens: int, hook: EncodeSteps | None = None,
                enable_encoder_cache: bool = True) -> LLMEngine:
    """Every prompt in the long lane, at most ``step_tokens`` of work per step, 16-token KV blocks."""
    from transformers import AutoTokenizer

    config = load_model_config(model_dir)
    cache = CacheConfig(kv_cache_memory_bytes=256 * 16 * config.kv_bytes_per_token(4),
                        enable_encoder_cache=enable_encoder_cache)
    scheduler = SchedulerConfig(max_batched_tokens=step_tokens, long_prompt_threshold=1, long_step_tokens=step_tokens,
                                decode_reserve_tokens=4, step_time_target="off")  # token budgets: same on any machine
    return LLMEngine(model_dir, EngineConfig(dtype="float32", cache=cache, scheduler=scheduler),
                     AutoTokenizer.from_pretrained(model_dir).backend_tokenizer, fault_hook=hook)


@pytest.mark.parametrize("step_tokens", [7, 13])
def test_engine_matches_reference_with_chunks_inside_images_and_encodes_split_after_deepstack_blocks(
    ref, ours, model_dir, step_tokens
) -> None:
    config = ours.config
    prompts = {
        "text": make_prompt(model_dir, config, [], seed=1),
        "two_images": make_prompt(model_dir, config, [(192, 128), (96, 160)], seed=2),  # 24 and 15 tokens
        "three_images": make_prompt(model_dir, config, [(288, 128), (128, 224), (160, 96)], seed=3),  # 36, 28, 15
    }
    hook = EncodeSteps()
    engine = make_engine(model_dir, step_tokens, hook)
    got = run(engine, [engine_request(config, p, name) for name, p in prompts.items()])  # one mixed batch
    for name, prompt in prompts.items():
        assert got[name] == greedy_by_forward(ref, prompt), name
    assert engine.stats().num_images_encoded == 5
    # one vision block per step: every image's encode was split after each block, DeepStack blocks 1 and 2 included
    depth = config.vision.depth
    assert hook.by_request == {"two_images": 2 * depth, "three_images": 3 * depth}


def test_engine_generate_agrees_with_the_reference_forward_on_one_image(ref, ours, model_dir) -> None:
    prompt = make_prompt(model_dir, ours.config, PROMPTS["one_image"], seed=8)
    input_ids = torch.tensor([prompt.ids])
    with torch.no_grad():
        generated = ref.generate(input_ids, pixel_values=prompt.pixel_values, image_grid_thw=torch.tensor(prompt.grids),
                                 mm_token_type_ids=(input_ids == ours.config.image_token_id).long(),
                                 max_new_tokens=NUM_NEW_ENGINE, min_new_tokens=NUM_NEW_ENGINE, do_sample=False)
    expected = generated[0, len(prompt.ids) :].tolist()
    assert greedy_by_forward(ref, prompt) == expected
    engine = make_engine(model_dir, 13)
    assert run(engine, [engine_request(ours.config, prompt, "one")])["one"] == expected


def test_follow_up_reuses_cached_blocks_ending_inside_an_image_and_its_deepstack_features(ref, ours, model_dir):
    # first: 9 + 1 + 24 pads + 1 + 5 + 4 = 44 tokens -> blocks 0..31 cached, ending inside the image (pads 10..33).
    # The follow-up shares everything up to its last text: its prefill starts at token 32, inside the image, so
    # rows 22..23 of the main tensor and of each DeepStack tensor come from the encoder cache (or a re-encode).
    config = ours.config
    first = make_prompt(model_dir, config, PROMPTS["one_image"], seed=4, text_after=[11, 12, 13, 14])
    follow = make_prompt(model_dir, config, PROMPTS["one_image"], seed=4, text_after=[21, 22, 23, 24, 25, 26, 27])
    expected = greedy_by_forward(ref, follow)
    for encoder_cache in (True, False):
        hook = EncodeSteps()
        engine = make_engine(model_dir, 13, hook, enable_encoder_cache=encoder_cache)
        run(engine, [engine_request(config, first, "first")])
        stats: dict = {}
        got = run(engine, [engine_request(config, follow, "follow")], stats)
        assert stats["follow"].num_cached_prompt_tokens == 32
        assert got["follow"] == expected
        assert engine.stats().num_images_encoded == (1 if encoder_cache else 2)
        assert hook.by_request["follow"] == (0 if encoder_cache else config.vision.depth)


# ---------------------------------------------------------------- make-model's checkpoints in transformers' classes


@pytest.mark.parametrize("layout", ["transformers", "original"])
def test_make_model_checkpoint_loads_unchanged_in_transformers_classes(model_dir, tmp_path, layout) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

    from firsttoken.models.recipe import TOKEN_IDS, VOCAB_SIZE

    out = model_dir if layout == "transformers" else make_model(tmp_path, family="qwen3-vl", layout="original")
    model, info = Qwen3VLForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.head_dim, text.hidden_size, text.num_attention_heads, text.vocab_size) == (32, 64, 4, VOCAB_SIZE)
    assert text.rope_parameters["rope_theta"] == 5_000_000
    assert text.rope_parameters["mrope_section"] == [6, 5, 5] and text.rope_parameters["mrope_interleaved"]
    assert list(vision.deepstack_visual_indexes) == [1, 2] and vision.depth == 4
    assert (vision.num_position_embeddings, vision.patch_size, vision.out_hidden_size) == (64, 16, 64)
    assert model.config.image_token_id == TOKEN_IDS["<|image_pad|>"] and not model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == TOKEN_IDS["<|image_pad|>"]
    processor = AutoImageProcessor.from_pretrained(out)
    assert (processor.patch_size, processor.merge_size, tuple(processor.image_mean), tuple(processor.image_std)) == (
        16, 2, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (256 * 256, 4096 * 4096)
    config = load_model_config(out)
    assert config.vision.deepstack_visual_indexes == (1, 2) and config.mrope_interleaved and config.qk_norm
    assert (config.head_dim, config.rope_theta, config.image_processor.pixels_per_token) == (32, 5_000_000.0, 32)


def test_small_is_the_size_of_qwen2_vl_small() -> None:
    """Same language model as Qwen2-VL small (39M); the tower's three DeepStack mergers add ~5M."""
    from transformers import Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    from firsttoken.models import checkpoint, qwen2_vl_checkpoint

    def count(model_class, config) -> tuple[int, int]:
        with torch.device("meta"):
            state = model_class(config).state_dict()
        counts = checkpoint.count_params(state)
        return counts.total, counts.language_model

    qwen3 = count(Qwen3VLForConditionalGeneration, build_hf_config(SIZES["small"]))
    qwen2_small = qwen2_vl_checkpoint.build_hf_config(qwen2_vl_checkpoint.SIZES["small"])
    qwen2 = count(Qwen2VLForConditionalGeneration, qwen2_small)
    print(f"small: qwen3-vl {qwen3[0]:,} parameters, qwen2-vl {qwen2[0]:,}")
    assert abs(qwen3[1] - qwen2[1]) / qwen2[1] < 0.01
    assert 1.0 < qwen3[0] / qwen2[0] < 1.15


def test_cli_make_model_family_qwen3_vl(tmp_path: Path, capsys) -> None:
    from firsttoken.cli.main import main as cli_main

    assert cli_main(["make-model", str(tmp_path / "m"), "--family", "qwen3-vl", "--layout", "original"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-vl tiny" in out and "original layout" in out
    assert load_model_config(tmp_path / "m").family == "qwen3-vl"


def test_moe_variant_and_unsupported_fields_are_refused_by_name(model_dir: Path) -> None:
    """Qwen3-VL-30B-A3B (MoE) is not served; a field this code would silently get wrong is a ConfigError."""
    import json

    from firsttoken.models.config import ConfigError
    from firsttoken.models.registry import model_config_from_dict

    config = json.loads((model_dir / "config.json").read_text())
    moe = {**config, "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe"}
    with pytest.raises(ConfigError, match="Qwen3VLMoeForConditionalGeneration"):
        model_config_from_dict(moe)
    biased = {**config, "text_config": {**config["text_config"], "attention_bias": True}}
    with pytest.raises(ConfigError, match="attention_bias"):
        model_config_from_dict(biased)
    flat = {k: v for k, v in config.items() if k != "text_config"}
    with pytest.raises(ConfigError, match="text_config"):
        model_config_from_dict(flat)


QWEN3_VL_8B_CONFIG = {  # Qwen/Qwen3-VL-8B-Instruct's config.json as published (transformers 4.57 layout)
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_vl",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}


def test_published_qwen3_vl_8b_config_builds_the_reference_shapes() -> None:
    """The release's config.json parses to its architecture, and our module built from it (on the meta device)
    has every parameter transformers' has: the same count per tower."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from firsttoken.attention.registry import get_backend
    from firsttoken.models.registry import family_of_config, model_config_from_dict

    config = model_config_from_dict(QWEN3_VL_8B_CONFIG)
    assert (config.layout, config.head_dim, config.num_key_value_heads, config.rope_theta) == (
        "original", 128, 8, 5_000_000.0)
    assert config.mrope_section == (24, 20, 20) and config.mrope_interleaved and config.qk_norm
    assert config.vision.deepstack_visual_indexes == (8, 16, 24) and config.vision.num_position_embeddings == 2304
    assert config.kv_bytes_per_token(2) == 2 * 36 * 8 * 128 * 2
    assert config.image_processor.pixels_per_token == 32  # no preprocessor_config.json: the family's defaults
    with torch.device("meta"):
        ours = family_of_config(QWEN3_VL_8B_CONFIG).build(config, get_backend("sdpa"))
        reference = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**QWEN3_VL_8B_CONFIG))

    def count(model: torch.nn.Module, vision: bool) -> int:
        return sum(p.numel() for n, p in model.named_parameters() if ("visual." in n) == vision)

    assert count(ours, vision=True) == count(reference, vision=True)
    assert count(ours, vision=False) == count(reference, vision=False)
