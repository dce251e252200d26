"""Our Qwen2.5-VL against transformers' Qwen2_5_VLForConditionalGeneration on make_model's tiny checkpoints (both
config/weight layouts): the window layout, the vision tower alone (whole, and unit by unit as the engine runs it),
M-RoPE positions, full-prompt and chunked-prefill logits, mixed batches, greedy decoding, bf16, the image processor,
and the real engine with 7/13-token steps and the tower split across steps (ours below, and test_engine_oracle.py's
tests imported and run here on Qwen2.5-VL: chunks inside images, a prefix-cache hit ending inside an image,
preemption by recompute).

Tolerance: max |Δlogit| <= 1e-4 in fp32 (as Qwen2-VL's, test_qwen2_vl_parity.py), exact greedy ids. Logits are
compared with transformers' model run in float64 (``ref64``): on these checkpoints (logits up to |50|) transformers'
own fp32 run is ~9e-5 from its fp64 run on image prompts, and ours ~2e-5 to 5e-5; against transformers' fp32 we
measure up to ~1.1e-4, the sum of both roundings (the printed figures give both). Greedy ids, the vision tower and
positions are compared with transformers in fp32.

The tiny tower has depth 4 with full attention in blocks 1 and 3 and 112-px windows (4 x 4 merged tokens); the
images include grids whose windows divide evenly, grids with a short last window row and column, and an image
smaller than one window, so the reorder, the partial windows and the restore all count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from firsttoken.models.checkpoint import make_model
from firsttoken.models.config import ModelConfig
from firsttoken.models.loader import load_model
from firsttoken.models.qwen2_5_vl_vision import block_flops, window_layout
from firsttoken.models.qwen2_vl import Qwen2VLModel
from firsttoken.models.registry import family_named, load_model_config
from tests.oracle.test_engine_oracle import (  # noqa: F401  (its test_* are collected here, on Qwen2.5-VL)
    engine_request,
    greedy_oracle,
    make_engine,
    run,
    test_engine_matches_generate_after_preemption_by_recompute,
    test_engine_matches_generate_when_the_prefix_cache_hit_ends_inside_an_image,
    test_engine_matches_generate_with_chunks_inside_images_and_encodes_split_across_steps,
)
from tests.oracle.test_engine_oracle import make_prompt as make_engine_prompt
from tests.oracle.test_qwen2_vl_parity import (
    TinyRunner,
    check_bf16_tracks_fp32,
    check_mrope_positions,
    generate_ids,
    greedy_ids,
    make_images,
    make_prompt,
    max_diff,
    mixed_batch,
    preprocess,
    ref_logits,
)

TOL = 1e-4  # max |Δlogit|, fp32
FAMILY = "qwen2.5-vl"
PROMPTS = {
    "text": [],
    "one_image": [(168, 112)],  # 12 x 8 patches -> 6 x 4 merged tokens: windows 4 + 2 wide
    # (width, height): 12 x 8 merged (windows divide evenly), 5 x 9 (short last column and row), 2 x 2 (< 1 window)
    "three_images": [(336, 224), (140, 252), (56, 56)],
}


# ---------------------------------------------------------------- fixtures


def load_reference(model_dir: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("q25-tiny"), size="tiny", seed=0, family=FAMILY)


@pytest.fixture(scope="module")
def ref(model_dir: Path):
    return load_reference(model_dir)


@pytest.fixture(scope="module")
def ref64(model_dir: Path):
    return load_reference(model_dir).double()


@pytest.fixture(scope="module")
def expected_logits(ref64):
    """Reference logits of ``make_prompt(config, PROMPTS[name], seed)``, computed once per prompt."""
    cache: dict[tuple[str, int], torch.Tensor] = {}

    def logits(config, name: str, seed: int = 0) -> torch.Tensor:
        if (name, seed) not in cache:
            cache[name, seed] = ref_logits(ref64, config, make_prompt(config, PROMPTS[name], seed))
        return cache[name, seed]

    return logits


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> Qwen2VLModel:
    return load_model(model_dir, torch.float32)


# ---------------------------------------------------------------- the window layout and its cost


GRIDS = [(1, 16, 24), (1, 18, 10), (1, 4, 4), (1, 8, 8), (1, 2, 30), (2, 12, 20)]  # patches (t, h, w)


@pytest.mark.parametrize("grids", [[g] for g in GRIDS] + [GRIDS])
def test_window_order_and_windows_match_get_vision_window_index(ours: Qwen2VLModel, grids) -> None:
    from transformers.vision_utils import get_vision_window_index

    v = ours.config.vision
    index, cu = get_vision_window_index(torch.tensor(grids), v.spatial_merge_size, v.window_size, v.patch_size)
    layout = window_layout(grids, v)
    assert torch.equal(layout.order, index)
    assert layout.window_rows == torch.diff(cu).tolist()
    assert torch.equal(layout.order[layout.restore], torch.arange(index.numel()))


@pytest.mark.parametrize("grid", GRIDS)
def test_encoder_units_cost_windowed_blocks_by_their_flops(ours: Qwen2VLModel, grid) -> None:
    v = ours.config.vision
    units = family_named(FAMILY).encoder_units(v, grid)
    t, h, w = grid
    visual_tokens = t * h * w // 4
    windows = window_layout([grid], v).window_rows
    assert len(units) == v.depth == 4
    for i, unit in enumerate(units):
        assert unit.num_patches == t * h * w
        if i in v.fullatt_block_indexes:  # blocks 1 and 3: a Qwen2-VL block's pairs and cost
            assert (unit.attention_pairs, unit.cost_tokens) == (t * (h * w) ** 2, visual_tokens)
        else:
            assert unit.attention_pairs == sum(n * n for n in windows)
            share = block_flops(v, t * h * w, unit.attention_pairs) / block_flops(v, t * h * w, t * (h * w) ** 2)
            assert unit.cost_tokens == max(1, round(visual_tokens * share))
            assert 1 <= unit.cost_tokens <= visual_tokens
    if max(h, w) > 8:  # more than one window: a windowed block is cheaper than a full one
        assert units[0].cost_tokens < units[1].cost_tokens


# ---------------------------------------------------------------- the vision tower


@pytest.mark.parametrize("sizes", [[(56, 56)], [(168, 112), (84, 196)], PROMPTS["three_images"], [(448, 308)]])
def test_vision_tower_matches_reference_whole_and_unit_by_unit(ref, ours: Qwen2VLModel, sizes) -> None:
    pixel_values, grids = preprocess(make_images(sizes))
    with torch.no_grad():
        expected = torch.cat(ref.model.get_image_features(pixel_values, torch.tensor(grids)).pooler_output)
        whole = ours.visual(pixel_values, grids).main
        by_units, alone, start = [], [], 0
        for grid, step in zip(grids, (1, 2, 3, 4)):  # one image a unit per call, the next two at a time, ...
            num_patches = grid[0] * grid[1] * grid[2]
            pixels = pixel_values[start : start + num_patches]
            state = ours.visual.start_encode(pixels, grid)
            start += num_patches
            while not state.done:
                ours.visual.run_units(state, step)
            by_units.append(ours.visual.finish_encode(state).main)
            alone.append(ours.visual(pixels, [grid]).main)
    d = max_diff(whole, expected)
    print(f"vision {sizes}: max|Δ| = {d:.2e} (max |out| {expected.abs().max():.2f})")
    assert whole.shape == expected.shape
    assert d <= 1e-5
    # unit by unit is the same arithmetic as the image's whole encode: bitwise. Several images in one call share
    # each linear layer's product, whose summation order the BLAS may pick by row count (MKL's AVX-512 paths do):
    # as close as the reference, not bitwise
    for got, want in zip(by_units, alone):
        assert torch.equal(got, want)
    assert max_diff(torch.cat(by_units), whole) <= 1e-5


# ---------------------------------------------------------------- the language model with images


@pytest.mark.parametrize("name", list(PROMPTS))
def test_mrope_positions_match_get_rope_index(ref, ours: Qwen2VLModel, name: str) -> None:
    check_mrope_positions(ref, ours.config, make_prompt(ours.config, PROMPTS[name]))


@pytest.mark.parametrize("name", list(PROMPTS))
def test_full_prompt_logits_match(ref, expected_logits, ours: Qwen2VLModel, name: str) -> None:
    prompt = make_prompt(ours.config, PROMPTS[name])
    runner = TinyRunner(ours)
    got = runner.prefill(runner.add(prompt), chunk=len(prompt.ids))
    expected = expected_logits(ours.config, name)
    d = max_diff(got, expected)
    print(f"full prompt {name} ({len(prompt.ids)} tokens): max|Δlogit| = {d:.2e} vs fp64, "
          f"{max_diff(got, ref_logits(ref, ours.config, prompt)):.2e} vs fp32 (max |logit| {expected.abs().max():.1f})")
    assert d <= TOL


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_reference_at_every_position(expected_logits, ours: Qwen2VLModel, chunk: int) -> None:
    prompt = make_prompt(ours.config, PROMPTS["three_images"])
    is_image = [t == ours.config.image_token_id for t in prompt.ids]
    assert any(is_image[b - 1] and is_image[b] for b in range(chunk, len(prompt.ids), chunk))
    runner = TinyRunner(ours, seed=chunk)
    got = runner.prefill(runner.add(prompt), chunk=chunk)
    d = max_diff(got, expected_logits(ours.config, "three_images"))
    print(f"chunked prefill chunk={chunk} ({len(prompt.ids)} tokens): max|Δlogit| = {d:.2e}")
    assert d <= TOL


@pytest.mark.parametrize("name", ["text", "one_image"])
def test_greedy_decode_matches_generate(ref, ours: Qwen2VLModel, name: str) -> None:
    prompt = make_prompt(ours.config, PROMPTS[name], seed=3)
    assert greedy_ids(ours, prompt, 32) == generate_ids(ref, ours.config, prompt, 32)


def test_mixed_batch_matches_each_sequence_alone(ref64, ours: Qwen2VLModel) -> None:
    """One forward carrying a first prefill chunk, a later chunk that starts inside an image, and two decodes."""
    config = ours.config
    prompts = [
        make_prompt(config, PROMPTS["one_image"], seed=10),
        make_prompt(config, PROMPTS["three_images"], seed=11),
        make_prompt(config, [], seed=12),
        make_prompt(config, [(112, 112)], seed=13),
    ]
    run = mixed_batch(ours, prompts, first_chunk=40)  # sequence 1 resumes inside its first image (pads 10..105)
    d_alone = max(max_diff(b, a) for b, a in zip(run.batched, run.alone))
    d_ref = max(max_diff(got, ref_logits(ref64, config, p)[-got.shape[0] :]) for p, got in zip(run.seen, run.batched))
    print(f"mixed batch: max|Δlogit| batched vs alone = {d_alone:.2e}, vs reference = {d_ref:.2e}")
    assert d_alone <= TOL
    assert d_ref <= TOL


def test_bf16_load_tracks_fp32_reference(ref, model_dir: Path) -> None:
    check_bf16_tracks_fp32(ref, model_dir, PROMPTS["three_images"])


# ---------------------------------------------------------------- layouts and tied embeddings


@pytest.mark.parametrize("layout", ["transformers", "original"])
def test_both_layouts_match_reference_in_chunks_of_7(tmp_path: Path, layout: str) -> None:
    model_dir = make_model(tmp_path, size="tiny", seed=1, layout=layout, shards=2, family=FAMILY)
    config_json = json.loads((model_dir / "config.json").read_text())
    assert ("text_config" in config_json) == (layout == "transformers")
    reference = load_reference(model_dir).double()
    model = load_model(model_dir, torch.float32)
    assert model.config.layout == layout
    assert model.config.vision.fullatt_block_indexes == (1, 3) and model.config.vision.window_size == 112
    prompt = make_prompt(model.config, PROMPTS["three_images"], seed=8)
    runner = TinyRunner(model, seed=9)
    expected = ref_logits(reference, model.config, prompt)
    d = max_diff(runner.prefill(runner.add(prompt), chunk=7), expected)
    print(f"make_model {layout}: max|Δlogit| = {d:.2e} (max |logit| {expected.abs().max():.1f})")
    assert d <= TOL


def test_tied_embeddings_match_reference(model_dir: Path, tmp_path: Path) -> None:
    """The 3B release ties lm_head to embed_tokens: the checkpoint then has no lm_head."""
    config_json = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config_json, "tie_word_embeddings": True}))
    tensors = load_file(str(model_dir / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    tied = load_model(tmp_path, torch.float32)
    assert tied.lm_head is None or tied.lm_head.weight is tied.embed_tokens.weight  # logits from the embeddings
    prompt = make_prompt(tied.config, PROMPTS["one_image"], seed=4)
    runner = TinyRunner(tied)
    expected = ref_logits(load_reference(tmp_path).double(), tied.config, prompt)
    d = max_diff(runner.prefill(runner.add(prompt), chunk=32), expected)
    print(f"tied embeddings: max|Δlogit| = {d:.2e}")
    assert d <= TOL


# ---------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def config(model_dir: Path) -> ModelConfig:
    return load_model_config(model_dir)


@pytest.fixture(scope="module")
def reference(ref):
    """Greedy tokens by transformers (test_engine_oracle.py's oracle); its tests imported above use it too."""
    return greedy_oracle(ref)


class RecordingExecutor:
    """The engine's executor, recording each step's encoder work (units per image hash)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.units_per_step: list[dict[str, int]] = []

    def execute(self, batch):
        self.units_per_step.append({w.content_hash: w.num_units for w in batch.encoder_work})
        return self.inner.execute(batch)

    def finish_step(self):
        return self.inner.finish_step()

    @property
    def encoder_cache_bytes(self) -> int:
        return self.inner.encoder_cache_bytes


@pytest.mark.parametrize("step_tokens", [7, 13])
def test_engine_matches_transformers_with_chunks_inside_images_and_the_tower_split_across_steps(
    model_dir: Path, reference, step_tokens: int
) -> None:
    engine = make_engine(model_dir, step_tokens)
    config = engine.model_config
    prompts = {  # visual tokens 45 (5 x 9 merged: short last window row and column), 32 (two whole windows), 4
        "text": make_engine_prompt(config, [], seed=1),
        "three_images": make_engine_prompt(config, [(140, 252), (224, 112), (56, 56)], seed=2),
    }
    requests = [engine_request(config, p, name) for name, p in prompts.items()]
    recorder = RecordingExecutor(engine.executor)
    engine.executor = recorder
    got = run(engine, requests)  # one mixed batch, every prompt on the long lane
    for name, prompt in prompts.items():
        assert got[name] == reference(prompt), name
    assert engine.stats().num_images_encoded == 3
    units_per_image = {im.content_hash: ([s[im.content_hash] for s in recorder.units_per_step
                                          if im.content_hash in s], im) for r in requests for im in r.images}
    for steps, image in units_per_image.values():
        assert sum(steps) == config.vision.depth
        if image.encoder_units[0].cost_tokens > step_tokens:  # a windowed block alone exceeds a step's budget
            assert steps == [1, 1, 1, 1]
    assert sum(steps == [1, 1, 1, 1] for steps, _ in units_per_image.values()) >= 2  # 45 and 32 visual tokens


# ---------------------------------------------------------------- the image processor


def test_checkpoint_image_processor_is_qwen2_vl_s_and_ours_is_bit_identical(model_dir: Path) -> None:
    import numpy as np
    from transformers import AutoImageProcessor

    from firsttoken.inputs.image import preprocess_image

    processor = AutoImageProcessor.from_pretrained(model_dir)
    assert type(processor).__name__.startswith("Qwen2VLImageProcessor")
    pixels = load_model_config(model_dir).image_processor
    for image in make_images([(448, 308), (1000, 700), (37, 401)], seed=5):
        expected = processor(images=[image], return_tensors="np")
        ours = preprocess_image(image, pixels, pixels.min_pixels, pixels.max_pixels)
        assert list(ours.grid_thw) == expected["image_grid_thw"][0].tolist()
        assert np.array_equal(ours.pixel_values.numpy(), expected["pixel_values"])

