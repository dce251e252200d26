"""Prefill-to-first-token-logits: firsttoken's Qwen2-VL vs transformers' forward, same weights, one process.

Usage: python benchmarks/bench_model_prefill.py [--model DIR] [--image-size 1024] [--text-tokens 80]
                                                [--repeats 3] [--dtypes fp32,bf16] [--json OUT]
Workload: one prompt = text + one random image (1024x1024 -> 1,369 visual tokens at the processor defaults) +
text. Timed from pixel_values (preprocessing excluded, identical for both) to the last position's logits:
vision tower + LM prefill. Ours runs on the paged KV cache (block size 16) through the SDPA backend;
transformers runs ``Qwen2VLForConditionalGeneration.forward`` (sdpa attention, ``logits_to_keep=1``).
Prints the median of --repeats runs (alternating ours/theirs, after one warm-up) per dtype, and ours/transformers ratios.
Without --model it builds the "small" random checkpoint (LM 512x8 layers, vision 256x4 blocks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from firsttoken.attention.base import AttentionMetadata
from firsttoken.loading.loader import load_model
from firsttoken.models.interfaces import ImageRows
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.mrope import compute_mrope_positions
from firsttoken.models.registry import load_model_config
from firsttoken.runner.kv_cache import allocate_kv_caches

BLOCK_SIZE = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_small_checkpoint(out_dir: Path) -> Path:
    try:
        from firsttoken.models.checkpoint import make_model
    except ImportError:
        return _build_small_with_transformers(out_dir)
    return make_model(out_dir, size="small", seed=0)


def _build_small_with_transformers(out_dir: Path) -> Path:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=16384, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1_000_000.0},
        ),
        vision_config=dict(depth=4, embed_dim=256, num_heads=4, hidden_size=512, mlp_ratio=4),
        image_token_id=16380, video_token_id=16381, vision_start_token_id=16382, vision_end_token_id=16383,
    )
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(out_dir)
    return out_dir


def make_inputs(
    config: ModelConfig, image_size: int, text_tokens: int, max_pixels: int
) -> tuple[list[int], torch.Tensor, list]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
    out = Qwen2VLImageProcessorPil(max_pixels=max_pixels)(images=[image], return_tensors="pt")
    grid = tuple(int(x) for x in out["image_grid_thw"][0])
    num_image_tokens = grid[0] * grid[1] * grid[2] // config.vision.spatial_merge_size**2
    text = rng.integers(0, min(config.vocab_size, 1000), text_tokens).tolist()
    half = text_tokens // 2
    ids = (
        text[:half]
        + [config.vision_start_token_id]
        + [config.image_token_id] * num_image_tokens
        + [config.vision_end_token_id]
        + text[half:]
    )
    return ids, out["pixel_values"], [grid]


def ours_ttft(model, ids: list[int], pixel_values: torch.Tensor, grids: list) -> Callable[[], torch.Tensor]:
    config = model.config
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    kv_caches = allocate_kv_caches(config, num_blocks, BLOCK_SIZE, model.dtype, "cpu")
    input_ids = torch.tensor(ids)

    def run() -> torch.Tensor:
        with torch.inference_mode():
            # per request: positions + metadata (ints), vision tower, embeddings, prefill, last-token logits
            positions = compute_mrope_positions(ids, grids, config).positions
            meta = AttentionMetadata.build([len(ids)], [0], [list(range(num_blocks))], BLOCK_SIZE)
            image_embeds = model.visual(pixel_values, grids)
            start = ids.index(config.image_token_id)  # one image: its pads are contiguous
            hidden = model(input_ids, positions, kv_caches, meta, [ImageRows(start, image_embeds)])
            return model.compute_logits(hidden[-1:])

    return run


def transformers_ttft(ref, ids: list[int], pixel_values: torch.Tensor, grids: list, image_token_id: int):
    input_ids = torch.tensor([ids])
    grid_thw = torch.tensor(grids)
    mm_token_type_ids = (input_ids == image_token_id).long()

    def run() -> torch.Tensor:
        with torch.inference_mode():
            out = ref(
                input_ids=input_ids,
                pixel_values=pixel_values,
                image_grid_thw=grid_thw,
                mm_token_type_ids=mm_token_type_ids,
                use_cache=True,
                logits_to_keep=1,
            )
            return out.logits[0].float()

    return run


def median_pair_s(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of a and b, run alternately after one warm-up each, so load from other processes on a
    shared machine hits both sides alike."""
    a(), b()
    times_a, times_b = [], []
    for _ in range(repeats):
        for fn, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: build 'small')")
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--text-tokens", type=int, default=80)
    parser.add_argument("--max-pixels", type=int, default=16384 * 28 * 28, help="Qwen2-VL checkpoints' value")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import Qwen2VLForConditionalGeneration

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_small_checkpoint(Path(tmp))
        config = load_model_config(model_dir)
        ids, pixel_values, grids = make_inputs(config, args.image_size, args.text_tokens, args.max_pixels)
        num_image_tokens = sum(1 for t in ids if t == config.image_token_id)
        print(
            f"model {model_dir if args.model else 'small (random)'}: {args.image_size}x{args.image_size} image -> "
            f"{pixel_values.shape[0]} patches, {num_image_tokens} visual tokens; prompt {len(ids)} tokens; "
            f"threads {args.threads}; median of {args.repeats}"
        )
        print(f"{'dtype':6} {'ours_s':>8} {'transformers_s':>15} {'ours/transformers':>18} {'max|dlogit|':>12}")
        results = []
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            model = load_model(model_dir, dtype)
            ref = Qwen2VLForConditionalGeneration.from_pretrained(
                model_dir, dtype=dtype, attn_implementation="sdpa"
            ).eval()
            ours_fn = ours_ttft(model, ids, pixel_values, grids)
            ref_fn = transformers_ttft(ref, ids, pixel_values, grids, config.image_token_id)
            diff = (ours_fn() - ref_fn()).abs().max().item()
            ours_s, ref_s = median_pair_s(ours_fn, ref_fn, args.repeats)
            print(f"{name:6} {ours_s:8.3f} {ref_s:15.3f} {ours_s / ref_s:18.2f} {diff:12.2e}")
            results.append(
                dict(dtype=name, ours_s=ours_s, transformers_s=ref_s, ratio=ours_s / ref_s, max_abs_logit_diff=diff)
            )
            del model, ref
    if args.json:
        args.json.write_text(
            json.dumps(dict(prompt_tokens=len(ids), image_tokens=num_image_tokens, results=results), indent=2)
        )


if __name__ == "__main__":
    main()
