"""Issue 39's Triton attention kernels on a CUDA device: correctness at realistic shapes (fp32 and bf16) and time
against torch SDPA, one JSON file.

    PYTHONPATH=. python benchmarks/gpu/kernels_check.py --out RESULTS/kernels.json [--dtype bf16 --dtype fp32]
                                                          [--repeats 20] [--quick]

On a machine without CUDA it prints one line and exits 2 (nothing measured). ``--interpret-smoke`` instead runs
tiny shapes on the CPU under Triton's interpreter to check this script's own plumbing (its times mean nothing);
it sets TRITON_INTERPRET=1 itself, before triton's import.

Cases (block size 16, the shapes of the models firsttoken serves):
- prefill (paged, causal within the chunk, GQA): Qwen2-VL-7B's language model (28 query heads, 4 KV heads, ratio
  7, head_dim 128) and Qwen3-VL-8B's (32 / 8, ratio 4): one 2048-token first chunk; a 512-token chunk after a
  3,001-token prefix (ending mid-block); 8 sequences of mixed chunks and prefixes (a chunk of 1 among them);
- decode (split-K + reduce): batch 1 over 4,096 and 32,768 keys, batch 16 over 2,048, batch 64 over 200..1,200;
- vision (block-diagonal, non-causal, 16 heads, head_dim 80): one 1024x1024 image (74 x 74 = 5,476 patches) whole,
  three such images, and the image in Qwen2.5-VL windows (8 x 8 patches: segments of 64, smaller at the edges).

Correctness: each output against float64 torch math on the same (dtype-rounded) inputs; max abs error, and
whether it is within the tolerance (fp32 1e-5 for the kernels' IEEE dots; bf16 2e-2). The SDPA backend's own
error is recorded beside ours. Times (CUDA events, median of --repeats after warm-up; first-call compile time
recorded apart): our kernel; firsttoken's SDPA backend on the device (what ``--attention-backend sdpa`` does:
gather through the block table, then SDPA); torch SDPA on contiguous, already gathered K/V (its flash /
efficient kernels, causal aligned bottom-right; a lower bound that a paged cache cannot reach without a gather).
TFLOP/s counts 4 x (query, key) pairs x head_dim per head (causal: only the keys a query sees).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

LANGUAGE_SHAPES = {  # name: (query heads, KV heads, head_dim)
    "qwen2-vl-7b": (28, 4, 128),
    "qwen3-vl-8b": (32, 8, 128),
}
VISION_SHAPE = (16, 80)  # Qwen2-VL / Qwen2.5-VL tower: heads, head_dim
BLOCK_SIZE = 16
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--dtype", action="append", choices=["bf16", "fp32"], help="default: bf16 and fp32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="one model shape, fewer cases")
    parser.add_argument("--interpret-smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1: checks this script, measures nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
    import torch

    if not args.interpret_smoke and not torch.cuda.is_available():
        print(f"kernels_check: no CUDA device (torch {torch.__version__}); nothing measured", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's firsttoken
    check = Check(args, torch)
    results = check.run()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    failed = [c["name"] for c in results["cases"] if not c["ok"]]
    print(f"kernels_check: {len(results['cases'])} cases, {len(failed)} outside tolerance"
          f"{': ' + ', '.join(failed) if failed else ''}; wrote {out}")
    return 1 if failed else 0


class Check:
    def __init__(self, args: argparse.Namespace, torch) -> None:
        import triton

        from firsttoken.attention import triton_kernels as tk
        from firsttoken.attention.base import AttentionMetadata
        from firsttoken.attention.sdpa import SdpaBackend, write_kv

        self.args, self.torch, self.triton, self.tk = args, torch, triton, tk
        self.AttentionMetadata, self.sdpa, self.write_kv = AttentionMetadata, SdpaBackend(), write_kv
        self.device = "cpu" if args.interpret_smoke else "cuda"
        self.smoke = args.interpret_smoke
        self.repeats = 1 if self.smoke else args.repeats
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        self.language_shapes = dict(LANGUAGE_SHAPES)
        self.vision_shape = VISION_SHAPE

    # ------------------------------------------------------------------------------------------------ plumbing

    def dtype(self, name: str):
        return {"fp32": self.torch.float32, "bf16": self.torch.bfloat16}[name]

    def randn(self, *shape, dtype):
        return self.torch.randn(*shape, generator=self.gen).to(self.device, dtype)

    def timed(self, fn) -> dict[str, float]:
        """First call (compile included) and the median of --repeats calls after two warm-ups, in ms."""
        torch = self.torch
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        fn()
        sync()
        first = (time.perf_counter() - start) * 1e3
        if self.smoke:
            return {"first_ms": first, "median_ms": first}
        fn()
        fn()
        times = []
        for _ in range(self.repeats):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        return {"first_ms": first, "median_ms": statistics.median(times)}

    def reference(self, q, k, v, causal_offset: int | None):
        """float64 attention of one sequence: q [Lq, H, D], k/v [Lk, KVH, D]; causal_offset: query t sees keys
        0 .. causal_offset + t (None: all keys). Heads in groups to bound the scores' memory."""
        torch = self.torch
        rep = q.shape[1] // k.shape[1]
        out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
        mask = None
        if causal_offset is not None:
            rows = torch.arange(q.shape[0], device=q.device)[:, None] + causal_offset
            mask = torch.arange(k.shape[0], device=q.device)[None, :] > rows
        for kv_head in range(k.shape[1]):
            heads = slice(kv_head * rep, (kv_head + 1) * rep)
            scores = torch.einsum("qhd,kd->hqk", q[:, heads].double(), k[:, kv_head].double()) * self.scale
            if mask is not None:
                scores.masked_fill_(mask, float("-inf"))
            out[:, heads] = torch.einsum("hqk,kd->qhd", scores.softmax(-1), v[:, kv_head].double())
            del scores
        return out

    def record(self, name: str, kind: str, dtype: str, shape: dict, ours, expected, sdpa_out, times: dict,
               flops: float) -> dict:
        err = (ours.double() - expected).abs().max().item()
        sdpa_err = None if sdpa_out is None else (sdpa_out.double() - expected).abs().max().item()
        case = {"name": name, "kind": kind, "dtype": dtype, "shape": shape, "max_abs_err": err,
                "sdpa_backend_max_abs_err": sdpa_err, "tolerance": TOLERANCE[dtype],
                "ok": bool(err <= TOLERANCE[dtype]), "flops": flops, **times}
        ms = times.get("triton", {}).get("median_ms")
        case["triton_tflops"] = flops / ms / 1e9 if ms else None
        print(f"{'ok  ' if case['ok'] else 'FAIL'} {name:48s} err {err:.2e}  "
              + "  ".join(f"{k} {v['median_ms']:.3f} ms" for k, v in times.items()), flush=True)
        return case

    # -------------------------------------------------------------------------------------------------- cases

    def paged(self, query_lens, context_lens, heads, kv_heads, head_dim, dtype):
        """Sequences on shuffled blocks, their contexts cached; the new tokens' q/k/v, cache, metadata, and the
        whole sequences' q/k/v (for the reference and the dense SDPA baseline)."""
        torch = self.torch
        dt = self.dtype(dtype)
        total_blocks = sum(-(-(q + c) // BLOCK_SIZE) for q, c in zip(query_lens, context_lens))
        order = torch.randperm(total_blocks, generator=self.gen).tolist()
        cache = torch.zeros(2, total_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dt, device=self.device)
        tables, seqs, news = [], [], []
        for q_len, ctx in zip(query_lens, context_lens):
            n = -(-(q_len + ctx) // BLOCK_SIZE)
            blocks, order = order[:n], order[n:]
            tables.append(blocks)
            q = self.randn(q_len + ctx, heads, head_dim, dtype=dt)
            k = self.randn(q_len + ctx, kv_heads, head_dim, dtype=dt)
            v = self.randn(q_len + ctx, kv_heads, head_dim, dtype=dt)
            slots = torch.tensor([blocks[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(ctx)],
                                 dtype=torch.int64, device=self.device)
            self.write_kv(k[:ctx], v[:ctx], cache, slots)
            seqs.append((q, k, v, ctx))
            news.append((q[ctx:], k[ctx:], v[ctx:]))
        meta = self.AttentionMetadata.build(query_lens, context_lens, tables, BLOCK_SIZE, device=self.device)
        q, k, v = (torch.cat(parts) for parts in zip(*news))
        self.write_kv(k, v, cache, meta.slot_mapping)
        return q, k, v, cache, meta, seqs

    def dense_sdpa(self, seqs):
        """torch SDPA per sequence on contiguous K/V (bottom-right causal), GQA by enable_gqa."""
        torch = self.torch
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right

        def run():
            for q, k, v, ctx in seqs:
                qs = q[ctx:].transpose(0, 1).unsqueeze(0)
                ks, vs = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
                mask = causal_lower_right(qs.shape[2], ks.shape[2]) if ctx else None
                F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=not ctx, scale=self.scale,
                                               enable_gqa=qs.shape[1] != ks.shape[1])
        return run

    def prefill_case(self, model: str, label: str, query_lens, context_lens, dtype: str) -> dict:
        heads, kv_heads, head_dim = self.language_shapes[model]
        self.scale = head_dim**-0.5
        q, k, v, cache, meta, seqs = self.paged(query_lens, context_lens, heads, kv_heads, head_dim, dtype)
        seq_lens, max_q = meta.seq_lens_tensor, max(query_lens)

        def ours():
            return self.tk.paged_prefill(q, cache, meta.block_tables, meta.query_start_loc, seq_lens, max_q,
                                         self.scale)
        out = ours()
        expected = self.torch.cat([self.reference(sq[c:], sk, sv, c) for sq, sk, sv, c in seqs])
        sdpa_out = self.sdpa.forward(q, k, v, cache, meta, self.scale)
        times = {"triton": self.timed(ours),
                 "sdpa_backend": self.timed(lambda: self.sdpa.forward(q, k, v, cache, meta, self.scale))}
        try:
            times["sdpa_dense"] = self.timed(self.dense_sdpa(seqs))
        except Exception as exc:  # an SDPA without lower-right causal masks on this device: recorded, not fatal
            print(f"     dense SDPA baseline unavailable: {exc}")
        pairs = sum(ql * c + ql * (ql + 1) // 2 for ql, c in zip(query_lens, context_lens))
        shape = {"model": model, "query_lens": list(query_lens), "context_lens": list(context_lens)}
        return self.record(f"prefill {model} {label} {dtype}", "prefill", dtype, shape, out, expected, sdpa_out,
                           times, 4.0 * pairs * head_dim * heads)

    def decode_case(self, model: str, label: str, context_lens, dtype: str) -> dict:
        heads, kv_heads, head_dim = self.language_shapes[model]
        self.scale = head_dim**-0.5
        q, k, v, cache, meta, seqs = self.paged([1] * len(context_lens), context_lens, heads, kv_heads, head_dim,
                                                dtype)
        sms = 1 if self.smoke else self.torch.cuda.get_device_properties(0).multi_processor_count
        splits = self.tk.decode_num_splits(max(meta.seq_lens), meta.num_seqs, kv_heads, sms)
        seq_lens = meta.seq_lens_tensor

        def ours():
            return self.tk.paged_decode(q, cache, meta.block_tables, seq_lens, self.scale, splits)
        out = ours()
        expected = self.torch.cat([self.reference(sq[c:], sk, sv, c) for sq, sk, sv, c in seqs])
        sdpa_out = self.sdpa.forward(q, k, v, cache, meta, self.scale)
        times = {"triton": self.timed(ours),
                 "sdpa_backend": self.timed(lambda: self.sdpa.forward(q, k, v, cache, meta, self.scale)),
                 "sdpa_dense": self.timed(self.dense_sdpa(seqs))}
        pairs = sum(c + 1 for c in context_lens)
        shape = {"model": model, "batch": len(context_lens), "max_context": max(context_lens), "splits": splits}
        # decode is memory-bound: the K/V bytes read are the figure to hold against HBM bandwidth
        case = self.record(f"decode {model} {label} {dtype}", "decode", dtype, shape, out, expected, sdpa_out,
                           times, 4.0 * pairs * head_dim * heads)
        kv_bytes = 2 * pairs * kv_heads * head_dim * cache.element_size()
        case["kv_bytes"] = kv_bytes
        case["triton_kv_GBps"] = kv_bytes / case["triton"]["median_ms"] / 1e6
        return case

    def vision_case(self, label: str, segments, dtype: str) -> dict:
        torch = self.torch
        import torch.nn.functional as F

        heads, head_dim = self.vision_shape
        self.scale = head_dim**-0.5
        dt = self.dtype(dtype)
        total = sum(segments)
        q, k, v = (self.randn(total, heads, head_dim, dtype=dt) for _ in range(3))
        cu = torch.tensor([0, *segments], device=self.device).cumsum(0).to(torch.int32)

        def ours():
            return self.tk.varlen_attention(q, k, v, cu, max(segments))
        out = ours()
        bounds = cu.tolist()
        expected = torch.cat([self.reference(q[a:b], k[a:b], v[a:b], None) for a, b in zip(bounds, bounds[1:])])

        def per_segment_sdpa():  # the towers' own loop (qwen2_vl_vision.VisionAttention.attend)
            q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            return torch.cat([F.scaled_dot_product_attention(a, b, c) for a, b, c in
                              zip(q4.split(segments, 2), k4.split(segments, 2), v4.split(segments, 2))], 2)
        sdpa_out = per_segment_sdpa()[0].transpose(0, 1)
        times = {"triton": self.timed(ours), "sdpa_per_segment": self.timed(per_segment_sdpa)}
        pairs = sum(s * s for s in segments)
        shape = {"num_segments": len(segments), "rows": total, "max_segment": max(segments)}
        return self.record(f"vision {label} {dtype}", "vision", dtype, shape, out, expected, sdpa_out, times,
                           4.0 * pairs * head_dim * heads)

    # ---------------------------------------------------------------------------------------------------- run

    def run(self) -> dict:
        torch = self.torch
        dtypes = self.args.dtype or ["bf16", "fp32"]
        models = ["qwen2-vl-7b"] if self.args.quick or self.smoke else list(LANGUAGE_SHAPES)
        if self.smoke:  # tiny: the plumbing only
            prefill = [("smoke", [5, 1], [21, 0])]
            decode = [("smoke", [3, 30])]
            vision = [("smoke windows", [16, 8, 1])]
            self.language_shapes["qwen2-vl-7b"] = (4, 1, 80)
            self.vision_shape = (2, 80)
        else:
            rng = torch.Generator().manual_seed(1)
            prefill = [("first chunk 2048", [2048], [0]),
                       ("chunk 512 after 3001", [512], [3001]),
                       ("8 seqs mixed", [1, 17, 256, 512, 64, 1000, 16, 333], [0, 100, 2048, 0, 4095, 700, 16, 0])]
            decode = [("batch 1 ctx 4096", [4095]), ("batch 16 ctx 2048", [2047] * 16),
                      ("batch 64 ctx 200-1200", torch.randint(200, 1200, (64,), generator=rng).tolist()),
                      ("batch 1 ctx 32768", [32767])]
            side = 74  # a 1024x1024 image: resized to 1036 x 1036, 14-px patches
            windows = window_segments(side, side, 8)
            vision = [("1 image 1024x1024", [side * side]), ("3 images 1024x1024", [side * side] * 3),
                      ("1 image, Qwen2.5-VL windows", windows)]
            if self.args.quick:
                prefill, decode = prefill[:2], decode[:3]
        cases = []

        def attempt(name: str, fn, *args) -> None:  # a case that raises is recorded, and the others still run
            try:
                cases.append(fn(*args))
            except Exception as exc:
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
                cases.append({"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            if self.device == "cuda":
                torch.cuda.empty_cache()

        models = list(models)
        for dtype in dtypes:
            for model in models:
                for label, qls, ctxs in prefill:
                    attempt(f"prefill {model} {label} {dtype}", self.prefill_case, model, label, qls, ctxs, dtype)
                for label, ctxs in decode:
                    attempt(f"decode {model} {label} {dtype}", self.decode_case, model, label, ctxs, dtype)
            for label, segments in vision:
                attempt(f"vision {label} {dtype}", self.vision_case, label, segments, dtype)
        return {
            "what": "issue 39 Triton attention kernels vs float64 math and torch SDPA",
            "interpret_smoke": self.smoke,
            "device": torch.cuda.get_device_name(0) if self.device == "cuda" else "cpu (TRITON_INTERPRET=1)",
            "torch": torch.__version__, "triton": self.triton.__version__, "python": platform.python_version(),
            "block_size": BLOCK_SIZE, "repeats": self.repeats, "cases": cases,
        }


def window_segments(grid_h: int, grid_w: int, window: int) -> list[int]:
    """Rows per window of a grid_h x grid_w patch grid cut into window x window squares (edges smaller), as
    Qwen2.5-VL's window order lays them out (in merged-token units that is 4 x 4 of 2 x 2; the sizes agree)."""
    sizes = []
    for top in range(0, grid_h, window):
        for left in range(0, grid_w, window):
            sizes.append(min(window, grid_h - top) * min(window, grid_w - left))
    assert sum(sizes) == grid_h * grid_w
    return sizes


if __name__ == "__main__":
    sys.exit(main())
