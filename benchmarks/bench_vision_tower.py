"""Vision-tower time per family (our code, fp32), and what Qwen2.5-VL's window attention buys.

Usage: python benchmarks/bench_vision_tower.py [--families qwen2-vl,qwen2.5-vl] [--images 1024x1024,2048x1536]
                                               [--repeats 3] [--threads 2] [--json OUT]
Workload: one random image per size, resized by the checkpoint's own processor defaults (no visual-token budget:
1024x1024 -> 74 x 74 patches, 1,369 visual tokens; 2048x1536 -> 146 x 110 patches, 4,015 visual tokens at
14-px patches), through ``model.visual`` of each family's ``small`` random checkpoint (built once into
$FIRSTTOKEN_CACHE, default /tmp). A family whose tower has windows (Qwen2.5-VL) is also timed with the same
weights forced to full attention in every block (``window_size`` 0), and the ratio full / windowed is printed.
Every tower is also run as the engine runs it, unit by unit (``start_encode``, ``run_units`` one unit per call,
``finish_encode``: a large image's full-attention blocks in query-row slices, models/vision_units.py), and the
ratio by-units / whole (``model.visual`` over whole blocks) is printed: what slicing costs.
Every family with a make-model recipe is timed (qwen3-vl too, once registered). Prints the median of --repeats
runs (the variants of one image alternate, after one warm-up at the first size) and the CPU's vector flags;
the machine may be shared, so read the ratios, not the absolute seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from firsttoken.inputs.image import preprocess_image
from firsttoken.loading.loader import load_model
from firsttoken.models.checkpoint import make_model, recipes

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma")


@dataclass(frozen=True)
class Timing:
    family: str
    variant: str  # "tower" (as configured), "windowed", "full attention" (same weights, window_size 0); "... by units"
    image: str  # "WxH" before resizing
    grid_thw: tuple[int, int, int]
    visual_tokens: int
    runs_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.runs_s)


def cpu_flags() -> dict[str, object]:
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "processor": platform.processor() or platform.machine(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "flags": [f for f in CPU_FLAGS if f in flags],
        "os_cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],  # other processes competing for the cores when it started
    }


def small_checkpoint(family: str, cache: Path) -> Path:
    path = cache / f"bench-vision-{family}-small"
    meta = path / "firsttoken_checkpoint.json"
    if not meta.exists() or json.loads(meta.read_text()).get("family") != family:
        make_model(path, size="small", seed=0, family=family)
    return path


def random_image(size: str, seed: int = 0) -> Image.Image:
    width, height = (int(x) for x in size.split("x"))
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def by_units(tower: torch.nn.Module) -> Callable[[torch.Tensor, list], object]:
    """The tower as the engine's runner drives it: one encoder unit per call (one image)."""
    def run(pixels: torch.Tensor, grids: list) -> object:
        state = tower.start_encode(pixels, grids[0])
        while not state.done:
            tower.run_units(state, 1)
        return tower.finish_encode(state)
    return run


def towers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The tower as configured, plus (when it has windows) the same weights attending fully in every block."""
    visual = model.visual
    vision = visual.config
    if not vision.uses_windows:
        return {"tower": visual}
    full = type(visual)(replace(vision, window_size=0))
    full.load_state_dict(visual.state_dict())
    return {"windowed": visual, "full attention": full.eval()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    known = list(recipes())
    parser.add_argument("--families", default=",".join(known), help=f"comma-separated, of {known}")
    parser.add_argument("--images", default="1024x1024,2048x1536", help="WxH sizes before resizing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cache = Path(os.environ.get("FIRSTTOKEN_CACHE", "/tmp"))
    cpu = cpu_flags()
    print(f"cpu: {cpu['processor']}, torch {cpu['torch_cpu_capability']}, flags {' '.join(cpu['flags'])}; "
          f"{args.threads} threads; fp32; median of {args.repeats}; load average {cpu['load_average_1m']:.2f}")
    print(f"{'family':11} {'image':10} {'grid':>13} {'tokens':>6} {'variant':24} {'median_s':>9}")
    timings: list[Timing] = []
    for family in args.families.split(","):
        model = load_model(small_checkpoint(family, cache), torch.float32)
        proc = model.config.image_processor
        variants = towers(model)
        variants.update({f"{name} by units": by_units(tower) for name, tower in list(variants.items())})
        for i, size in enumerate(args.images.split(",")):
            image = preprocess_image(random_image(size), proc, proc.min_pixels, proc.max_pixels)
            pixels, grid = image.pixel_values, tuple(image.grid_thw)
            runs: dict[str, list[float]] = {name: [] for name in variants}
            with torch.inference_mode():
                if i == 0:
                    for tower in variants.values():
                        tower(pixels, [grid])  # warm-up
                for _ in range(args.repeats):
                    for name, tower in variants.items():
                        runs[name].append(timed(tower, pixels, [grid]))
            for name, times in runs.items():
                t = Timing(family, name, size, grid, image.num_tokens, tuple(times))
                timings.append(t)
                print(f"{family:11} {size:10} {grid!s:>13} {t.visual_tokens:6} {name:24} {t.median_s:9.3f}")
            if "windowed" in runs:
                ratio = statistics.median(runs["full attention"]) / statistics.median(runs["windowed"])
                print(f"{family:11} {size:10} full attention / windowed = {ratio:.2f}x")
            for name in [n for n in runs if not n.endswith(" by units")]:
                ratio = statistics.median(runs[f"{name} by units"]) / statistics.median(runs[name])
                print(f"{family:11} {size:10} {name} by units / whole = {ratio:.2f}x")
        del model, variants
    print(f"load average at the end {os.getloadavg()[0]:.2f} (a shared machine: compare ratios, not seconds)")
    if args.json:
        rows = [{**asdict(t), "median_s": t.median_s} for t in timings]
        cpu["load_average_1m_at_end"] = os.getloadavg()[0]
        out = {"cpu": cpu, "threads": args.threads, "repeats": args.repeats, "dtype": "float32", "results": rows}
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
