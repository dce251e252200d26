"""What image preprocessing costs the engine's steps when both share a core, with the preprocessing thread at
nice 0 vs 10 (per-thread nice, Linux).

One process pinned to one core (as a server on a busy or small machine): an "engine" thread runs steps of the
`small` checkpoint's language-model matmul shapes (one 512-token chunk through 8 layers' projections, 1 torch
thread) and times each, while a second thread decodes and preprocesses 1024² JPEGs (decode_image +
preprocess_image, as a request's images are) back to back. Configurations alternate round by round; each prints
the median and P90 step time and its ratio to the steps run alone.

These steps are GIL-free matmuls: here a lower priority for the preprocessing thread protects them (2.00x vs
1.14x the steps alone, docs/runs/preprocess-nice.json). The server's steps are not (Python scheduling and small
tensor ops hold the GIL): a niced preprocessing pool made text TTFT worse on the server (bench_slo, U 0.8, default
vs nice 0; docs/performance.md), so the server does not nice its threads.

    python benchmarks/bench_preprocess_nice.py --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info  # noqa: E402

from firsttoken.inputs.image import decode_image, preprocess_image  # noqa: E402
from firsttoken.models.model_config import ImageProcessorConfig  # noqa: E402

HIDDEN, INTER, LAYERS, CHUNK = 512, 1408, 8, 512  # the `small` checkpoint's language model, one prefill chunk


def jpeg_1024(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, 1024, dtype=np.float32)
    pixels = (ramp[None, :, None] * 0.5 + ramp[:, None, None] * 0.3 + rng.integers(0, 60, (1024, 1024, 3)))
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make_step():
    torch.manual_seed(0)
    x = torch.randn(CHUNK, HIDDEN)
    weights = [(torch.randn(HIDDEN, 3 * HIDDEN), torch.randn(HIDDEN, HIDDEN), torch.randn(HIDDEN, 2 * INTER),
                torch.randn(INTER, HIDDEN)) for _ in range(LAYERS)]

    def step() -> float:
        t = time.perf_counter()
        h = x
        for qkv, o, gate_up, down in weights:
            h = (h @ qkv)[:, :HIDDEN] @ o
            h = (h @ gate_up)[:, :INTER] @ down
        return time.perf_counter() - t

    return step


def run_config(step, nice: int | None, data: bytes, num_steps: int) -> list[float]:
    """Steps timed while the heavy pool preprocesses images back to back (nice None: no preprocessing)."""
    stop = threading.Event()
    worker = None
    if nice is not None:
        proc = ImageProcessorConfig()

        def preprocess_forever() -> None:
            if nice:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
            while not stop.is_set():
                preprocess_image(decode_image(data, 10**8), proc, 4 * 28 * 28, 1280 * 28 * 28)

        worker = threading.Thread(target=preprocess_forever, daemon=True)
        worker.start()
        time.sleep(0.3)
    try:
        return [step() for _ in range(num_steps)]
    finally:
        stop.set()
        if worker is not None:
            worker.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration per round")
    ap.add_argument("--cpu", type=int, default=0, help="the one core everything runs on")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    data, step = jpeg_1024(), make_step()
    step()
    configs = {"alone": None, "nice-0": 0, "nice-10": 10}
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, nice in configs.items():
            times[name] += run_config(step, nice, data, args.steps)
    out = {"machine": machine_info(), "args": vars(args), "step_s": times, "summary": {}}
    alone = statistics.median(times["alone"])
    print(f"machine: {out['machine']}")
    print(f"{'config':8s} {'n':>4s} {'median ms':>10s} {'P90 ms':>8s} {'vs alone':>9s}")
    for name, ts in times.items():
        ts = sorted(ts)
        med, p90 = statistics.median(ts), ts[int(0.9 * (len(ts) - 1))]
        out["summary"][name] = {"n": len(ts), "median_s": med, "p90_s": p90, "median_vs_alone": med / alone}
        print(f"{name:8s} {len(ts):4d} {med * 1e3:10.1f} {p90 * 1e3:8.1f} {med / alone:8.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
