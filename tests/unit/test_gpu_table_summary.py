"""The GPU table's bookkeeping without running a step: the summary's met / missed / not-run logic on injected JSON,
the step recorder's contract (declared keys only, a null needs a reason, partial until every key is given), resuming
a run (a done step is not run again; a failed gate stays failed), and the gate's tie rule on made-up logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
for path in (GPU.parents[1], GPU.parent, GPU):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import manifest  # noqa: E402
import step  # noqa: E402
import summary  # noqa: E402


def write(results: Path, name: str, values: dict, why: dict | None = None, status: str = "done",
          error: str | None = None, passed: bool = True) -> None:  # fmt: skip
    data = {"step": name, "status": status, "setting": "device", "values": values, "why": why or {}, "context": {},
            "stand_ins": {}, "error": error, "seconds": 1.0, "passed": passed, "third_party_modules": []}
    (results / f"{name}.json").write_text(json.dumps(data))


def case(verdict: str = "equal") -> dict:
    return {"verdict": verdict, "steps": 16, "steps_argmax_equal": 16 if verdict == "equal" else 9,
            "steps_within_tolerance": 16 if verdict != "mismatch" else 15, "max_deficit_over_sigma": 0.0,
            "tolerance_sigma": 0.2, "generate_equal": verdict == "equal"}  # fmt: skip


def gate_values(passed: dict[str, bool]) -> dict:
    """A finished gate whose cases of a backend not ``passed`` include one mismatch (bf16, image)."""
    values = {k: case("mismatch" if k.endswith(".image") and not passed[k.split(".")[1]] else "equal")
              for k in manifest.spec("gate").keys if k.count(".") == 2}  # fmt: skip
    return values | {f"{b}.passed": ok for b, ok in passed.items()} | {"passed": all(passed.values()), "rule": "r"}


def row(rows: list[dict], label: str) -> dict:
    return next(r for r in rows if r["label"] == label)


def test_each_target_is_met_or_missed_from_the_json_and_says_why_when_not_run(tmp_path: Path) -> None:
    write(tmp_path, "gate", gate_values({"sdpa": True, "triton": False}))
    ttft = {"qwen2-vl.text.transformers_s": 1.0, "qwen2-vl.text.sdpa_s": 0.4, "qwen2-vl.1img.transformers_s": 2.0,
            "qwen2-vl.1img.sdpa_s": 1.5, "qwen2-vl.text.triton_s": None}
    write(tmp_path, "ttft", ttft, why={"qwen2-vl.text.triton_s": "skipped: the gate failed for triton"},
          status="partial", error="TimeoutExpired")  # a step stopped before the rest of its keys
    write(tmp_path, "mfu", {"lm.tflop": 60.0, "lm.s": 0.1, "peak_tflops": 800.0, "vision.tflop": 10.0,
                            "vision.s": 0.05, "n": 3})  # fmt: skip
    write(tmp_path, "decode", {"batch1.graphs_on.tokens_per_s": 150.0, "copy_gbps": 3000.0,
                               "weight_bytes": 15e9, "batch16.sdpa.tokens_per_s": 900.0})  # fmt: skip
    steps_tsv = tmp_path / "steps.tsv"
    steps_tsv.write_text("served\t124\t125.0\tstep.py served\n")
    out = summary.summarize(tmp_path, summary.read_steps(steps_tsv))
    rows = out["targets"]
    assert [r["label"] for r in rows] == [t.label for t in manifest.TARGETS]
    text = row(rows, "TTFT qwen2-vl text, sdpa / transformers")
    assert (text["verdict"], text["figure"]) == ("met", pytest.approx(0.4))
    assert row(rows, "TTFT qwen2-vl 1img, sdpa / transformers")["verdict"] == "missed"  # 0.75x > 0.5x
    assert row(rows, "TTFT qwen2-vl text, triton / transformers")["why"] == "skipped: the gate failed for triton"
    unfinished = row(rows, "TTFT qwen2-vl 3img, sdpa / transformers")
    assert unfinished["verdict"] == "not run" and "ended partial: TimeoutExpired" in unfinished["why"]
    assert row(rows, "prefill MFU, language model")["verdict"] == "met"  # 600 of 800 TFLOP/s
    assert row(rows, "prefill MFU, vision tower")["verdict"] == "missed"  # 200 of 800
    decode = row(rows, "decode batch 1, graphs_on, share of the roofline")
    assert decode["figure"] == pytest.approx(150 * 15e9 / 3000e9) and decode["verdict"] == "met"  # 75% of 200/s
    served = row(rows, "served U 0.6, text P99 / unloaded TTFT")
    assert served["verdict"] == "not run" and "stopped at its bound (125 s)" in served["why"]
    assert row(out["figures"], "decode batch 16, sdpa")["value"] == 900.0
    assert out["gate"][0].startswith("gate: FAILED (sdpa passed, triton not cleared: the gate failed "
                                     "bf16.triton.image, fp32.triton.image)")
    text_out = summary.render(out, summary.read_steps(steps_tsv))
    for t in manifest.TARGETS:
        assert t.label in text_out
    assert "targets: 3 met, 2 missed, 15 not run" in text_out


def test_without_a_gate_the_summary_says_the_timing_steps_skip(tmp_path: Path) -> None:
    out = summary.summarize(tmp_path, [])
    assert out["gate"] == ["gate: not run (the gate step did not run): every timing step skips"]
    assert {r["verdict"] for r in out["targets"]} == {"not run"}


def recorder(tmp_path: Path, name: str = "mfu") -> tuple[step.Recorder, Path]:
    path = tmp_path / f"{name}.json"
    return step.Recorder(path, manifest.spec(name), "smoke", {}), path


def test_the_recorder_writes_every_figure_at_once_and_is_done_only_with_every_key(tmp_path: Path) -> None:
    rec, path = recorder(tmp_path)
    rec.put("peak_tflops", 1.5)
    on_disk = json.loads(path.read_text())
    assert (on_disk["status"], on_disk["values"]) == ("partial", {"peak_tflops": 1.5})
    with pytest.raises(KeyError, match="declares no key 'peak'"):
        rec.put("peak", 1.0)
    with pytest.raises(ValueError, match="needs a reason"):
        rec.put("lm.s", None)
    rec.skip("lm.s", "skipped: the gate failed for sdpa")
    rec.finish()
    on_disk = json.loads(path.read_text())
    missing = len(manifest.spec("mfu").keys) - 2
    assert on_disk["status"] == "partial" and on_disk["error"].startswith(f"ended without {missing} declared keys")
    for key in manifest.spec("mfu").keys:
        if key not in ("peak_tflops", "lm.s"):
            rec.put(key, 1)
    rec.finish()
    on_disk = json.loads(path.read_text())
    assert (on_disk["status"], on_disk["error"], on_disk["why"]) == ("done", None,
                                                                      {"lm.s": "skipped: the gate failed for sdpa"})
    assert [p.name for p in tmp_path.iterdir()] == ["mfu.json"]  # no temporary file left beside it


def test_a_rerun_skips_a_done_step_and_a_failed_gate_stays_failed(tmp_path: Path, capsys) -> None:
    write(tmp_path, "decode", {})
    assert step.main(["decode", str(tmp_path)]) == 0
    assert "done in an earlier run" in capsys.readouterr().out
    write(tmp_path, "gate", gate_values({"sdpa": False, "triton": True}), passed=False)
    assert step.main(["gate", str(tmp_path)]) == 1


def test_the_step_bounds_fit_eight_minutes_on_a_device_in_the_order_of_value() -> None:
    assert sum(seconds for _, seconds in manifest.limits(smoke=False)) <= 480
    assert manifest.STEP_NAMES == ("gate", "ttft", "mfu", "decode", "served")
    for target in manifest.TARGETS:
        assert set(target.keys) <= set(manifest.spec(target.step).keys), target.label


def test_the_gate_rule_lets_a_near_tie_pass_and_fails_a_real_mismatch() -> None:
    import steps.gate as gate

    logits = torch.zeros(3, 10)
    logits[:, 0] = torch.tensor([5.0, 5.0, 5.0])  # transformers' best at every step: token 0
    logits[:, 1] = torch.tensor([0.0, 4.99, 0.0])  # step 1: token 1 a hair below it
    sigma = float(logits.std(-1)[1])
    assert gate.judge(logits, [0, 0, 0], 0.2)["verdict"] == "equal"
    tie = gate.judge(logits, [0, 1, 0], 0.2)
    assert (tie["verdict"], tie["steps_argmax_equal"]) == ("near-tie", 2)
    assert tie["max_deficit_over_sigma"] == pytest.approx(0.01 / sigma, rel=1e-4)
    assert gate.judge(logits, [0, 0, 2], 0.2)["verdict"] == "mismatch"  # 5 logits below the best: no tie


def test_a_gate_stopped_after_clearing_sdpa_lets_the_timing_steps_measure_sdpa_only(tmp_path: Path) -> None:
    from setting import gate_verdict

    cleared = {key: case() for key in manifest.gate_cases("sdpa")}
    write(tmp_path, "gate", cleared | {"bf16.triton.text": case(), "rule": "r"}, status="partial")
    assert gate_verdict(tmp_path, "sdpa") == (True, "")
    ok, why = gate_verdict(tmp_path, "triton")
    assert not ok and why == "skipped: the gate did not check bf16.triton.image, fp32.triton.text, fp32.triton.image"
    line = summary.summarize(tmp_path, [])["gate"][0]
    assert line.startswith("gate: ended partial (stopped at its bound) (sdpa passed, triton not cleared: ")
    assert gate_verdict(tmp_path / "nowhere", "sdpa") == (False, "skipped: the gate did not run (no gate.json)")
