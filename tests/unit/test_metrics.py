"""Metrics as plain data: percentiles, the sliding window, the engine/HTTP join, and the Prometheus text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from firsttoken.metrics.histogram import TIME_BUCKETS_S, Histogram
from firsttoken.metrics.prometheus import make_registry
from firsttoken.metrics.recorder import Recorder, RequestRecord
from firsttoken.metrics.stats import EngineSnapshot, FinishedRequest, StepStats
from firsttoken.metrics.window import percentile
from tests.unit.fakes import ManualClock

ROOT = Path(__file__).resolve().parents[2]


def timings(ttft: float, queue: float = 0.0, **extra) -> dict:
    send = 0.001
    rest = ttft - queue - send
    return {"ttft_s": ttft, "preprocess_s": rest / 2, "queue_s": queue, "encode_s": 0.0, "prefill_s": rest / 2,
            "sample_s": 0.0, "send_s": send, "e2e_s": ttft + 0.5, "images_encoded": extra.get("encoded", 0),
            "encoder_cache_hits": extra.get("hits", 0), "cached_prompt_tokens": extra.get("cached", 0)}


def finished(rid: str, num_images: int = 0, outcome: str = "stop", lane: str = "short", **t) -> FinishedRequest:
    return FinishedRequest(rid, outcome, 100, 50 * num_images, num_images, 8, lane, timings(**t) if t else {})


def step(start_s: float, prefill: int, preempted: int = 0) -> StepStats:
    return StepStats(0, start_s, 0.01, 0.012, 1, prefill, 1, 0, 0.0, preempted, 10, 100, 1, 0)


def test_nearest_rank_percentiles_match_brute_force():
    rng = random.Random(0)
    for n in (1, 2, 7, 100, 101):
        values = sorted(rng.random() for _ in range(n))
        for q in (50, 95, 99):
            # the smallest value with at least q% of the values <= it
            expected = min(v for v in values if sum(x <= v for x in values) >= q / 100 * n)
            assert percentile(values, q) == expected
    assert percentile([], 50) is None


def test_histogram_buckets_resolve_50ms_and_150s():
    h = Histogram(TIME_BUCKETS_S)
    for v in (0.05, 0.051, 150.0, 151.0):
        h.observe(v)
    cum = dict(h.cumulative())
    assert cum[0.05] == 1 and cum[0.075] == 2 and cum[150.0] == 3 and cum[float("inf")] == 4


def test_completion_uses_the_final_timeline_and_window_is_per_class_and_slides():
    clock, log = ManualClock(1000.0), []
    rec = Recorder(window_s=60, clock=clock, sink=log.append)
    rec.on_finished(finished("a", 0, ttft=0.1))
    rec.on_finished(finished("b", 1, ttft=2.0))
    rec.on_finished(finished("c", 3, ttft=9.0))
    # the HTTP layer completes with the first byte marked: its TTFT wins over the engine's snapshot
    rec.complete("a", timings(0.2), token_gaps_s=(0.01, 0.02), http_request_id="h-a")
    rec.complete("b", timings(2.5))
    rec.complete("c", timings(9.5))
    s = rec.window_snapshot()
    assert s["seq"] == 3 and s["classes"]["all"]["count"] == 3
    assert s["classes"]["0"]["ttft_s"]["p99"] == 0.2
    assert s["classes"]["1"]["ttft_s"]["p50"] == 2.5
    assert s["classes"]["2+"]["ttft_s"]["p95"] == 9.5
    assert s["classes"]["all"]["ttft_s"]["p50"] == 2.5
    assert [r.request_id for r in log] == ["a", "b", "c"] and log[0].http_request_id == "h-a"
    line = log[0].log_line()
    assert line["itl_mean_s"] == pytest.approx(0.015) and "prompt" not in line
    clock.now += 61
    assert rec.window_snapshot()["classes"]["all"]["count"] == 0


def test_aborts_are_recorded_from_engine_data_and_stragglers_after_the_grace_period():
    clock, log = ManualClock(1000.0), []
    rec = Recorder(window_s=60, clock=clock, sink=log.append, grace_s=30)
    rec.on_finished(finished("gone", 1, outcome="abort"))
    rec.on_finished(finished("slow", 0, ttft=0.3))  # finished in the engine, HTTP never completed it
    rec.flush()
    assert [r.outcome for r in log] == ["abort"]
    clock.now += 31
    rec.flush()
    assert [r.request_id for r in log] == ["gone", "slow"]
    assert rec.complete("slow", timings(0.4)) is None  # already recorded: no double count
    assert sum(rec.snapshot().requests.values()) == 2


def test_prometheus_text_has_labelled_histograms_counters_and_gauges():
    rec = Recorder(window_s=60, clock=ManualClock(1000.0))
    rec.on_step(step(1.0, prefill=300, preempted=2))
    rec.on_finished(finished("a", 2, ttft=0.05, hits=1, encoded=1, cached=16))
    rec.complete("a", timings(0.05, hits=1, encoded=1, cached=16), token_gaps_s=(0.02,))
    rec.on_rejected("invalid_request")
    engine = EngineSnapshot(90, 100, 3, {"short": 2, "long": 5}, 4096, {"kv_cache_full": 2}, 1, 1, 1, 16, 100,
                            step_time_target_s=0.5, itl_target_s=0.2)
    text = generate_latest(make_registry(rec, lambda: engine)).decode()
    for line in (
        "firsttoken_step_time_target_seconds 0.5",
        "firsttoken_itl_target_seconds 0.2",
        'firsttoken_time_to_first_token_seconds_bucket{images="2+",lane="short",le="0.05"} 1.0',
        'firsttoken_time_to_first_token_seconds_bucket{images="0",lane="short",le="+Inf"} 0.0',
        'firsttoken_request_phase_seconds_count{images="2+",lane="short",phase="queue"} 1.0',
        'firsttoken_inter_token_latency_seconds_count{images="2+",lane="short"} 1.0',
        'firsttoken_requests_total{images="2+",lane="short",outcome="stop"} 1.0',
        'firsttoken_rejections_total{reason="invalid_request"} 1.0',
        'firsttoken_preemptions_total{reason="kv_cache_full"} 2.0',
        "firsttoken_encoder_cache_hits_total 1.0",
        "firsttoken_encoder_cache_misses_total 1.0",
        "firsttoken_prefix_cache_hit_tokens_total 16.0",
        "firsttoken_step_prefill_tokens_total 300.0",
        "firsttoken_short_requests_delayed_by_long_total 1.0",
        "firsttoken_prefix_cache_query_tokens_total 100.0",
        "firsttoken_kv_cache_usage_ratio 0.9",
        'firsttoken_requests_queued{lane="long"} 5.0',
        "firsttoken_encoder_cache_bytes 4096.0",
    ):
        assert line in text, line


def test_vllm_gauges_carry_vllm_names_labels_and_meanings():
    """What a Kubernetes inference gateway reads from vLLM pods (names, type, labels as vLLM 0.32 exports them in
    tests/fixtures/vllm-0.32/metrics.txt): waiting = queued in every lane, running = the batch, KV usage 0..1."""
    from prometheus_client.parser import text_string_to_metric_families

    engine = EngineSnapshot(30, 120, 3, {"short": 2, "long": 5}, 0, {}, 0, 0, 0, 0, 0)
    text = generate_latest(make_registry(Recorder(window_s=60), lambda: engine, "qwen2vl")).decode()
    families = {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}
    got = {name: [(s.labels, s.value) for s in f.samples] for name, f in families.items()}
    labels = {"engine": "0", "model_name": "qwen2vl"}
    assert got == {"vllm:num_requests_running": [(labels, 3.0)], "vllm:num_requests_waiting": [(labels, 7.0)],
                   "vllm:kv_cache_usage_perc": [(labels, 0.25)], "vllm:gpu_cache_usage_perc": [(labels, 0.25)],
                   "vllm:cache_config_info": [({"block_size": "16", "engine": "0", "num_gpu_blocks": "120"}, 1.0)]}
    assert {f.type for f in families.values()} == {"gauge"}
    fixture = (ROOT / "tests/fixtures/vllm-0.32/metrics.txt").read_text()
    vllm = {f.name: f for f in text_string_to_metric_families(fixture)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert vllm[name].type == "gauge" and set(vllm[name].samples[0].labels) == set(labels), name
    info = vllm["vllm:cache_config_info"].samples[0].labels
    assert {"block_size", "engine", "num_gpu_blocks"} <= set(info)


def test_request_record_log_line_has_no_content():
    r = RequestRecord("r", None, 0.0, "stop", "short", "1", 1, 10, 4, 2, {"ttft_s": 0.1})
    assert set(r.log_line()) >= {"request_id", "timings", "visual_tokens"} and "content" not in r.log_line()


def test_request_log_writes_content_only_when_asked(tmp_path):
    import json
    from types import SimpleNamespace

    from firsttoken.api.observability import Observability, RequestLog

    rec = Recorder(window_s=60, clock=ManualClock(1000.0))
    obs = Observability(rec, detokenize=lambda ids: f"prompt of {len(ids)} tokens")
    plain = RequestLog(tmp_path / "plain.jsonl")
    with_content = RequestLog(tmp_path / "content.jsonl", obs.content_of)
    rec.sink = lambda r: (plain(r), with_content(r))
    image = SimpleNamespace(content_hash="abc", num_tokens=16)
    obs.request_started(SimpleNamespace(request_id="a", prompt_token_ids=(1, 2, 3), images=(image,)))
    rec.on_finished(finished("a", 1, ttft=0.1))
    rec.complete("a", timings(0.1))
    plain.close(), with_content.close()
    logged = json.loads((tmp_path / "plain.jsonl").read_text())
    assert logged["request_id"] == "a" and "content" not in logged and logged["timings"]["ttft_s"] == 0.1
    content = json.loads((tmp_path / "content.jsonl").read_text())["content"]
    assert content == {"prompt": "prompt of 3 tokens", "images": [{"content_hash": "abc", "visual_tokens": 16}]}


def test_json_log_lines_carry_the_request_id():
    import json
    import logging

    from firsttoken.api.logs import JsonFormatter, RequestIdFilter, current_request_id

    record = logging.LogRecord("firsttoken.api", logging.INFO, __file__, 1, "served %s", ("x",), None)
    token = current_request_id.set("req-42")
    try:
        RequestIdFilter().filter(record)
    finally:
        current_request_id.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "req-42" and line["msg"] == "served x" and line["level"] == "INFO"


def test_where_each_first_token_time_went_is_summed_per_class_and_doctor_shows_it():
    from firsttoken.tools.doctor.report import doctor_from_texts, format_report

    rec = Recorder(window_s=60, clock=ManualClock(1000.0), grace_s=0.0)
    parts = {"handoff_s": 0.01, "encoder_compute_s": 1.0, "forward_s": 2.0, "step_overhead_s": 0.5,
             "other_steps_s": 0.0, "engine_idle_s": 0.49}
    for rid in ("a", "b"):
        rec.on_finished(FinishedRequest(rid, "stop", 100, 50, 1, 8, "long", {**timings(4.5), **parts}))
    engine = EngineSnapshot(30, 120, 0, {"short": 0, "long": 0}, 0, {}, 0, 0, 0, 0, 0)
    text = generate_latest(make_registry(rec, lambda: engine, "m")).decode()
    assert 'firsttoken_first_token_engine_seconds_total{images="1",part="forward"} 4.0' in text
    assert 'firsttoken_first_token_engine_seconds_total{images="0",part="forward"} 0.0' in text
    report = doctor_from_texts(text)
    assert report.to_dict()["engine_time_to_first_token_s"]["1"]["step_overhead"] == 1.0
    shown = format_report(report)
    assert "where the engine's time to each first token goes" in shown
    row = next(line for line in shown.splitlines() if line.startswith("1 ") and "|" in line and "8.00" in line)
    # handoff, encoder, forward, step_overhead, other_steps, idle: of 8 s, forward 4 s
    assert row.split() == ["1", "8.00", "|", "0%", "25%", "50%", "12%", "0%", "12%"]


def test_a_video_request_is_its_own_class_and_every_per_class_family_shows_it_from_zero():
    from firsttoken.metrics.window import IMAGE_CLASSES

    clock, log = ManualClock(1000.0), []
    rec = Recorder(window_s=60, clock=clock, sink=log.append, grace_s=0.0)
    rec.on_finished(finished("text", 0, ttft=0.1))
    text = generate_latest(make_registry(rec, lambda: EngineSnapshot(0, 10, 0, {}, 0, {}, 0, 0, 0, 0, 0))).decode()
    for cls in IMAGE_CLASSES:  # before any video arrives, its series exist at 0 (alerts and dashboards need them)
        assert f'firsttoken_time_to_first_token_seconds_count{{images="{cls}",lane="short"}}' in text, cls
        assert f'firsttoken_requests_total{{images="{cls}",lane="short",outcome="stop"}}' in text, cls
        assert f'firsttoken_request_phase_seconds_count{{images="{cls}",lane="short",phase="encode"}}' in text, cls
        assert f'firsttoken_first_token_engine_seconds_total{{images="{cls}",part="encoder"}}' in text, cls
        assert f'firsttoken_ttft_prediction_ratio_count{{images="{cls}"}}' in text, cls
    # a video of 3 temporal grids beside 1 image: 4 vision items, of class "video" whatever its image count
    rec.on_finished(FinishedRequest("clip", "stop", 900, 800, 4, 8, "long", timings(6.0), num_videos=1))
    text = generate_latest(make_registry(rec, lambda: EngineSnapshot(0, 10, 0, {}, 0, {}, 0, 0, 0, 0, 0))).decode()
    assert 'firsttoken_requests_total{images="video",lane="long",outcome="stop"} 1.0' in text
    assert 'firsttoken_request_visual_tokens_sum{images="video",lane="long"} 800.0' in text
    assert 'firsttoken_requests_total{images="2+",lane="long",outcome="stop"} 0.0' in text
    s = rec.window_snapshot()
    assert set(s["classes"]) == {"all", *IMAGE_CLASSES}
    assert s["classes"]["video"]["count"] == 1 and s["classes"]["video"]["ttft_s"]["p50"] == 6.0
    assert s["classes"]["2+"]["count"] == 0
    line = log[-1].log_line()
    assert (line["images"], line["num_images"], line["num_videos"]) == ("video", 4, 1)
