"""The soak (benchmarks/soak.py) in its CI size: ~8 s of mixed load on the tiny checkpoint, every request kind
(text, images, JSON schemas, regexes, a lark grammar, choices, tool calls, a video, n = 2, logprobs, the Responses
API) with disconnects, bad inputs of every kind, adversarial ones (a grammar whose work grows with every token) and
bursts; then every good answer equals its alone-answer and keeps
its kind's rule (or was a 429 with Retry-After), every bad input got a 4xx, the KV pool is all free, RSS stayed
bounded, and the server still answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

GOOD_KINDS = {"text", "image", "json_schema", "regex", "grammar", "choice", "tool_required", "tool_named", "video",
              "n", "logprobs", "responses"}
BAD_KINDS = {"bad_image", "bad_field", "bad_schema", "bad_regex", "bad_grammar", "bad_video", "bad_tools",
             "bad_responses"}
ADVERSARIAL_KINDS = {"adversarial_grammar", "adversarial_empty_regex"}


def test_short_soak_loses_nothing_and_leaks_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--model", str(tiny_model_dir), "--duration-s", "8",
         "--warmup-s", "3", "--burst-every-s", "3", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.exists(), f"the soak wrote no result (exit {proc.returncode}): {proc.stdout}{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert proc.returncode == 0 and result["ok"], proc.stdout + proc.stderr[-3000:]
    o = result["outcomes"]
    # how many fit in 8 s is the machine's business
    assert o["good_ok"] > 0 and o.get("good_wrong", 0) == 0 and o.get("good_transport_error", 0) == 0
    assert o.get("good_429", 0) > 0  # bursts overflowed --max-queued-requests and got 429 + Retry-After
    assert o.get("disconnect_early", 0) > 0 and o.get("disconnect_mid_decode", 0) > 0
    assert o.get("bad_4xx", 0) > 0 and o.get("bad_wrong", 0) == 0 and o["bursts"] >= 2
    by_kind = result["by_kind"]
    assert {kind for kind in GOOD_KINDS if by_kind.get(kind, {}).get("good_ok", 0) > 0} == GOOD_KINDS
    assert {kind for kind in BAD_KINDS if by_kind.get(kind, {}).get("bad_4xx", 0) > 0} == BAD_KINDS
    # the ambiguous grammar (n 2) and the regex no string matches, each sent under load: refused or ended with an
    # error, never a 5xx, while every good answer beside them stayed its alone-answer (above)
    assert {kind for kind in ADVERSARIAL_KINDS if by_kind.get(kind, {}).get("adversarial_ok", 0) > 0} \
        == ADVERSARIAL_KINDS
    assert o.get("adversarial_wrong", 0) == 0
    assert result["final_stats"]["kv_blocks_used"] == 0 and result["final_stats"]["num_waiting"] == 0
