"""firsttoken doctor on metrics captured from real misconfigured runs (benchmarks/capture_doctor_fixtures.py,
tiny checkpoint) and on vLLM's /metrics page: the right cause comes first, with its one change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from firsttoken.cli.doctor import kv_sizing
from firsttoken.cli.main import main
from firsttoken.tools.doctor import Thresholds, doctor_from_texts, format_report
from tests.conftest import VLLM_FIXTURES

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "doctor"
VLLM_METRICS = VLLM_FIXTURES / "metrics.txt"
TINY_CONFIG = FIXTURES / "config.json"


def load(case: str, with_stats: bool = True):
    metrics = (FIXTURES / case / "metrics.txt").read_text()
    stats = json.loads((FIXTURES / case / "stats.json").read_text()) if with_stats else None
    return metrics, stats


@pytest.mark.parametrize(
    ("case", "key", "change"),
    [
        ("budget", "image_budget", "--image-max-tokens 1280"),
        ("fcfs", "scheduling", "--scheduling lanes"),
        ("kv", "kv_pressure", "--kv-admission whole-prompt --kv-cache-memory "),
        ("caches", "caches", "remove --no-prefix-cache --no-encoder-cache"),
    ],
)
@pytest.mark.parametrize("with_stats", [True, False], ids=["stats", "metrics-only"])
def test_misconfigured_run_names_its_cause_first(case: str, key: str, change: str, with_stats: bool) -> None:
    report = doctor_from_texts(*load(case, with_stats), kv=kv_sizing(str(TINY_CONFIG), "float32", None))
    first = report.findings[0]
    assert first.key == key, format_report(report)
    assert first.change.startswith(change)
    assert first.severity in ("high", "medium") and first.evidence


def test_healthy_run_has_no_high_severity_finding() -> None:
    for with_stats in (True, False):
        report = doctor_from_texts(*load("healthy", with_stats))
        assert not [f for f in report.findings if f.severity == "high"], format_report(report)


def test_budget_evidence_is_visual_tokens_per_image_vs_the_budget() -> None:
    report = doctor_from_texts(*load("budget"))
    ev = report.findings[0].evidence
    assert 3800 <= ev["visual_tokens_per_image"] <= 4200  # 2048x1536 at Qwen2-VL's processor default
    assert ev["budget_tokens"] == 1280
    assert report.findings[0].share > 0.5  # most prompt work is visual tokens over the budget
    smaller = doctor_from_texts(*load("budget"), thresholds=Thresholds(image_budget_tokens=400))
    assert smaller.findings[0].change == "--image-max-tokens 400"


def test_kv_change_is_a_planned_size_or_blocks_without_the_model() -> None:
    with_model = doctor_from_texts(*load("kv"), kv=kv_sizing(str(TINY_CONFIG), "float32", 8)).findings[0]
    assert with_model.change.endswith("MiB") and with_model.evidence["peak_concurrency"] == 8
    assert with_model.evidence["preemptions_by_reason"]["prefill_growth"] > 0
    blind = doctor_from_texts(*load("kv")).findings[0]
    assert "blocks" in blind.change and "firsttoken plan" in blind.change


def test_vllm_metrics_are_read_and_blind_spots_listed() -> None:
    report = doctor_from_texts(VLLM_METRICS.read_text())
    o = report.obs
    assert o.source == "vllm" and o.classes["all"].count == 2
    assert set(o.classes["all"].phase_mean_s) == {"queue", "prefill", "other"}
    assert o.kv_usage_ratio == 0.0 and o.num_preemptions == 0 and o.waiting_for_capacity == 0
    assert o.prefix_query_tokens == 78 and o.encoder_cache_queries == 2 and o.kv_bytes_per_block == 2**30 / 2048
    seen = " ".join(o.cannot_see)
    for blind in (
        "vision-encoder time",
        "per-class split",
        "visual tokens per image",
        "preemption reasons",
    ):
        assert blind in seen
    assert not [f for f in report.findings if f.severity == "high"]
    assert "cannot see here" in format_report(report)


def test_cli_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    case = FIXTURES / "fcfs"
    rc = main(["doctor", "--metrics-file", str(case / "metrics.txt"), "--stats-file", str(case / "stats.json"),
               "--json"])  # fmt: skip
    assert rc == 0
    body = json.loads(capsys.readouterr().out)
    assert set(body) >= {
        "source",
        "breakdown",
        "state",
        "findings",
        "cannot_see",
        "probe",
    }
    assert body["source"] == "firsttoken" and body["has_stats"] is True
    assert set(body["breakdown"]["0"]) == {
        "count",
        "ttft_s",
        "phase_mean_s",
        "phase_share",
    }
    f = body["findings"][0]
    assert set(f) == {"key", "severity", "share", "title", "evidence", "change", "note"}
    assert f["key"] == "scheduling" and f["change"] == "--scheduling lanes" and 0 < f["share"] <= 1


def test_cli_text_report_and_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["doctor", "--metrics-file", str(FIXTURES / "budget" / "metrics.txt")]) == 0
    out = capsys.readouterr().out
    assert "1. [high]" in out and "--image-max-tokens 1280" in out and "where TTFT goes" in out
    assert main(["doctor", "--metrics-file", str(tmp_path / "missing.txt")]) == 2


def test_doctor_shows_the_video_class_beside_the_image_classes() -> None:
    # a live recorder's /metrics with text, one-image and video traffic: doctor's table, engine-time split and
    # prediction lines have a video row, and the image-budget evidence leaves the video's tokens out
    from prometheus_client import generate_latest

    from firsttoken.metrics.prometheus import make_registry
    from firsttoken.metrics.recorder import Recorder
    from firsttoken.metrics.stats import EngineSnapshot, FinishedRequest
    from firsttoken.metrics.window import IMAGE_CLASSES
    from firsttoken.tools.doctor.report import CLASS_NAMES
    from tests.unit.fakes import ManualClock

    assert set(CLASS_NAMES) == set(IMAGE_CLASSES)
    rec = Recorder(window_s=60, clock=ManualClock(1000.0), grace_s=0.0)
    phases = {"preprocess_s": 0.5, "queue_s": 0.1, "encode_s": 2.0, "prefill_s": 1.0, "sample_s": 0.0, "send_s": 0.0}
    for rid, images, videos, visual, ttft in (("t", 0, 0, 0, 0.2), ("i", 1, 0, 1000, 1.6), ("v", 3, 1, 3000, 3.6)):
        t = {**phases, "ttft_s": ttft, "e2e_s": ttft + 1, "predicted_ttft_s": ttft, "forward_s": 1.0}
        rec.on_finished(FinishedRequest(rid, "stop", visual + 50, visual, images, 8, "long", t, num_videos=videos))
    engine = EngineSnapshot(0, 100, 0, {"long": 0}, 0, {}, 0, 0, 0, 0, 0)
    metrics = generate_latest(make_registry(rec, lambda: engine)).decode()
    for stats in (None, rec.window_snapshot()):
        report = doctor_from_texts(metrics, stats)
        shown = format_report(report)
        assert any(line.split()[:2] == ["video", "1"] for line in shown.splitlines()), shown
        assert "predicted TTFT video" in shown and report.to_dict()["engine_time_to_first_token_s"]["video"]
        assert report.obs.visual_tokens_total == 1000  # the image's; the video's 3000 are not


def test_a_tiling_family_s_budget_finding_counts_tiles(tmp_path) -> None:
    """doctor --model of an InternVL checkpoint: the budget finding and the state line say how many tiles an image
    took and how many the recommended budget buys; without --model nothing changes."""
    from firsttoken.cli.doctor import tile_facts
    from firsttoken.cli.usage import UsageError
    from firsttoken.models.internvl_checkpoint import (
        SIZES,
        build_hf_config,
        preprocessor_dict,
    )

    (tmp_path / "config.json").write_text(json.dumps(build_hf_config(SIZES["tiny"]).to_dict()))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor_dict()))
    # 1,280 tokens buy 4 crops and the thumbnail; 700 one tile (no image has 2); the family's 12 crops cap 9,999
    assert [tile_facts(str(tmp_path), b) for b in (1280, 700, 9999)] == [(256, 5), (256, 1), (256, 13)]
    assert tile_facts(str(TINY_CONFIG), 1280) == (None, None)
    with pytest.raises(UsageError, match="under one tile"):
        tile_facts(str(tmp_path), 200)
    report = doctor_from_texts(*load("budget"), thresholds=Thresholds(tokens_per_tile=256, budget_tiles=5))
    finding = report.findings[0]
    per_image = finding.evidence["visual_tokens_per_image"]
    assert finding.evidence["tiles_per_image"] == round(per_image / 256, 1) and finding.evidence["budget_tiles"] == 5
    assert "tiles)" in finding.title and finding.change == "--image-max-tokens 1280"
    assert " tiles (budget reference 1,280)" in format_report(report)
    assert "tiles" not in doctor_from_texts(*load("budget")).findings[0].title
