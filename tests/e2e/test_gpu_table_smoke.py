"""The GPU table's script on the CPU (`benchmarks/gpu/run.sh --smoke`): every step's code path end to end, the CPU
standing in for the device with each family's tiny checkpoint. It must write every key the device run writes
(benchmarks/gpu/manifest.py), none null, print every target as met or missed, bundle what it wrote, and, run again
into the same folder, run no step twice. Its figures are not checked: they are a CPU's, and timings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))

import manifest  # noqa: E402
from setting import MODELS_DIR_ENV  # noqa: E402


def smoke(results: Path, bundle: Path, models: Path) -> subprocess.CompletedProcess[str]:
    # bounds 4x the smoke's own: whether a loaded CI machine meets them is not what this test checks
    env = {**os.environ, MODELS_DIR_ENV: str(models), "PYTHON": sys.executable, manifest.SMOKE_SCALE_ENV: "4"}
    return subprocess.run(["bash", str(GPU / "run.sh"), "--smoke", "--bundle", str(bundle), str(results)],
                          capture_output=True, text=True, timeout=900, env=env)  # fmt: skip


def test_the_smoke_run_writes_every_key_of_the_device_run_and_resumes(tmp_path: Path) -> None:
    results, bundle = tmp_path / "table", tmp_path / "table.tar.gz"
    run = smoke(results, bundle, tmp_path / "models")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    written = {}
    for spec in manifest.STEPS:
        data = json.loads((results / f"{spec.name}.json").read_text())
        assert (data["status"], data["setting"], data["error"]) == ("done", "smoke", None), spec.name
        assert sorted(data["values"]) == sorted(spec.keys), spec.name
        assert [k for k, v in data["values"].items() if v is None] == [], spec.name
        assert data["stand_ins"]["triton"].startswith("sdpa")  # the JSON says what stood in for what
        written[spec.name] = (results / f"{spec.name}.json").read_bytes()
    out = run.stdout
    assert out.startswith("GPU table, SMOKE RUN")
    assert "gate: passed (sdpa passed, triton passed)" in out
    for target in manifest.TARGETS:
        assert re.search(rf"^{re.escape(target.label)}: \S+ .*target {re.escape(target.op)} \S+: (met|missed)$", out,
                         re.M), target.label
    for figure in manifest.FIGURES:
        assert re.search(rf"^{re.escape(figure.label)}: [\d,.]+ tokens/s  \(no target\)$", out, re.M), figure.label
    assert "0 not run" in out
    summary = json.loads((results / "summary.json").read_text())
    assert (summary["exit_status"], summary["ok"], summary["setting"]) == (0, True, "smoke")
    assert [s["step"] for s in summary["steps"]] == ["device", *manifest.STEP_NAMES]
    with tarfile.open(bundle) as tar:
        assert {f"table/{name}.json" for name in manifest.STEP_NAMES} <= set(tar.getnames())

    again = smoke(results, bundle, tmp_path / "models")
    assert again.returncode == 0, again.stderr[-3000:]
    for spec in manifest.STEPS:
        assert "done in an earlier run" in (results / f"{spec.name}.log").read_text(), spec.name
        assert (results / f"{spec.name}.json").read_bytes() == written[spec.name], spec.name


def test_the_gate_passes_the_same_weights_and_fails_a_model_that_reads_one_wrongly(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """The gate is not vacuous: transformers over our weights agrees token for token, and the same model reading
    one layer's k and v projections swapped (a stacking-order fault; same shapes under GQA) fails it."""
    import torch

    import steps.gate as gate
    from reference import transformers_over
    from setting import Setting, model_of

    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path))
    setting = Setting.for_run(smoke=True)
    model_dir = setting.model_dir("qwen2-vl")
    llm = setting.llm(model_dir, "fp32", "sdpa")
    reference = transformers_over(model_dir, model_of(llm), torch.float32, "cpu")
    cases = gate.prompts(setting)
    assert [gate.compare(llm, reference, cases[p], "fp32", setting)["verdict"] for p in cases] == ["equal", "equal"]
    attention = reference.model.language_model.layers[1].self_attn
    attention.k_proj.weight, attention.v_proj.weight = attention.v_proj.weight, attention.k_proj.weight
    assert [gate.compare(llm, reference, cases[p], "bf16", setting)["verdict"] for p in cases] == ["mismatch"] * 2
