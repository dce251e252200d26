"""Video through the production engine (LLMEngine: real Scheduler + ModelRunner, prefix and encoder caches) against
transformers on the same weights, for every family that serves video (this module's ``family``; conftest.py's ``model_dir``):
fp32, 12 greedy tokens, exact ids.

The engine serves a video as vision items, one per temporal grid (types.ImageItem, kind "video"): grid k of a
(T, h, w) video is the item (1, h, w) over rows [k*h*w, (k+1)*h*w) of ``pixel_values_videos`` and the grid's h*w/m²
video-pad tokens. test_video_tower.py proves the tower's side of that; here the whole request is served that way
and must give transformers' tokens for the whole video (``pixel_values_videos`` + ``video_grid_thw``).

Prompts are built by hand as the processors build them: Qwen2-VL / Qwen2.5-VL wrap a video's T*h*w/m² pads in one
vision_start .. vision_end; Qwen3-VL's chat template wraps the video in vision_start .. vision_end and its processor
(``Qwen3VLProcessor.replace_video_token``) writes each grid as ``<{t:.1f} seconds>`` text, vision_start, the grid's
pads, vision_end. Pixels are random rows shaped like the processors' output; M-RoPE positions and their delta are
transformers' own ``get_rope_index`` (Qwen2.5-VL with ``second_per_grid_ts``), so this tests the engine's serving of
video, not our position code (another module's). Step budgets of 7 and 13 tokens cut prefill chunks inside the
video and run every grid's encoder units across steps (every prompt in the long lane, test_engine_oracle.py's
``make_engine``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from firsttoken.models.family import ModelFamily
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.registry import family_named, load_model_config
from firsttoken.types import EngineRequest, ImageItem, SamplingParams
from tests.helpers import RecordingExecutor
from tests.oracle.parity import VIDEO_FAMILIES
from tests.oracle.test_engine_oracle import make_engine, run


@pytest.fixture(scope="module", params=VIDEO_FAMILIES)
def family(request: pytest.FixtureRequest) -> ModelFamily:
    """The families that serve video."""
    return family_named(request.param)


NUM_NEW = 12
LOGPROB_TOL = 1e-4  # max |Δ logprob| of a prompt token, fp32 (test_engine_oracle.py's)
FPS = 1.0  # Qwen3-VL's timestamps: frames 0, 1, 2, ... at this rate, two frames per temporal grid
VIDEO = (3, 8, 12)  # (T, h, w) in patches: 24 visual tokens per grid; Qwen2.5-VL: a 4 x 4 and a 4 x 2 window
IMAGE = (1, 10, 6)  # 15 visual tokens
TEXT, IMAGE_KIND, VIDEO_KIND = 0, 1, 2  # transformers' mm_token_type_ids
torch.set_num_threads(2)


@dataclass(frozen=True)
class Part:
    """A vision input of a prompt: its pad token id's kind, grid and pixel rows."""

    kind: int  # IMAGE_KIND | VIDEO_KIND
    grid: tuple[int, int, int]
    pixels: torch.Tensor  # [t*h*w, C * temporal_patch_size * P * P]
    second_per_grid: float = 1.0  # Qwen2.5-VL's temporal spacing of a video's grids


@dataclass
class VideoPrompt:
    ids: list[int]
    parts: list[Part]
    spans: list[tuple[int, int]] = field(default_factory=list)  # per temporal grid of every part: (offset, tokens)

    def hf_inputs(self, family: str) -> dict:
        """transformers' vision kwargs: pixel_values_videos / video_grid_thw (+ second_per_grid_ts), pixel_values /
        image_grid_thw."""
        out: dict = {}
        videos = [p for p in self.parts if p.kind == VIDEO_KIND]
        images = [p for p in self.parts if p.kind == IMAGE_KIND]
        if videos:
            out.update(pixel_values_videos=torch.cat([p.pixels for p in videos]),
                       video_grid_thw=torch.tensor([p.grid for p in videos]))
            if family == "qwen2.5-vl":
                out["second_per_grid_ts"] = torch.tensor([p.second_per_grid for p in videos])
        if images:
            out.update(pixel_values=torch.cat([p.pixels for p in images]),
                       image_grid_thw=torch.tensor([p.grid for p in images]))
        return out


@pytest.fixture(scope="module")
def config(model_dir: Path) -> ModelConfig:
    return load_model_config(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(family: ModelFamily, model_dir: Path):
    model_class = family.checkpoint.hf_model_class()
    return model_class.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def random_rows(config: ModelConfig, grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    vision = config.vision
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    t, h, w = grid
    return torch.randn(t * h * w, patch_dim, generator=torch.Generator().manual_seed(seed))


def build_prompt(config: ModelConfig, tokenizer, layout: list, seed: int) -> VideoPrompt:
    """``layout``: ints (that many random text tokens) and Parts, in prompt order."""
    rng = random.Random(seed)
    merge2 = config.vision.spatial_merge_size**2
    start, end = config.vision_start_token_id, config.vision_end_token_id
    prompt = VideoPrompt([], [])
    for piece in layout:
        if isinstance(piece, int):
            prompt.ids += [rng.randrange(0, 15000) for _ in range(piece)]
            continue
        prompt.parts.append(piece)
        t, h, w = piece.grid
        per_grid = h * w // merge2
        if piece.kind == IMAGE_KIND:
            prompt.ids.append(start)
            prompt.spans.append((len(prompt.ids), per_grid))
            prompt.ids += [config.image_token_id] * per_grid + [end]
        elif config.family == "qwen3-vl":  # the template's wrap, then replace_video_token's grids
            prompt.ids.append(start)
            for k in range(t):
                seconds = (2 * k + 2 * k + 1) / 2 / FPS  # the mean of the grid's two frames' times
                prompt.ids += tokenizer(f"<{seconds:.1f} seconds>", add_special_tokens=False).input_ids + [start]
                prompt.spans.append((len(prompt.ids), per_grid))
                prompt.ids += [config.video_token_id] * per_grid + [end]
            prompt.ids.append(end)
        else:
            prompt.ids.append(start)
            for k in range(t):
                prompt.spans.append((len(prompt.ids) + k * per_grid, per_grid))
            prompt.ids += [config.video_token_id] * (t * per_grid) + [end]
    return prompt


def token_types(config: ModelConfig, ids: list[int]) -> torch.Tensor:
    kinds = {config.image_token_id: IMAGE_KIND, config.video_token_id: VIDEO_KIND}
    return torch.tensor([[kinds.get(i, TEXT) for i in ids]])


def reference_ids(hf_model, config: ModelConfig, prompt: VideoPrompt) -> list[int]:
    """Greedy by repeated full forwards (the model's definition, no KV cache); checked against ``generate``."""
    vision = prompt.hf_inputs(config.family)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NUM_NEW):
            ids = prompt.ids + out
            logits = hf_model(input_ids=torch.tensor([ids]), mm_token_type_ids=token_types(config, ids), **vision)
            out.append(int(logits.logits[0, -1].argmax()))
        generated = hf_model.generate(torch.tensor([prompt.ids]), mm_token_type_ids=token_types(config, prompt.ids),
                                      max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False,
                                      repetition_penalty=1.0, **vision)
    assert generated[0, len(prompt.ids):].tolist() == out, "transformers' generate departs from its own forward"
    return out


def engine_request(hf_model, config: ModelConfig, prompt: VideoPrompt, rid: str) -> EngineRequest:
    """One ImageItem per temporal grid (kind "video" for a video's), positions and delta from transformers'
    ``get_rope_index``."""
    family = family_named(config.family)
    items, spans = [], iter(prompt.spans)
    videos = 0
    for part in prompt.parts:
        t, h, w = part.grid
        video_index = None
        if part.kind == VIDEO_KIND:
            video_index, videos = videos, videos + 1
        grid = (1, h, w)
        for k in range(t):
            rows = part.pixels[k * h * w : (k + 1) * h * w]
            offset, num_tokens = next(spans)
            assert all(i == (config.image_token_id if part.kind == IMAGE_KIND else config.video_token_id)
                       for i in prompt.ids[offset : offset + num_tokens])
            digest = hashlib.sha256(rows.numpy().tobytes() + repr(grid).encode()).hexdigest()
            items.append(ImageItem(digest, offset, num_tokens, grid, family.encoder_units(config.vision, grid), rows,
                                   "video" if part.kind == VIDEO_KIND else "image", video_index))
    vision = {k: v for k, v in prompt.hf_inputs(config.family).items() if not k.startswith("pixel_values")}
    input_ids = torch.tensor([prompt.ids])
    positions, delta = hf_model.model.get_rope_index(input_ids, token_types(config, prompt.ids), **vision)
    return EngineRequest(rid, tuple(prompt.ids), tuple(items), positions[:, 0].contiguous(), int(delta),
                         SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True), 0.0, 0.0)


def video(config: ModelConfig, seed: int, second_per_grid: float = 1.0) -> Part:
    return Part(VIDEO_KIND, VIDEO, random_rows(config, VIDEO, seed), second_per_grid)


PROMPTS = {
    "text_video": lambda config: [9, video(config, 1), 4],
    "video_image": lambda config: [5, video(config, 2, second_per_grid=0.75), 3,
                                   Part(IMAGE_KIND, IMAGE, random_rows(config, IMAGE, 3)), 4],
}


@pytest.mark.parametrize("step_tokens", [7, 13])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_engine_matches_transformers_on_video_with_chunks_and_encodes_split_across_steps(
    model_dir, config, tokenizer, hf_model, name, step_tokens
):
    prompt = build_prompt(config, tokenizer, PROMPTS[name](config), seed=len(name))
    request = engine_request(hf_model, config, prompt, name)
    num_grids = sum(1 for im in request.images if im.kind == "video")
    assert num_grids == VIDEO[0]
    engine = make_engine(model_dir, step_tokens)
    recorder = RecordingExecutor(engine.executor)
    engine.executor = recorder
    got = run(engine, [request])
    assert got[name] == reference_ids(hf_model, config, prompt)
    assert engine.stats().num_images_encoded == len(request.images)
    # chunks ended inside the video, and no grid was encoded in one step: the grid's units ran over several
    chunk_ends = {c.end for b in recorder.batches for c in b.chunks if not c.is_decode}
    first, last = request.images[0].offset, request.images[num_grids - 1].end
    assert any(first < e < last for e in chunk_ends)
    for image in request.images:
        steps = [w.num_units for b in recorder.batches for w in b.encoder_work if w.content_hash == image.content_hash]
        assert sum(steps) == len(image.encoder_units) and len(steps) > 1


def test_the_same_video_again_hits_the_encoder_cache_and_the_prefix_cache(model_dir, config, tokenizer, hf_model):
    # the follow-up shares the text before the video and the video, then differs: its cached prefix ends inside the
    # video (the prefix cache's keys carry each grid's hash and offset), and the grids past it come from the
    # encoder cache: no vision-tower work at all
    part = video(config, seed=4)
    first = build_prompt(config, tokenizer, [9, part, 4], seed=7)
    follow = build_prompt(config, tokenizer, [9, part, 11], seed=7)
    assert follow.ids[: len(first.ids) - 4] == first.ids[:-4]
    engine = make_engine(model_dir, 13)
    run(engine, [engine_request(hf_model, config, first, "first")])
    encoded = engine.stats().num_images_encoded
    assert encoded == VIDEO[0]
    recorder = RecordingExecutor(engine.executor)
    engine.executor = recorder
    stats: dict = {}
    got = run(engine, [engine_request(hf_model, config, follow, "follow")], stats)
    assert got["follow"] == reference_ids(hf_model, config, follow)
    assert engine.stats().num_images_encoded == encoded
    assert not any(b.encoder_work for b in recorder.batches)
    assert stats["follow"].num_cached_prompt_tokens > 0
    video_end = max(im.end for im in engine_request(hf_model, config, follow, "x").images)
    assert stats["follow"].num_cached_prompt_tokens < video_end  # the hit ends inside or at the video...
    assert stats["follow"].num_encoder_cache_hits > 0  # ...so a grid's rows came from the encoder cache


def engine_prompt_logprobs(engine, request: EngineRequest) -> list:
    engine.add_request(replace(request, sampling=replace(request.sampling, max_tokens=1, prompt_logprobs=2)))
    scored: list = []
    while engine.has_unfinished():
        for out in engine.step():
            scored += out.prompt_logprobs or []
    return scored


@pytest.mark.parametrize("name", list(PROMPTS))
def test_every_prompt_position_matches_transformers_in_chunks_of_7(model_dir, config, tokenizer, hf_model, name):
    # greedy ids alone barely see a tiny random model's vision rows (two grids swapped can leave all 12 alike);
    # each prompt token's logprob given the tokens before it sees every row of every grid
    prompt = build_prompt(config, tokenizer, PROMPTS[name](config), seed=len(name))
    scored = engine_prompt_logprobs(make_engine(model_dir, 7), engine_request(hf_model, config, prompt, name))
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([prompt.ids]), mm_token_type_ids=token_types(config, prompt.ids),
                          **prompt.hf_inputs(config.family)).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)[: len(prompt.ids) - 1]
    assert [lp.token_id for lp in scored] == prompt.ids[1:]
    want = expected[torch.arange(len(prompt.ids) - 1), torch.tensor(prompt.ids[1:])]
    got = torch.tensor([lp.logprob for lp in scored])
    print(f"{name}: max|Δlogprob| {(got - want).abs().max().item():.2e}")
    assert torch.allclose(got, want, atol=LOGPROB_TOL)
    assert [[t for t, _ in lp.top] for lp in scored] == expected.topk(2, dim=-1).indices.tolist()


def test_a_still_video_encodes_one_grid_and_serves_it_at_every_grid(model_dir, config, tokenizer, hf_model):
    # equal pixels in every grid: equal content hashes at different offsets in one request. The tower runs once;
    # every grid's tokens take its rows, and the prefix cache keys them apart by offset
    t, h, w = VIDEO
    rows = random_rows(config, (1, h, w), seed=5)
    prompt = build_prompt(config, tokenizer, [9, Part(VIDEO_KIND, VIDEO, rows.repeat(t, 1)), 4], seed=8)
    request = engine_request(hf_model, config, prompt, "still")
    assert len({im.content_hash for im in request.images}) == 1
    engine = make_engine(model_dir, 7)
    scored = engine_prompt_logprobs(engine, request)
    assert engine.stats().num_images_encoded == 1
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([prompt.ids]), mm_token_type_ids=token_types(config, prompt.ids),
                          **prompt.hf_inputs(config.family)).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)
    want = expected[torch.arange(len(prompt.ids) - 1), torch.tensor(prompt.ids[1:])]
    assert torch.allclose(torch.tensor([lp.logprob for lp in scored]), want, atol=LOGPROB_TOL)
    assert run(make_engine(model_dir, 13), [replace(request, request_id="again")])["again"] == reference_ids(
        hf_model, config, prompt)
