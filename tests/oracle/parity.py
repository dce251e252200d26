"""A test-only paged runner and the checks the oracle tests share: any family's model (paged KV cache, SDPA
backend) against its transformers class on the same weights.

``TinyRunner`` is just enough of a model runner: a shuffled free-block list (so a paging bug, a wrong slot or table
row, shows up as a logit mismatch), per-sequence block tables, one forward over any mix of (sequence, new tokens),
and each prompt's images through the whole vision tower at once (``ImageEmbeddings``: main rows and, for DeepStack
families, their features). Prompts are token ids plus transformers' own image processor output, so both sides see
identical inputs. ``make_prompt`` preprocesses with Qwen2-VL's processor defaults unless given the checkpoint's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from firsttoken.attention.base import AttentionMetadata
from firsttoken.loading.loader import load_model
from firsttoken.models.interfaces import ImageEmbeddings, ImageRows
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.mrope import (
    MRopePositions,
    decode_positions,
)
from firsttoken.models.registry import families, family_named
from firsttoken.runner.kv_cache import allocate_kv_caches

TOL = 1e-4  # max |Δlogit|, fp32
# a tiling family's test processor: prompts of a few tiles fit the paged runner's pool
TEST_MAX_PATCHES = 2
BLOCK_SIZE = 4
NUM_BLOCKS = 512
Grid = tuple[int, int, int]

torch.set_num_threads(2)

# the families a module's tests apply to, for modules that override conftest.py's ``family`` with one of these
VIDEO_FAMILIES = [f.name for f in families() if f.video]
# images at native resolution (a pixel ladder): their towers' full-attention blocks are sliced by query rows
NATIVE_RESOLUTION_FAMILIES = [f.name for f in families() if f.budget_ladder.unit == "pixels"]
# families whose budget buys tiles (InternVL)
TILED_FAMILIES = [f.name for f in families() if f.budget_ladder.unit == "tiles"]


@dataclass
class Prompt:
    ids: list[int]
    pixel_values: torch.Tensor | None  # [num_patches, C*T*P*P]
    grid_thw: list[tuple[int, int, int]]


def make_images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def preprocess(images: list[Image.Image], processor=None, config: ModelConfig | None = None
               ) -> tuple[torch.Tensor, list[Grid]]:
    """transformers' ``processor`` (default: Qwen2-VL's defaults) on ``images``: pixel values and per-image grids.
    A tiling processor (``config.image_processor.tiles``) gives tiles [N, C, S, S] and a tile count per image: its
    grid is (tiles, S / patch, S / patch)."""
    if processor is None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        processor = Qwen2VLImageProcessorPil()
    out = processor(images=images, return_tensors="pt")
    if "image_grid_thw" in out:
        return out["pixel_values"], [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
    assert config is not None and config.image_processor.tiles is not None, "a tiling processor needs the config"
    side = out["pixel_values"].shape[-1] // config.image_processor.patch_size
    return out["pixel_values"], [(int(n), side, side) for n in out["num_patches"].tolist()]


def tiled(config: ModelConfig) -> bool:
    """The family cuts images into tiles (its transformers class takes tiles alone, its positions are 1-D)."""
    return config.image_processor.tiles is not None


def image_kwargs(config: ModelConfig, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                 grids: list[Grid]) -> dict:
    """What transformers' forward and generate take beside ``input_ids`` (mm_token_type_ids even for text: see
    FACTS; a tiling family takes its tiles alone)."""
    if tiled(config):
        return {} if pixel_values is None else dict(pixel_values=pixel_values)
    kwargs = dict(mm_token_type_ids=(input_ids == config.image_token_id).long())
    if pixel_values is not None:
        kwargs.update(pixel_values=pixel_values, image_grid_thw=torch.tensor(grids))
    return kwargs


def image_pixel_rows(config: ModelConfig, grid: Grid) -> int:
    """Rows of the processor's pixel values one image of ``grid`` takes: its tiles, or its patches."""
    return grid[0] if tiled(config) else grid[0] * grid[1] * grid[2]


def reference_image_features(ref, config: ModelConfig, pixel_values: torch.Tensor, grids: list[Grid]):
    if tiled(config):
        return ref.model.get_image_features(pixel_values)
    return ref.model.get_image_features(pixel_values, torch.tensor(grids))


def make_prompt(config: ModelConfig, image_sizes: list[tuple[int, int]], seed: int = 0, processor=None) -> Prompt:
    """[text, (vision_start, image_pad * n, vision_end, text) per image]; ``image_sizes`` (width, height) in pixels,
    preprocessed by ``processor`` (see ``preprocess``)."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(0, 1990) for _ in range(n)]

    if not image_sizes:
        return Prompt(text(40), None, [])
    pixel_values, grids = preprocess(make_images(image_sizes, seed), processor, config)
    ids = text(9)
    for t, h, w in grids:
        n = t * h * w // config.vision.spatial_merge_size**2
        ids += [config.vision_start_token_id] + [config.image_token_id] * n + [config.vision_end_token_id] + text(6)
    return Prompt(ids, pixel_values, grids)


PROMPTS = {  # (width, height) in pixels at Qwen2-VL's 28 per visual token: the conftest checkpoints' prompts
    "text": [],
    "one_image": [(168, 112)],
    "three_images": [(252, 112), (112, 168), (56, 56)],  # wide, tall, smallest
}


def ref_logits(ref, config: ModelConfig, prompt: Prompt) -> torch.Tensor:
    """[prompt_len, vocab] from one full transformers forward (mm_token_type_ids passed: see FACTS)."""
    input_ids = torch.tensor([prompt.ids])
    kwargs = image_kwargs(config, input_ids, prompt.pixel_values, prompt.grid_thw) if prompt.pixel_values is not None else {}
    with torch.no_grad():
        return ref(input_ids=input_ids, **kwargs).logits[0].float()


# ---------------------------------------------------------------- a minimal paged runner (test-only)


@dataclass
class Seq:
    ids: list[int]  # prompt + generated so far
    prompt_len: int
    mrope: MRopePositions
    image_embeds: ImageEmbeddings | None  # [image-pad tokens in prompt, hidden] each, vision tower run once
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache


class TinyRunner:
    """Just enough of a model runner: a shuffled free-block list, per-sequence block tables, and one forward
    over any mix of (sequence, number of new tokens)."""

    def __init__(self, model: torch.nn.Module, seed: int = 0) -> None:
        self.model = model
        self.config = model.config
        self.kv_caches = allocate_kv_caches(self.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype, "cpu")
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)

    def add(self, prompt: Prompt) -> Seq:
        image_embeds = None
        if prompt.pixel_values is not None:
            with torch.no_grad():
                image_embeds = self.encode(prompt)
        mrope = family_named(self.config.family).positions(prompt.ids, prompt.grid_thw, self.config)
        return Seq(list(prompt.ids), len(prompt.ids), mrope, image_embeds)

    def encode(self, prompt: Prompt) -> ImageEmbeddings:
        """The prompt's images through the whole vision tower at once."""
        return self.model.visual(prompt.pixel_values, prompt.grid_thw)

    def step(self, work: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        """Run ``n`` new tokens of each listed sequence in one forward; per sequence its [n, vocab] logits."""
        ids, positions, images = [], [], []
        for seq, n in work:
            a, b = seq.num_computed, seq.num_computed + n
            while len(seq.blocks) * BLOCK_SIZE < b:
                seq.blocks.append(self.free.pop())
            in_prompt = min(b, seq.prompt_len)
            pos = [seq.mrope.positions[:, a:in_prompt]]
            if b > seq.prompt_len:
                start = max(a, seq.prompt_len)
                pos.append(decode_positions(start, b - start, seq.mrope.delta))
            positions.append(torch.cat(pos, dim=1))
            if seq.image_embeds is not None:
                images += image_rows(seq, a, in_prompt, sum(len(c) for c in ids), self.config.image_token_id)
            ids.append(torch.tensor(seq.ids[a:b]))
        meta = AttentionMetadata.build(
            [n for _, n in work], [s.num_computed for s, _ in work], [s.blocks for s, _ in work], BLOCK_SIZE
        )
        with torch.no_grad():
            hidden = self.model(torch.cat(ids), torch.cat(positions, dim=1), self.kv_caches, meta, images)
            logits = self.model.compute_logits(hidden)
        for seq, n in work:
            seq.num_computed += n
        return list(logits.split([n for _, n in work]))

    def prefill(self, seq: Seq, chunk: int) -> torch.Tensor:
        out = []
        while seq.num_computed < seq.prompt_len:
            out += self.step([(seq, min(chunk, seq.prompt_len - seq.num_computed))])
        return torch.cat(out)


def image_rows(seq: Seq, a: int, b: int, base: int, image_token_id: int) -> list[ImageRows]:
    """The image embedding rows for prompt tokens [a, b) of ``seq``, one entry per run of image-pad tokens, placed
    at packed-batch rows ``base + (i - a)``."""
    out: list[ImageRows] = []
    before = seq.ids[:a].count(image_token_id)  # pad tokens (= embedding rows) before the chunk
    i = a
    while i < b:
        if seq.ids[i] != image_token_id:
            i += 1
            continue
        j = i
        while j < b and seq.ids[j] == image_token_id:
            j += 1
        out.append(ImageRows(base + i - a, seq.image_embeds.rows(before, before + j - i)))
        before += j - i
        i = j
    return out


def tower_outputs(features) -> list[torch.Tensor]:
    """transformers' vision-tower output (``get_image_features`` / ``get_video_features``) as [merged tokens, *each
    DeepStack feature], each over every image back to back: transformers 5.24 splits each DeepStack feature per
    image, 5.17 (the GPU machine's) gives it whole."""
    def whole(x) -> torch.Tensor:  # (a tiling family's is per tile: [tiles, tokens, hidden])
        x = x if isinstance(x, torch.Tensor) else torch.cat(x)
        return x.reshape(-1, x.shape[-1])

    return [whole(features.pooler_output), *(whole(d) for d in getattr(features, "deepstack_features", None) or ())]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- checks the oracle tests share


def check_mrope_positions(ref, config: ModelConfig, prompt: Prompt) -> None:
    """Our M-RoPE positions and delta are transformers' ``get_rope_index`` (text only, and a tiling family's 1-D
    RoPE: 0..L-1, delta 0)."""
    got = family_named(config.family).positions(prompt.ids, prompt.grid_thw, config)
    input_ids = torch.tensor([prompt.ids])
    if prompt.grid_thw and not tiled(config):
        expected, delta = ref.model.get_rope_index(
            input_ids, (input_ids == config.image_token_id).long(), torch.tensor(prompt.grid_thw)
        )
        assert torch.equal(got.positions, expected[:, 0])
        assert got.delta == int(delta)
    else:  # text-only: transformers uses plain 0..L-1 with delta 0
        assert torch.equal(got.positions, torch.arange(len(prompt.ids)).expand(3, -1))
        assert got.delta == 0


def generate_ids(ref, config: ModelConfig, prompt: Prompt, num_new: int) -> list[int]:
    """transformers' greedy ``generate`` (no repetition penalty, whatever generation_config.json says)."""
    input_ids = torch.tensor([prompt.ids])
    kwargs = image_kwargs(config, input_ids, prompt.pixel_values, prompt.grid_thw)
    with torch.no_grad():
        out = ref.generate(input_ids, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                           repetition_penalty=1.0, **kwargs)
    return out[0, len(prompt.ids) :].tolist()


def greedy_ids(model: torch.nn.Module, prompt: Prompt, num_new: int) -> list[int]:
    """Ours: prefill in chunks of 16 on the paged cache, then one token per step, argmax."""
    runner = TinyRunner(model, seed=5)
    seq = runner.add(prompt)
    logits = runner.prefill(seq, chunk=16)[-1]
    got = []
    for _ in range(num_new):
        token = int(logits.argmax())
        got.append(token)
        seq.ids.append(token)
        (logits,) = runner.step([(seq, 1)])
        logits = logits[-1]
    return got


def check_bf16_tracks_fp32(ref, model_dir: Path, image_sizes: list[tuple[int, int]], processor=None) -> None:
    """bf16 is the fast path: same greedy choice at nearly every prompt position (not bit-parity)."""
    model = load_model(model_dir, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    prompt = make_prompt(model.config, image_sizes, seed=6, processor=processor)
    runner = TinyRunner(model)
    got = runner.prefill(runner.add(prompt), chunk=32)
    expected = ref_logits(ref, model.config, prompt)
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(f"bf16: top-1 agreement {agree:.3f}, max|Δlogit| {max_diff(got, expected):.3f}")
    assert agree >= 0.9


@dataclass(frozen=True)
class MixedBatch:
    batched: list[torch.Tensor]  # per sequence its logits from one forward carrying all four
    alone: list[torch.Tensor]  # the same work, one sequence per forward
    seen: list[Prompt]  # what each sequence's logits are the last rows of (prompt + generated token)


def mixed_batch(model: torch.nn.Module, prompts: list[Prompt], first_chunk: int) -> MixedBatch:
    """One forward carrying prompt 0 whole, prompt 1 from ``first_chunk`` (inside an image) to its end, and one
    decode token each for prompts 2 and 3 (fully prefilled first); and the same work one sequence at a time."""
    assert prompts[1].ids[first_chunk] == model.config.image_token_id

    def setup(runner: TinyRunner) -> list[Seq]:
        seqs = [runner.add(p) for p in prompts]
        runner.step([(seqs[1], first_chunk)])
        for s in seqs[2:]:  # fully prefilled, then one generated token each
            runner.prefill(s, chunk=len(s.ids))
            s.ids.append(7)
        return seqs

    def work(seqs: list[Seq]) -> list[tuple[Seq, int]]:
        return [(seqs[0], len(prompts[0].ids)), (seqs[1], len(prompts[1].ids) - first_chunk), (seqs[2], 1),
                (seqs[3], 1)]

    batched_runner = TinyRunner(model, seed=21)
    batched = batched_runner.step(work(setup(batched_runner)))
    alone_runner = TinyRunner(model, seed=22)
    alone = [alone_runner.step([w])[0] for w in work(setup(alone_runner))]
    seen = [Prompt(p.ids + ([7] if i >= 2 else []), p.pixel_values, p.grid_thw) for i, p in enumerate(prompts)]
    return MixedBatch(batched, alone, seen)


def checkpoint_processor(model_dir: Path, config: ModelConfig):
    """transformers' image processor as the checkpoint configures it, its floor lowered to 2 x 2 visual tokens so
    small test images are not scaled up (Qwen3-VL's releases floor at 256 x 256 px)."""
    from transformers import AutoImageProcessor

    if tiled(config):  # its PIL backend, cropping as InternVLProcessor asks, at most 2 tiles and the thumbnail
        return AutoImageProcessor.from_pretrained(model_dir, backend="pil", crop_to_patches=True,
                                                  max_patches=TEST_MAX_PATCHES)
    side_px = 2 * config.image_processor.pixels_per_token
    size = {"shortest_edge": side_px * side_px, "longest_edge": config.image_processor.max_pixels}
    return AutoImageProcessor.from_pretrained(model_dir, size=size)


def in_pixels(config: ModelConfig, image_tokens: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(width, height) in visual tokens -> in pixels at the family's pixels per visual token."""
    side_px = config.image_processor.pixels_per_token
    return [(w * side_px, h * side_px) for w, h in image_tokens]
