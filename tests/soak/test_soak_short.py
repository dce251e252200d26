"""The soak (benchmarks/soak.py) in its CI size: ~12 s of mixed load with disconnects, bad inputs and bursts on
the tiny checkpoint, then every good answer equals its alone-answer (or was a 429 with Retry-After), the KV pool is all free, RSS
stayed bounded, and the server still answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_loses_nothing_and_leaks_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--model", str(tiny_model_dir), "--duration-s", "12",
         "--warmup-s", "3", "--burst-every-s", "4", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    result = json.loads(out.read_text())
    assert proc.returncode == 0 and result["ok"], proc.stdout + proc.stderr[-3000:]
    o = result["outcomes"]
    assert o["good_ok"] > 0 and o.get("good_wrong", 0) == 0  # how many fit in 12 s is the machine's business and o.get("good_transport_error", 0) == 0
    assert o.get("good_429", 0) > 0  # bursts overflowed --max-queued-requests and got 429 + Retry-After
    assert o.get("disconnect_early", 0) > 0 and o.get("disconnect_mid_decode", 0) > 0
    assert o.get("bad_4xx", 0) > 0 and o.get("bad_wrong", 0) == 0 and o["bursts"] >= 2
    assert result["final_stats"]["kv_blocks_used"] == 0 and result["final_stats"]["num_waiting"] == 0
