"""InternVL3.5's first token, unloaded: firsttoken's offline `LLM` (the server's engine and input processor, one
request at a time) against transformers on the same weights, and TTFT against the tile count.

Part 1, text / one / three 1024x1024 photos at the family's own default budget (12 tiles: each photo 3x3 + 1):
firsttoken's `LLM.chat(max_tokens=1)` (decode, tiling, tokens, the engine's steps) against transformers' naive path
for the same prompt (GotOcr2ImageProcessorPil cropping to patches, then `generate(max_new_tokens=1)`), alternating
side by side, median of --repeats each; ratio = transformers / firsttoken.
Part 2, one image of 1, 3, 5, 7, 10, 13 tiles (448x448, 896x448, 896x896, 1344x896, 1344x1344, 1792x1344 at
max_patches 12): firsttoken's TTFT per tile count, the cost per tile (least-squares slope), and where the seed's cut
lands: serve's default budget (1280 tokens: 2x2 + 1 for a square photo) against the family's default (3x3 + 1).

    python benchmarks/bench_internvl_ttft.py [--model DIR] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

FAMILY_DEFAULT = 13 * 256
TILE_SIZES = {1: (448, 448), 3: (896, 448), 5: (896, 896), 7: (1344, 896), 10: (1344, 1344), 13: (1792, 1344)}
QUESTION = "Describe the picture in one sentence."


def photo(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8)
    return Image.fromarray(base).resize((width, height), Image.Resampling.BILINEAR)


def messages(images: list[Image.Image]) -> list[dict]:
    import base64
    import io

    parts = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, "PNG")
        parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                         + base64.b64encode(buf.getvalue()).decode()}})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


def png(image: Image.Image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def ours_s(llm, images: list[Image.Image]) -> float:
    """The request as a client sends it (PNG data URLs, built before the clock starts)."""
    request = messages(images)
    start = time.perf_counter()
    result = llm.chat(request, {"max_tokens": 1, "temperature": 0.0})
    assert result.finish_reason == "length", result.error
    return time.perf_counter() - start


class Naive:
    """transformers as a user would run it: the processor, the prompt's ids, generate one token."""

    def __init__(self, model_dir: Path, llm) -> None:
        from transformers import AutoImageProcessor, InternVLForConditionalGeneration

        self.model = InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil", crop_to_patches=True,
                                                            max_patches=12)
        self.llm = llm

    def ids(self, images: list[Image.Image], num_tiles: list[int]) -> list[int]:
        """The chat template's ids with each image's pad expanded to its tiles' tokens (as the processor does)."""
        config = self.llm.engine.model_config
        rendered = self.llm.tokenizer.encode(self.llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": QUESTION}]}],
            add_generation_prompt=True, tokenize=False))
        out, tiles = [], iter(num_tiles)
        for token in rendered:
            out += [token] * (256 * next(tiles)) if token == config.image_token_id else [token]
        return out

    def seconds(self, images: list[Image.Image]) -> float:
        """From the PNG bytes, as a naive server receives them."""
        import io

        blobs = [png(im) for im in images]
        start = time.perf_counter()
        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in blobs]
        kwargs = {}
        num_tiles: list[int] = []
        if images:
            pixels = self.processor(images=images, return_tensors="pt")
            kwargs["pixel_values"] = pixels["pixel_values"]
            num_tiles = [int(n) for n in pixels["num_patches"]]
        input_ids = torch.tensor([self.ids(images, num_tiles)])
        with torch.inference_mode():
            self.model.generate(input_ids=input_ids, max_new_tokens=1, do_sample=False, **kwargs)
        return time.perf_counter() - start


def median_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an InternVL3.5 checkpoint (default: make-model small)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    from firsttoken import LLM
    from firsttoken.models.checkpoint import make_model

    model_dir = Path(args.model) if args.model else make_model(tempfile.mkdtemp(), size="small",
                                                               family="internvl3.5")
    llm = LLM(model_dir, dtype="float32", image_max_tokens=FAMILY_DEFAULT, no_prefix_cache=True,
              no_encoder_cache=True)
    naive = Naive(model_dir, llm)
    # new photos every time: neither side's caches (firsttoken's processed-image cache) see one twice
    cases = {"text": 0, "1img": 1, "3img": 3}
    for count in cases.values():  # warm-up, both sides
        images = [photo(1024, 1024, 1000 + i) for i in range(count)]
        ours_s(llm, images), naive.seconds(images)
    part1: dict[str, dict] = {}
    for name, count in cases.items():
        ours, theirs = [], []
        for r in range(args.repeats):  # alternating, side by side, the same photos on both sides
            images = [photo(1024, 1024, 100 * r + i) for i in range(count)]
            ours.append(ours_s(llm, images))
            theirs.append(naive.seconds(images))
        part1[name] = {"firsttoken_ms": median_ms(ours), "transformers_ms": median_ms(theirs),
                       "ratio": round(statistics.median(theirs) / statistics.median(ours), 2), "n": args.repeats,
                       "firsttoken_all_ms": [round(1000 * v, 1) for v in ours],
                       "transformers_all_ms": [round(1000 * v, 1) for v in theirs]}
        print(f"{name:5s} firsttoken {part1[name]['firsttoken_ms']:8.1f} ms  transformers "
              f"{part1[name]['transformers_ms']:8.1f} ms  x{part1[name]['ratio']} (n={args.repeats} each)")
    part2: dict[int, float] = {}
    for tiles, (w, h) in TILE_SIZES.items():
        ours_s(llm, [photo(w, h, 5000 + tiles)])
        part2[tiles] = median_ms([ours_s(llm, [photo(w, h, 6000 + 100 * r + tiles)]) for r in range(args.repeats)])
        print(f"{tiles:2d} tiles ({w}x{h}): {part2[tiles]:8.1f} ms")
    x, y = np.array(list(part2), dtype=float), np.array(list(part2.values()))
    slope, intercept = np.polyfit(x, y, 1)
    cut = round(part2[10] / part2[5], 2)
    print(f"cost per tile {slope:.1f} ms (+ {intercept:.1f} ms); a square photo at serve's 1280 (5 tiles) "
          f"{part2[5]:.1f} ms vs the family default (10 tiles) {part2[10]:.1f} ms: x{cut}")
    out = {"machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
           "model": str(model_dir), "dtype": "float32", "repeats": args.repeats,
           "unloaded_ttft": part1, "ttft_by_tiles_ms": part2,
           "cost_per_tile_ms": round(float(slope), 1), "intercept_ms": round(float(intercept), 1),
           "default_vs_1280_ratio": cut}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
