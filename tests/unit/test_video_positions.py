"""Video prompts: each family's M-RoPE positions and mrope delta equal transformers 5.24's ``get_rope_index`` on the
same ids, and Qwen3-VL's ``video_prompt_tokens`` equal tokenizing the text Qwen3VLProcessor writes for the video.

A wrong time index shifts every video token's rotary phase (and a wrong delta every generated token's), which the
model sees as a different clip; a wrong timestamp token changes what the model reads as the frame's time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from firsttoken.inputs.video import VideoPlan
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.family import ModelFamily
from firsttoken.models.registry import families, family_named

TEXT_ID = 100  # any non-special token
TIMESTAMP_IDS = (40, 41, 42)  # stands in for "<t seconds>" where only positions are checked


@dataclass(frozen=True)
class Oracle:
    family: ModelFamily
    config: ModelConfig  # ours, parsed from the transformers config
    hf_config: object
    rope_model: torch.nn.Module  # transformers' inner model (meta weights): holds get_rope_index


def oracle(name: str, tokens_per_second: float | None = None) -> Oracle:
    family = family_named(name)
    recipe = family.checkpoint
    hf_config = recipe.hf_config(recipe.sizes["tiny"])
    if tokens_per_second is not None:
        hf_config.vision_config.tokens_per_second = tokens_per_second
    config = family.parse_config(hf_config.to_dict(), None)
    with torch.device("meta"):
        model = recipe.hf_model_class()(hf_config)
    return Oracle(family, config, hf_config, model.model)


@pytest.fixture(scope="module", params=[f.name for f in families() if f.video])
def any_family(request: pytest.FixtureRequest) -> Oracle:
    return oracle(request.param)


Part = tuple[str, object]  # ("text", n) | ("image", (t, h, w)) | ("video", (t, h, w))


def prompt_ids(o: Oracle, parts: list[Part]) -> tuple[list[int], list, list]:
    """Token ids as the family's processor lays them out: vision_start + pads + vision_end per image or video, and
    for Qwen3-VL per video grid a timestamp, vision_start, that grid's pads, vision_end (inside the template's pair)."""
    c = o.config
    merge = c.vision.spatial_merge_size
    ids: list[int] = []
    images, videos = [], []
    for kind, arg in parts:
        if kind == "text":
            ids += [TEXT_ID] * int(arg)
            continue
        t, h, w = arg
        (images if kind == "image" else videos).append(arg)
        if kind == "video":
            body = o.family.video_prompt_tokens(arg, [0.5] * t, c, lambda s: list(TIMESTAMP_IDS))
        else:
            body = [c.image_token_id] * (t * h * w // merge**2)
        ids += [c.vision_start_token_id, *body, c.vision_end_token_id]
    return ids, images, videos


def hf_rope_index(o: Oracle, ids: list[int], images: list, videos: list,
                  second_per_grid_ts: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    input_ids = torch.tensor([ids])
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == o.config.image_token_id] = 1
    types[input_ids == o.config.video_token_id] = 2
    kwargs = {"second_per_grid_ts": second_per_grid_ts} if second_per_grid_ts is not None else {}
    positions, delta = o.rope_model.get_rope_index(
        input_ids,
        types,
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
        attention_mask=torch.ones_like(input_ids),
        **kwargs,
    )
    return positions[:, 0], int(delta)


def assert_positions_match(o: Oracle, parts: list[Part], second_per_grid_ts: list[float] = ()) -> None:
    ids, images, videos = prompt_ids(o, parts)
    seconds = torch.tensor(second_per_grid_ts) if second_per_grid_ts else None  # float32, as the processor's
    want, want_delta = hf_rope_index(o, ids, images, videos, seconds)
    got = o.family.positions(ids, images, o.config, videos, list(second_per_grid_ts))
    assert torch.equal(got.positions, want)
    assert got.delta == want_delta


MIXED_PROMPTS: dict[str, list[Part]] = {
    "text+video": [("text", 5), ("video", (2, 4, 6)), ("text", 3)],
    "video+image": [("text", 2), ("video", (3, 6, 4)), ("text", 4), ("image", (1, 4, 8)), ("text", 2)],
    "image+video": [("image", (1, 6, 6)), ("text", 3), ("video", (4, 2, 8)), ("text", 1)],
    "two videos": [("text", 1), ("video", (2, 8, 2)), ("text", 2), ("video", (1, 4, 4)), ("text", 3)],
    "video+image+video": [("video", (1, 2, 2)), ("image", (1, 2, 4)), ("video", (5, 4, 2)), ("text", 2)],
    "video only": [("video", (3, 4, 4))],
}


@pytest.mark.parametrize("prompt", MIXED_PROMPTS.values(), ids=MIXED_PROMPTS.keys())
def test_positions_match_get_rope_index(any_family: Oracle, prompt: list[Part]) -> None:
    assert_positions_match(any_family, prompt)


def test_images_only_positions_unchanged_by_the_video_arguments(any_family: Oracle) -> None:
    parts: list[Part] = [("text", 3), ("image", (1, 4, 6)), ("text", 2), ("image", (1, 8, 2))]
    ids, images, _ = prompt_ids(any_family, parts)
    bare = any_family.family.positions(ids, images, any_family.config)
    want, want_delta = hf_rope_index(any_family, ids, images, [])
    assert torch.equal(bare.positions, want) and bare.delta == want_delta


@pytest.mark.parametrize("tokens_per_second", [2, 3, 25])
@pytest.mark.parametrize("seconds", [[2 / 1.5], [2 / 3.0, 2 / 2.9], [2 / 0.5, 2 / 29.97]], ids=str)
def test_qwen2_5_vl_fractional_seconds_per_grid(tokens_per_second: int, seconds: list[float]) -> None:
    """64 temporal grids: float32 truncation of ``g * tokens_per_second * second_per_grid_t`` differs from exact
    arithmetic (tokens_per_second 3) and from a float64 step (25) at some g; ours must agree with transformers."""
    o = oracle("qwen2.5-vl", tokens_per_second)
    assert o.config.vision.tokens_per_second == tokens_per_second
    parts: list[Part] = [("text", 2)]
    for _ in seconds:
        parts += [("video", (64, 2, 2)), ("text", 1)]
    parts.insert(2, ("image", (1, 2, 2)))
    assert_positions_match(o, parts, seconds)


def test_qwen2_5_vl_tokens_per_second_is_parsed_from_both_layouts() -> None:
    family = family_named("qwen2.5-vl")
    recipe = family.checkpoint
    shape = recipe.sizes["tiny"]
    hf_config = recipe.hf_config(shape)
    for d in (hf_config.to_dict(), recipe.original_config(hf_config, shape)):
        assert family.parse_config(d, None).vision.tokens_per_second == 2


def test_qwen2_vl_ignores_seconds_per_grid() -> None:
    o = oracle("qwen2-vl")
    assert_positions_match(o, [("text", 2), ("video", (3, 4, 4)), ("text", 1)], [2 / 1.5])


def test_qwen3_vl_takes_per_grid_video_entries_as_the_split_it_makes() -> None:
    o = oracle("qwen3-vl")
    ids, images, videos = prompt_ids(o, MIXED_PROMPTS["video+image+video"])
    whole = o.family.positions(ids, images, o.config, videos)
    per_grid = [(1, h, w) for t, h, w in videos for _ in range(t)]
    split = o.family.positions(ids, images, o.config, per_grid)
    assert torch.equal(whole.positions, split.positions) and whole.delta == split.delta


def test_grids_and_pads_disagreeing_is_an_error(any_family: Oracle) -> None:
    ids, images, videos = prompt_ids(any_family, MIXED_PROMPTS["two videos"])
    positions = any_family.family.positions
    with pytest.raises(ValueError, match="video"):
        positions(ids, images, any_family.config, videos[:1])
    with pytest.raises(ValueError, match="video"):
        positions(ids, images, any_family.config, [*videos, (1, 2, 2)])
    with pytest.raises(ValueError, match="video"):
        positions(ids, images, any_family.config, [(videos[0][0] + 1, *videos[0][1:]), videos[1]])


def test_qwen2_video_prompt_tokens_are_one_run_of_pads() -> None:
    for name in ("qwen2-vl", "qwen2.5-vl"):
        o = oracle(name)
        tokens = o.family.video_prompt_tokens((3, 4, 6), [0.5, 1.5, 2.5], o.config, lambda s: [1, 2])
        assert tokens == [o.config.video_token_id] * (3 * 2 * 3)


# --- Qwen3-VL: the prompt text Qwen3VLProcessor writes, tokenized by make-model's tokenizer --------------------------


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from firsttoken.models.checkpoint import make_dummy_model

    recipe = family_named("qwen3-vl").checkpoint
    shape = recipe.sizes["tiny"]
    out = make_dummy_model(tmp_path_factory.mktemp("qwen3_vl_tok"), recipe.original_config(recipe.hf_config(shape), shape))
    return AutoTokenizer.from_pretrained(Path(out))


def processor_replacement(grid_thw: tuple[int, int, int], frame_indices: list[int], fps: float) -> str:
    """transformers' Qwen3VLProcessor.replace_video_token run on its own source rule (the real processor needs a
    video processor, hence torchvision): merge and temporal patch 2, the tokenizer's special-token strings."""
    from transformers import Qwen3VLProcessor

    host = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        video_token="<|video_pad|>",
    )
    host._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(host, *a)
    inputs = {
        "video_grid_thw": torch.tensor([grid_thw]),
        "video_metadata": [SimpleNamespace(fps=fps, frames_indices=list(frame_indices))],
    }
    return Qwen3VLProcessor.replace_video_token(host, inputs, 0)


def video_plan(grid_thw: tuple[int, int, int], frame_indices: list[int], fps: float) -> VideoPlan:
    t, h, w = grid_thw
    return VideoPlan(
        source_frames=max(frame_indices) + 1, source_fps=fps, frame_indices=tuple(frame_indices),
        original_size=(w * 16, h * 16), resized_size=(w * 16, h * 16), grid_thw=grid_thw, num_tokens=t * h * w // 4,
        budget_tokens=t * h * w // 4, min_pixels=0, max_pixels=h * w * 256, sample_fps=fps, temporal_patch_size=2,
    )


QWEN3_VIDEOS = {  # (grid_thw, sampled frame indices, source fps)
    "4 frames at 2 fps": ((2, 4, 6), [0, 1, 2, 3], 2.0),
    "odd frame count, 29.97 fps": ((3, 2, 4), [0, 30, 60, 90, 120], 29.97),
    "long clip, times past 100 s": ((4, 6, 2), [3000, 3100, 3200, 3300, 3400, 3500, 3600, 3700], 24.0),
    "one grid": ((1, 2, 2), [7, 8], 0.5),
}


def chat_text(tokenizer, parts: list[dict]) -> str:
    messages = [{"role": "user", "content": parts}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_qwen3_chat_template_wraps_the_video_pad(qwen3_tokenizer) -> None:
    """The template writes <|vision_start|><|video_pad|><|vision_end|>; the processor keeps that pair around its
    per-grid blocks, so the prompt nests vision_start / vision_end."""
    text = chat_text(qwen3_tokenizer, [{"type": "video"}, {"type": "text", "text": "what happens?"}])
    assert "<|vision_start|><|video_pad|><|vision_end|>" in text
    expanded = text.replace("<|video_pad|>", processor_replacement((2, 2, 2), [0, 1, 2, 3], 2.0))
    assert "<|vision_start|><0.2 seconds><|vision_start|>" in expanded
    assert expanded.count("<|vision_start|>") == 3 and expanded.count("<|vision_end|>") == 3


@pytest.mark.parametrize("video", QWEN3_VIDEOS.values(), ids=QWEN3_VIDEOS.keys())
def test_qwen3_video_prompt_tokens_equal_the_processors_text_tokenized(qwen3_tokenizer, video) -> None:
    grid, frames, fps = video
    o = oracle("qwen3-vl")
    tok = qwen3_tokenizer
    text = chat_text(tok, [{"type": "text", "text": "Clip:"}, {"type": "video"}, {"type": "image"},
                           {"type": "text", "text": "what happens?"}])
    want_ids = tok(text.replace("<|video_pad|>", processor_replacement(grid, frames, fps)),
                   add_special_tokens=False)["input_ids"]
    image = (1, 4, 2)
    want_ids = replace_pad(want_ids, o.config.image_token_id, [o.config.image_token_id] * 2)

    template_ids = tok(text, add_special_tokens=False)["input_ids"]
    timestamps = video_plan(grid, frames, fps).grid_timestamps()
    body = o.family.video_prompt_tokens(grid, timestamps, o.config, lambda s: tok.encode(s, add_special_tokens=False))
    got_ids = replace_pad(template_ids, o.config.video_token_id, body)
    got_ids = replace_pad(got_ids, o.config.image_token_id, [o.config.image_token_id] * 2)
    assert got_ids == want_ids

    want, want_delta = hf_rope_index(o, want_ids, [image], [grid])
    got = o.family.positions(got_ids, [image], o.config, [grid])
    assert torch.equal(got.positions, want) and got.delta == want_delta


def replace_pad(ids: list[int], pad: int, body: list[int]) -> list[int]:
    """``ids`` with its one ``pad`` token replaced by ``body``."""
    assert ids.count(pad) == 1
    k = ids.index(pad)
    return [*ids[:k], *body, *ids[k + 1 :]]


def test_qwen3_video_prompt_tokens_need_one_timestamp_per_grid() -> None:
    o = oracle("qwen3-vl")
    with pytest.raises(ValueError, match="timestamps"):
        o.family.video_prompt_tokens((3, 2, 2), [0.5, 1.5], o.config, lambda s: [1])


def test_per_timestamp_encoding_relies_on_special_tokens_around_it(qwen3_tokenizer) -> None:
    """Why the timestamps are encoded one by one: between special tokens the tokenizer splits text at them first,
    so "<|vision_start|>" + "<1.5 seconds>" + "<|vision_start|>" tokenizes as the three pieces do."""
    tok = qwen3_tokenizer
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for time_s in (0.0, 0.5, 9.9, 12.3, 100.0, 3599.9):
        stamp = f"<{time_s:.1f} seconds>"
        whole = enc(f"<|vision_end|>{stamp}<|vision_start|>")
        assert whole == [*enc("<|vision_end|>"), *enc(stamp), *enc("<|vision_start|>")]
