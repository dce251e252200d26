"""Every family the registry serves against its transformers class (``ModelFamily.checkpoint.hf_model_class``) on
make_model's tiny checkpoint of that family: the vision tower (whole, unit by unit as the engine runs it, every
DeepStack feature), M-RoPE positions, full-prompt and chunked-prefill logits, mixed batches, greedy decoding, bf16,
every checkpoint layout the recipe writes, tied embeddings and the image processor. test_engine_oracle.py runs the
production engine over the same families.

The suite is parametrized by conftest.py's ``family`` fixture: the families served at collection, each with
make_model's tiny checkpoint (``model_dir``). A test module that registers a family of its own (models/registry.py
``register``) imports these tests and overrides ``family``, and the family gets every test
(test_registered_family.py).

Tolerance: max |Δlogit| <= 1e-4 in fp32 (logits reach |50|), exact greedy ids. Logits are compared with the
reference run in float64 (``ref64``): transformers' own fp32 run is ~9e-5 from its fp64 run on Qwen2.5-VL's image
prompts and ours 2e-5 to 5e-5, so against transformers' fp32 the two roundings add up to ~1.1e-4 (the printed
figures give both). Greedy ids, the vision tower and positions are compared with transformers in fp32. Images are
sized in visual tokens and preprocessed by transformers' processor as the checkpoint configures it (its floor
lowered to 2 x 2 tokens); the three-image prompt has grids whose 4 x 4-token windows (Qwen2.5-VL) divide evenly,
grids with a short last window row and column, and an image smaller than one window.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from firsttoken.loading.loader import load_model
from firsttoken.models.checkpoint import make_model
from firsttoken.models.family import ModelFamily
from firsttoken.models.internvl_vision import tiles_to_patch_rows
from firsttoken.models.registry import family_named, load_model_config
from tests.oracle.parity import (
    TOL,
    TinyRunner,
    check_bf16_tracks_fp32,
    check_mrope_positions,
    checkpoint_processor,
    generate_ids,
    greedy_ids,
    image_pixel_rows,
    in_pixels,
    make_images,
    make_prompt,
    max_diff,
    mixed_batch,
    preprocess,
    ref_logits,
    reference_image_features,
    tiled,
    tower_outputs,
)

VISION_TOL = 1e-5  # max |Δ| of the tower's outputs, fp32
PROMPTS = {  # (width, height) in visual tokens
    "text": [],
    "one_image": [(6, 4)],
    "three_images": [(12, 8), (5, 9), (2, 2)],  # windows divide evenly; short last row and column; < 1 window
}


# ---------------------------------------------------------------- fixtures (family, model_dir, processor: conftest.py)


def load_reference(family: ModelFamily, model_dir: Path):
    model_class = family.checkpoint.hf_model_class()
    return model_class.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ref(family: ModelFamily, model_dir: Path):
    return load_reference(family, model_dir)


@pytest.fixture(scope="module")
def ref64(family: ModelFamily, model_dir: Path):
    return load_reference(family, model_dir).double()


@pytest.fixture(scope="module")
def ours(model_dir: Path):
    return load_model(model_dir, torch.float32)


@pytest.fixture(scope="module")
def prompt(ours, processor):
    """``prompt(name, seed)``: PROMPTS[name] as a runner prompt for this family."""

    def build(name: str, seed: int = 0):
        return make_prompt(ours.config, in_pixels(ours.config, PROMPTS[name]), seed, processor)

    return build


@pytest.fixture(scope="module")
def expected_logits(ref64, ours, prompt):
    """Reference logits (float64) of ``prompt(name, seed)``, computed once per prompt."""
    cache: dict[tuple[str, int], torch.Tensor] = {}

    def logits(name: str, seed: int = 0) -> torch.Tensor:
        if (name, seed) not in cache:
            cache[name, seed] = ref_logits(ref64, ours.config, prompt(name, seed))
        return cache[name, seed]

    return logits


# ---------------------------------------------------------------- the vision tower


@pytest.mark.parametrize("image_tokens", [[(2, 2)], [(6, 4), (3, 7)], PROMPTS["three_images"], [(16, 11)]])
def test_vision_tower_and_every_deepstack_feature_match_reference_whole_and_unit_by_unit(
    ref, ours, processor, image_tokens
) -> None:
    pixel_values, grids = preprocess(make_images(in_pixels(ours.config, image_tokens)), processor, ours.config)
    visual = ours.visual
    with torch.no_grad():
        features = reference_image_features(ref, ours.config, pixel_values, grids)
        expected = tower_outputs(features)
        whole = visual(pixel_values, grids)
        by_units, alone, start = [], [], 0
        for grid, step in zip(grids, (1, 2, 3, 4)):  # one image a unit per call, the next two at a time, ...
            num_rows = image_pixel_rows(ours.config, grid)
            pixels = pixel_values[start : start + num_rows]
            state = visual.start_encode(pixels, grid)
            start += num_rows
            while not state.done:
                visual.run_units(state, step)
            by_units.append(visual.finish_encode(state))
            alone.append(visual(pixels, [grid]))
    got = [whole.main, *whole.deepstack]
    assert len(got) == len(expected) == 1 + len(ours.config.vision.deepstack_visual_indexes)
    diffs = [max_diff(g, e) for g, e in zip(got, expected)]
    print(f"vision {image_tokens}: max|Δ| {', '.join(f'{d:.2e}' for d in diffs)} (main, then DeepStack)")
    assert all(g.shape == e.shape for g, e in zip(got, expected))
    assert max(diffs) <= VISION_TOL
    # unit by unit is the same arithmetic as the image's whole encode: bitwise. Several images in one call share
    # each linear layer's product, whose summation order the BLAS may pick by row count (MKL's AVX-512 paths do):
    # as close as the reference, not bitwise
    lo = 0
    for split, one in zip(by_units, alone):
        assert all(torch.equal(s, o) for s, o in zip((split.main, *split.deepstack), (one.main, *one.deepstack)))
        rows = whole.rows(lo, lo + split.num_tokens)
        assert max(max_diff(s, w) for s, w in zip((split.main, *split.deepstack), (rows.main, *rows.deepstack))) <= 1e-5
        lo += split.num_tokens
    assert lo == whole.num_tokens


# ---------------------------------------------------------------- the language model with images


@pytest.mark.parametrize("name", list(PROMPTS))
def test_mrope_positions_match_get_rope_index(ref, ours, prompt, name: str) -> None:
    check_mrope_positions(ref, ours.config, prompt(name))


@pytest.mark.parametrize("name", list(PROMPTS))
def test_full_prompt_logits_match(ref, expected_logits, ours, prompt, name: str) -> None:
    p = prompt(name)
    runner = TinyRunner(ours)
    got = runner.prefill(runner.add(p), chunk=len(p.ids))
    expected = expected_logits(name)
    d = max_diff(got, expected)
    print(f"full prompt {name} ({len(p.ids)} tokens): max|Δlogit| = {d:.2e} vs fp64, "
          f"{max_diff(got, ref_logits(ref, ours.config, p)):.2e} vs fp32 (max |logit| {expected.abs().max():.1f})")
    assert d <= TOL


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_reference_at_every_position(expected_logits, ours, prompt, chunk: int) -> None:
    # (a tiling family's three images are ~1,300 tokens: one token a step over its one image, ~280)
    name = "one_image" if chunk == 1 and tiled(ours.config) else "three_images"
    p = prompt(name)
    is_image = [t == ours.config.image_token_id for t in p.ids]
    assert any(is_image[b - 1] and is_image[b] for b in range(chunk, len(p.ids), chunk)), "no boundary splits an image"
    runner = TinyRunner(ours, seed=chunk)
    got = runner.prefill(runner.add(p), chunk=chunk)
    d = max_diff(got, expected_logits(name))
    print(f"chunked prefill chunk={chunk} ({len(p.ids)} tokens): max|Δlogit| = {d:.2e}")
    assert d <= TOL


@pytest.mark.parametrize("name", ["text", "one_image"])
def test_greedy_decode_matches_generate(ref, ours, prompt, name: str) -> None:
    p = prompt(name, seed=3)
    assert greedy_ids(ours, p, 32) == generate_ids(ref, ours.config, p, 32)


def test_mixed_batch_matches_each_sequence_alone(ref64, ours, processor) -> None:
    """One forward carrying a first prefill chunk, a later chunk that starts inside an image (so every DeepStack
    tensor is sliced from its middle), and two decodes."""
    config = ours.config
    sizes = [PROMPTS["one_image"], PROMPTS["three_images"], [], [(4, 4)]]
    prompts = [make_prompt(config, in_pixels(config, s), 10 + i, processor) for i, s in enumerate(sizes)]
    run = mixed_batch(ours, prompts, first_chunk=40)  # sequence 1 resumes inside its first image (pads 10..105)
    d_alone = max(max_diff(b, a) for b, a in zip(run.batched, run.alone))
    d_ref = max(max_diff(got, ref_logits(ref64, config, p)[-got.shape[0] :]) for p, got in zip(run.seen, run.batched))
    print(f"mixed batch: max|Δlogit| batched vs alone = {d_alone:.2e}, vs reference = {d_ref:.2e}")
    assert d_alone <= TOL
    assert d_ref <= TOL


def test_bf16_load_tracks_fp32_reference(ref, model_dir: Path, ours, processor) -> None:
    check_bf16_tracks_fp32(ref, model_dir, in_pixels(ours.config, PROMPTS["three_images"]), processor)


# ---------------------------------------------------------------- layouts and tied embeddings


def test_every_layout_matches_reference_in_chunks_of_7(family, tmp_path: Path) -> None:
    """Each of the recipe's layouts (transformers 5's, and the release's where the family has one), sharded,
    prefilled in chunks of 7 so chunks start inside images."""
    assert family.checkpoint.layouts
    for layout in family.checkpoint.layouts:
        model_dir = make_model(tmp_path / layout, size="tiny", seed=1, layout=layout, shards=2, family=family.name)
        config_json = json.loads((model_dir / "config.json").read_text())
        assert config_json["architectures"][0] in family.architectures
        reference = load_reference(family, model_dir).double()
        model = load_model(model_dir, torch.float32)
        assert model.config.layout == layout and model.config.family == family.name
        p = make_prompt(model.config, in_pixels(model.config, PROMPTS["three_images"]), 8,
                        checkpoint_processor(model_dir, model.config))
        runner = TinyRunner(model, seed=9)
        expected = ref_logits(reference, model.config, p)
        d = max_diff(runner.prefill(runner.add(p), chunk=7), expected)
        print(f"make_model {layout}: max|Δlogit| = {d:.2e} (max |logit| {expected.abs().max():.1f})")
        assert d <= TOL, layout


def test_tied_embeddings_match_reference(family, model_dir: Path, processor, tmp_path: Path) -> None:
    """A tied checkpoint (as the small releases ship): no lm_head tensor, logits from the embeddings."""
    config_json = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config_json, "tie_word_embeddings": True}))
    (tmp_path / "preprocessor_config.json").write_bytes((model_dir / "preprocessor_config.json").read_bytes())
    tensors = {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    tied = load_model(tmp_path, torch.float32)
    assert tied.config.tie_word_embeddings
    assert tied.lm_head is None or tied.lm_head.weight is tied.embed_tokens.weight
    p = make_prompt(tied.config, in_pixels(tied.config, PROMPTS["one_image"]), 4, processor)
    runner = TinyRunner(tied)
    expected = ref_logits(load_reference(family, tmp_path).double(), tied.config, p)
    d = max_diff(runner.prefill(runner.add(p), chunk=13), expected)
    print(f"tied embeddings: max|Δlogit| = {d:.2e}")
    assert d <= TOL


# ---------------------------------------------------------------- the image processor


@pytest.mark.parametrize("width, height", [(448, 308), (1000, 700), (37, 401), (2048, 1536), (1000, 30)])
def test_our_preprocessing_is_bit_identical_to_the_checkpoint_s_processor(model_dir: Path, width, height) -> None:
    """Our preprocess_image with the checkpoint's ImageProcessorConfig against transformers' processor loaded from
    the same preprocessor_config.json, its PIL backend: same grid, bit-identical pixels. (Where torchvision is
    installed, as on the GPU machine, transformers defaults to its torchvision backend, whose resize differs from
    PIL's: pixels up to 0.015 apart at 1000 x 700.)"""
    from transformers import AutoImageProcessor

    from firsttoken.inputs.budget import image_pixels, plan_image
    from firsttoken.inputs.image import preprocess_image

    config = load_model_config(model_dir)
    pixels = config.image_processor
    (image,) = make_images([(width, height)], seed=width + height)
    if tiled(config):  # at the family's default budget; InternVLProcessor crops to patches whatever the config says
        reference = AutoImageProcessor.from_pretrained(model_dir, backend="pil", crop_to_patches=True)
        expected = reference(images=[image], return_tensors="np")
        budget = family_named(config.family).budget_ladder.default(1 << 20)
        got = image_pixels(image, plan_image(width, height, budget, 4, pixels), pixels)
        assert got.grid_thw[0] == int(expected["num_patches"][0])
        # ours are the tower's patch rows of the same tiles
        expected = {"pixel_values": tiles_to_patch_rows(torch.from_numpy(expected["pixel_values"]),
                                                        pixels.patch_size).numpy()}
    else:
        reference = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        expected = reference(images=[image], return_tensors="np")
        got = preprocess_image(image, pixels, pixels.min_pixels, pixels.max_pixels)
        assert list(got.grid_thw) == expected["image_grid_thw"][0].tolist()
    assert np.array_equal(got.pixel_values.numpy(), expected["pixel_values"])
