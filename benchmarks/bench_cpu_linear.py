"""The few-rows kernels (firsttoken/kernels/cpu_linear.py) against MKL on a decode step's products, rounds alternating.

Every linear layer of a checkpoint's language model plus its lm_head, each layer's own weight (so a pass streams
all of them from memory, as a decode step does), in the layouts the engine stores them (widening weights
input-major, the down projection row-major); x has 1-16 rows. Per row count: the median wall time of a pass, MKL
(``F.linear``, what the engine ran before) vs the kernels, and their ratio, at each thread count. A benchmark, not a
test.

    python benchmarks/bench_cpu_linear.py [--model DIR] [--rows 1,2,4,8,12,16] [--threads 1,2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import small_model  # noqa: E402
from machine import machine_info  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the small one benchmarks build)")
    ap.add_argument("--rows", default="1,2,4,8,12,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from firsttoken.kernels.cpu_linear import kernel_unavailable
    from firsttoken.loading.kernel_linear import FewRowsKernel
    from firsttoken.loading.loader import load_model

    reason = kernel_unavailable()
    if reason is not None:
        raise SystemExit(f"the kernels are not available here: {reason}")
    model = load_model(small_model(args.model), torch.float32, cpu_kernels="on")  # on: AVX-512 CPUs too
    layers = [m for name, m in model.named_modules() if isinstance(getattr(m, "method", None), FewRowsKernel)]
    if not isinstance(model.lm_head.method, FewRowsKernel):
        raise SystemExit("expected the kernels on the lm_head too")
    weight_mb = sum(m.weight.numel() * 4 for m in layers) / 2**20
    print(f"machine: {machine_info()}")
    print(f"{len(layers)} products per pass, {weight_mb:.0f} MiB of float32 weights")

    def one_pass(xs: dict[int, torch.Tensor], kernel: bool) -> float:
        t0 = time.perf_counter()
        for m in layers:
            x = xs[m.in_features]
            m(x) if kernel else F.linear(x, m.weight, m.bias)
        return time.perf_counter() - t0

    results: dict[str, dict[str, dict[str, float]]] = {}
    before = torch.get_num_threads()
    with torch.inference_mode():
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            results[str(threads)] = {}
            for rows in (int(r) for r in args.rows.split(",")):
                xs = {k: torch.randn(rows, k) for k in {m.in_features for m in layers}}
                one_pass(xs, True), one_pass(xs, False)  # warm-up
                mkl, kern = [], []
                for _ in range(args.rounds):
                    mkl.append(one_pass(xs, False))
                    kern.append(one_pass(xs, True))
                r = {"mkl_ms": statistics.median(mkl) * 1e3, "kernel_ms": statistics.median(kern) * 1e3,
                     "mkl_rounds_ms": [t * 1e3 for t in mkl], "kernel_rounds_ms": [t * 1e3 for t in kern]}
                r["ratio"] = r["kernel_ms"] / r["mkl_ms"]
                results[str(threads)][str(rows)] = r
                print(f"threads {threads} rows {rows:2d}: MKL {r['mkl_ms']:.2f} ms, kernels {r['kernel_ms']:.2f} ms, "
                      f"kernels / MKL {r['ratio']:.2f}x  (medians of {args.rounds})")
    torch.set_num_threads(before)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "args": vars(args),
                                               "weight_mib": weight_mb, "results": results}, indent=1))


if __name__ == "__main__":
    main()
