"""firsttoken's preprocess_image vs transformers' Qwen2VLImageProcessorPil, side by side in one process.

Usage: python benchmarks/bench_image_preprocess.py [--repeats 15] [--seed 0] [--max-pixels 12845056]
Prints, per image size, the median seconds of each and the speedup, after checking the outputs are identical,
plus the PIL bicubic resize alone: both pipelines must run it (bit-exactness), so it is the floor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from firsttoken.inputs.image import preprocess_image, smart_resize
from firsttoken.models.model_config import ImageProcessorConfig

SIZES = [(448, 448), (1024, 1024), (2048, 1536)]  # (width, height)
VISION = ImageProcessorConfig()  # Qwen2-VL: 14-px patches, 2x2 merge, CLIP mean and std


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-pixels", type=int, default=56 * 56)
    parser.add_argument("--max-pixels", type=int, default=16384 * 28 * 28)  # Qwen2-VL checkpoints' value
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    reference = Qwen2VLImageProcessorPil(min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    print(f"min_pixels={args.min_pixels} max_pixels={args.max_pixels} repeats={args.repeats} seed={args.seed}")
    print(f"{'image':>10} {'tokens':>7} {'reference_s':>12} {'firsttoken_s':>13} {'speedup':>8} {'resize_floor_s':>15}")
    for width, height in SIZES:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        ours = preprocess_image(image, VISION, args.min_pixels, args.max_pixels)
        expected = np.asarray(reference(image)["pixel_values"])
        if not np.array_equal(ours.pixel_values.numpy(), expected):
            raise SystemExit(f"outputs differ for {width}x{height}")
        ref_s = median_s(lambda: reference(image), args.repeats)
        our_s = median_s(lambda: preprocess_image(image, VISION, args.min_pixels, args.max_pixels), args.repeats)
        resized_h, resized_w = smart_resize(height, width, 28, args.min_pixels, args.max_pixels)
        resize_s = median_s(lambda: image.resize((resized_w, resized_h), Image.Resampling.BICUBIC), args.repeats)
        print(
            f"{width:>5}x{height:<4} {ours.num_tokens:>7} {ref_s:>12.4f} {our_s:>13.4f} {ref_s / our_s:>7.1f}x"
            f" {resize_s:>15.4f}"
        )


if __name__ == "__main__":
    main()
