"""Compile the Triton attention kernels ahead of time for a CUDA architecture, without a GPU.

``python -m firsttoken.attention.triton_aot [--arch 90] [--dtype bf16 --dtype fp32] [--head-dim 80 ...]``
lowers every kernel of ``triton_kernels.py`` through Triton's real compiler (TTIR -> TTGIR -> LLVM
-> PTX -> cubin, ptxas bundled with the triton wheel) for ``sm_<arch>``, one line per variant with
its shared memory, exit status 1 on the first failure (a compile error, or more shared memory than
``--max-shared``, which the device would refuse at launch). The interpreter (``TRITON_INTERPRET=1``)
checks what the kernels compute but not that they compile (it accepts shapes and types the compiler
refuses), so this is the CPU's other half of the check. It must run in a process where triton is not
interpreted: it refuses otherwise.

Argument types follow the kernels' naming: an upper-case name is a tensor pointer (the data dtype;
``Mid*`` the fp32 split partials), ``cu_seqlens_*`` / ``seq_lens`` / ``block_tables`` int32
pointers, ``scale_log2`` fp32, any other lower-case name an int32 scalar.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

INDEX_POINTERS = ("cu_seqlens_q", "cu_seqlens_k", "seq_lens", "block_tables")


def _signature(fn, data: str, constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name[0].isupper():
            sig[name] = "*fp32" if name.startswith("Mid") else f"*{data}"
        elif name in INDEX_POINTERS:
            sig[name] = "*i32"
        elif name == "scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def variants(dtypes: list[str], head_dims: list[int], group: int, block_size: int):
    """(label, kernel, data dtype, constexprs) for each kernel at each dtype and head_dim."""
    from firsttoken.attention import triton_kernels as tk

    for data in dtypes:
        dot = {"DOT_PRECISION": "ieee" if data == "fp32" else None, "UPCAST": False}
        for head_dim in head_dims:
            p2 = 1 << (head_dim - 1).bit_length()
            common = {"HEAD_DIM": head_dim, "HEAD_DIM_P2": p2}
            block_q = max(1, 64 // group)
            for paged, causal, label in ((True, True, "prefill"), (False, False, "vision")):
                yield (
                    f"{label} {data} d{head_dim}",
                    tk._varlen_attention_kernel,
                    data,
                    {
                        "BLOCK_SIZE": block_size if paged else 1,
                        "BLOCK_Q": block_q,
                        "GROUP": group,
                        "BLOCK_N": 64,
                        "PAGED": paged,
                        "CAUSAL": causal,
                        **common,
                        **dot,
                    },
                )
            yield (
                f"decode {data} d{head_dim}",
                tk._decode_partial_kernel,
                data,
                {"BLOCK_SIZE": block_size, "GROUP": max(16, group), "BLOCK_N": 64, **common, **dot},
            )
            yield (
                f"reduce {data} d{head_dim}",
                tk._decode_reduce_kernel,
                data,
                {"SPLITS_P2": 16, **common},
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200)"
    )
    parser.add_argument("--dtype", action="append", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--head-dim", action="append", type=int)
    parser.add_argument(
        "--group", type=int, default=8, help="query heads per KV head, padded to a power of two"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-shared", type=int, default=232448,
                        help="shared memory a block may use (bytes; H100/H200: 227 KiB)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(
            "triton_aot: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr
        )
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    for label, fn, data, constexprs in variants(
        args.dtype or ["bf16", "fp32"], args.head_dim or [64, 80, 128], args.group, args.block_size
    ):
        start = time.perf_counter()
        try:
            compiled = triton.compile(
                ASTSource(fn, _signature(fn, data, constexprs), constexprs), target=target
            )
        except Exception as exc:  # the compiler's own message, one variant per line
            print(
                f"FAIL {label} sm_{args.arch}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
            )
            return 1
        shared = int(getattr(compiled.metadata, "shared", 0))
        if shared > args.max_shared:  # the launch would fail with OutOfResources on the device
            print(
                f"FAIL {label} sm_{args.arch}: {shared} bytes of shared memory > {args.max_shared}"
            )
            return 1
        print(f"ok   {label} sm_{args.arch} triton {triton.__version__}: {sorted(compiled.asm)}, "
              f"{shared} B shared, {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
