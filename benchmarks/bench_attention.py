"""The fused decode step's attention loops side by side: one row's query heads of one KV head over its cached keys
and values (``ft_attend`` in firsttoken/kernels/cpu_linear.c), the AVX2 loop vs the AVX-512 one, calls alternating,
at several context lengths. The cache is small enough to stay in L2/L3 here (in a real step it streams from memory
after the weights): this measures the loops' arithmetic, not the step.

    python benchmarks/bench_attention.py --lengths 30,70,500,4000 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import machine_info  # noqa: E402


def main() -> None:
    from firsttoken.kernels import cpu_linear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="30,70,500,4000", help="cached tokens (keys) per call")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--heads-per-kv", type=int, default=4, help="query heads sharing the KV head")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kernel, reason = cpu_linear._kernel()
    if kernel is None:
        sys.exit(f"the kernels are not available here: {reason}")
    if not kernel.attention_avx512:
        sys.exit("this CPU has no AVX-512 (F/BW/VL/DQ): only the AVX2 loop runs here")
    fn = kernel.lib.ft_attend
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int]
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    d, g, nkv = args.head_dim, args.heads_per_kv, 2
    lengths = [int(x) for x in args.lengths.split(",")]
    slots = max(lengths)
    keys = torch.randn(slots, nkv, d).to(dtype)
    values = torch.randn(slots, nkv, d).to(dtype)
    q = torch.randn(g, d).to(dtype).float()
    out = torch.empty(g, d)
    machine = machine_info()
    print(f"CPU {machine['cpu']}, flags {' '.join(machine['cpu_flags'])}; {args.dtype} cache, head_dim {d}, {g} "
          f"query heads per KV head; one thread; medians of {args.rounds} rounds, alternating")
    results = {}
    for n in lengths:
        at = (torch.arange(n) * nkv * d).contiguous()
        times: dict[str, list[float]] = {"avx2": [], "avx512": []}
        reps = max(20, 20000 // n)
        for _ in range(args.rounds):
            for wide, name in ((0, "avx2"), (1, "avx512")):
                start = time.perf_counter()
                for _ in range(reps):
                    rc = fn(q.data_ptr(), g, keys.data_ptr(), values.data_ptr(), at.data_ptr(), n, 1, d, d ** -0.5,
                            out.data_ptr(), int(dtype == torch.bfloat16), wide)
                times[name].append((time.perf_counter() - start) / reps)
                assert rc == 0
        a, b = statistics.median(times["avx2"]), statistics.median(times["avx512"])
        results[n] = {"avx2_us": times["avx2"], "avx512_us": times["avx512"], "ratio": b / a}
        print(f"{n:6d} keys: AVX2 {a * 1e6:8.1f} us  AVX-512 {b * 1e6:8.1f} us  AVX-512/AVX2 {b / a:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "machine": machine, "results": results}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
