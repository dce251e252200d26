"""Capture llama-server's real /metrics page after a seeded `firsttoken bench` run, for doctor's llama.cpp test
fixture (tests/fixtures/doctor/llamacpp/; its README says how the committed one was made).

    python benchmarks/capture_llamacpp_metrics.py --llama-dir /work/peers/llamacpp \
        --gguf /work/peers/llamacpp/gguf/qwen2vl-small-orig-f32.gguf \
        --mmproj /work/peers/llamacpp/gguf/mmproj-small-orig-f32.gguf [--out DIR]

llama-server runs as the side-by-side benchmark starts it (-t 2, --metrics, -cram 0) with 2 slots of 8,192 tokens;
the bench sends the seed mix (text / 1 / 3 images of 1024x1024), 12 requests at concurrency 2, 32 output tokens.
Then /metrics is read twice: metrics.txt is the first scrape (its rate gauges cover the server's whole life,
so doctor can derive the request count), metrics-rescraped.txt the second (the first reset those gauges).
case.json records the flags, the workload and what the client saw (requests, prompt tokens from usage).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_peer import GGUFPair, LlamaCppTree, start_llama_server  # noqa: E402

from firsttoken.tools.bench import BenchConfig, run_bench

ROOT = Path(__file__).resolve().parent.parent
SLOTS = 2
CTX_LEN = 16384  # 8,192 per slot: a 3-image prompt (~4,180 tokens) fits
BENCH = {"workload": "seed-mix", "num_requests": 12, "concurrency": 2, "output_tokens": 32, "seed": 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-dir", type=Path, required=True, help="work dir with build/bin/llama-server")
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--mmproj", type=Path, required=True)
    p.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "doctor" / "llamacpp")
    args = p.parse_args()
    tree = LlamaCppTree(args.llama_dir.resolve())
    proc, base = start_llama_server(tree.server, GGUFPair(args.gguf, args.mmproj), threads=2, parallel=SLOTS,
                                    ctx_len=CTX_LEN)  # fmt: skip
    try:
        report = run_bench(BenchConfig(url=base, progress=False, **BENCH))
        first = httpx.get(f"{base}/metrics", timeout=30).text
        second = httpx.get(f"{base}/metrics", timeout=30).text
    finally:
        proc.terminate()
        proc.wait(30)
    ok = [r for r in report.records if r.ok]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.txt").write_text(first)
    (args.out / "metrics-rescraped.txt").write_text(second)
    case = {
        "server": f"llama-server ({tree.commit()}) -t 2 -tb 2 -c {CTX_LEN} -np {SLOTS} -cram 0 --metrics",
        "model": "firsttoken make-model --size small --layout original, converted to an f32 GGUF + f32 mmproj",
        "bench": BENCH,
        "requests_ok": len(ok),
        "errors": report.summary.errors,
        "error_messages": sorted({f"{r.error}: {r.error_message}"[:200] for r in report.records if not r.ok}),
        "prompt_tokens_from_usage": sum(r.prompt_tokens or 0 for r in ok),
        "completion_tokens_from_usage": sum(r.completion_tokens or 0 for r in ok),
        "ttft_p50_s": {k: c.ttft.p50 for k, c in report.summary.classes.items()},
    }
    (args.out / "case.json").write_text(json.dumps(case, indent=1) + "\n")
    print(json.dumps(case, indent=1))


if __name__ == "__main__":
    main()
