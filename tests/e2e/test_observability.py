"""Observability through the real server: API-key auth, /metrics, /stats, the request log, the shipped
Prometheus/Grafana configuration, and the /dashboard page in headless Chromium.

One server for the module, started with --api-key and --request-log. The request log is the oracle for /stats
and the dashboard: a snapshot with ``seq = S`` summarises exactly the first S lines of the log.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
from html.parser import HTMLParser
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import require_program
from tests.e2e.conftest import (
    LiveServer,
    image_message,
    make_image,
    start_server,
    stop_server,
)

KEY = "sk-test-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = Path(__file__).resolve().parents[2]
PHASES = ("preprocess", "queue", "encode", "prefill", "sample", "send")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("obs") / "requests.jsonl"
    live, srv, thread = start_server(tiny_model_dir, api_key=KEY, request_log=log)
    live.request_log = log  # type: ignore[attr-defined]
    httpx_get = httpx.get
    assert httpx_get(f"{live.base_url}/health").status_code == 200
    yield live
    stop_server(srv, thread, live.engine)


def client(live: LiveServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0)


def log_lines(live: LiveServer) -> list[dict]:
    return [json.loads(line) for line in live.request_log.read_text().splitlines()]  # type: ignore[attr-defined]


def nearest_rank(values: list[float], q: float) -> float | None:
    v = sorted(values)
    return v[max(1, math.ceil(q / 100 * len(v))) - 1] if v else None


def mixed_requests(live: LiveServer, n: int = 1, max_tokens: int = 3) -> list:
    c = client(live)
    out = []
    for i in range(n):
        out.append(c.chat.completions.create(model="tiny", max_tokens=max_tokens,
                                             messages=[{"role": "user", "content": f"Describe the sea {i}."}]))
        out.append(c.chat.completions.create(model="tiny", max_tokens=max_tokens,
                                             messages=image_message("Describe it.", make_image(56, 56, i))))
        stream = c.chat.completions.create(model="tiny", max_tokens=max_tokens, stream=True,
                                           stream_options={"include_usage": True},
                                           messages=image_message("Both?", make_image(56, 56, i), make_image(28, 56)))
        out.append(list(stream))
    return out


def test_api_key_guards_every_route_but_health_and_the_dashboard_page(server: LiveServer):
    base = server.base_url
    for path in ("/v1/models", "/metrics", "/stats", "/v1/engine/stats"):
        missing = httpx.get(base + path)
        wrong = httpx.get(base + path, headers={"Authorization": "Bearer sk-wrong"})
        for r in (missing, wrong):
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == 401 and r.json()["error"]["type"] == "AuthenticationError"
            assert r.headers["x-request-id"] and r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(base + path, headers=AUTH).status_code == 200, path
    assert httpx.get(base + "/health").status_code == 200
    page = httpx.get(base + "/dashboard")
    assert page.status_code == 200 and "<canvas" in page.text and "http" not in re.sub(r"<!--.*?-->", "", page.text)
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-wrong").models.list()
    assert client(server).models.list().data[0].id == "tiny"


def test_metrics_stats_and_request_log_agree_with_the_responses(server: LiveServer):
    before = len(log_lines(server)) if server.request_log.exists() else 0  # type: ignore[attr-defined]
    text, one_image, streamed = mixed_requests(server)
    bad = httpx.post(f"{server.base_url}/v1/chat/completions", headers=AUTH, json={"model": "tiny", "messages": 3})
    assert bad.status_code == 400
    lines = log_lines(server)[before:]
    assert [line["images"] for line in lines] == ["0", "1", "2+"]
    by_id = {line["request_id"]: line for line in lines}
    # the log carries exactly what the client got in usage.firsttoken (TTFT up to the first byte), no content
    for resp in (text, one_image):
        assert by_id[resp.id]["timings"] == resp.usage.model_extra["firsttoken"]
    assert by_id[streamed[-1].id]["timings"] == streamed[-1].usage.model_extra["firsttoken"]
    assert "Describe" not in server.request_log.read_text() and "content" not in lines[0]  # type: ignore[attr-defined]
    assert lines[0]["http_request_id"] and lines[1]["itl_mean_s"] > 0

    stats = httpx.get(f"{server.base_url}/stats", headers=AUTH).json()
    everything = log_lines(server)[: stats["seq"]]
    for cls in ("all", "0", "1", "2+"):
        mine = [line for line in everything if cls in ("all", line["images"])]
        assert stats["classes"][cls]["count"] == len(mine)
        for key in ("ttft_s", *(f"{p}_s" for p in PHASES)):
            values = [line["timings"][key] for line in mine]
            for q in (50, 95, 99):
                assert stats["classes"][cls][key][f"p{q}"] == nearest_rank(values, q), (cls, key, q)
    assert stats["engine"]["kv_blocks_total"] > 0 and set(stats["engine"]["queued_by_lane"]) >= {"short"}

    metrics = httpx.get(f"{server.base_url}/metrics", headers=AUTH).text
    count = re.search(r'firsttoken_time_to_first_token_seconds_count\{images="2\+",lane="(\w+)"\} (\S+)', metrics)
    assert count and float(count.group(2)) >= 1
    assert re.search(r'firsttoken_rejections_total\{reason="invalid_request"\} [1-9]', metrics)
    assert re.search(r'firsttoken_rejections_total\{reason="unauthorized"\} [1-9]', metrics)
    assert 'le="0.05"' in metrics and 'le="150.0"' in metrics


def test_shipped_dashboard_and_alerts_query_only_exported_metrics(server: LiveServer):
    mixed_requests(server)  # every family has samples
    scrape = httpx.get(f"{server.base_url}/metrics", headers=AUTH).text
    exported = {m.group(1) for m in re.finditer(r"^(firsttoken_\w+?)(?:\{| )", scrape, re.M)}
    grafana = json.loads((ROOT / "deploy/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in grafana["panels"] for t in p["targets"]]
    exprs += re.findall(r"expr: (?:\|\n)?((?:.*\n)+?)\s+(?:for|labels):", (ROOT / "deploy/alerts.yml").read_text())
    used = {name for e in exprs for name in re.findall(r"\bfirsttoken_\w+", e)}
    assert len(exprs) > 15 and len(used) > 15
    assert used <= exported, sorted(used - exported)


def test_promtool_accepts_the_rules_their_unit_tests_and_the_scrape_config():
    promtool = require_program("promtool", "prometheus")  # Debian ships promtool in its prometheus package
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"],
                 ["check", "config", "prometheus.yml"]):
        done = subprocess.run([promtool, *args], cwd=ROOT / "deploy", capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    config = (ROOT / "deploy/prometheus.yml").read_text()
    assert "type: Bearer" in config and "credentials:" in config


DASHBOARD = Path(__file__).resolve().parents[2] / "firsttoken" / "api" / "dashboard.html"


def dashboard_classes() -> list[tuple[str, str]]:
    """The page's ``CLASSES``: [(the /stats class key, its element id suffix)], in the page's order."""
    line = next(x for x in DASHBOARD.read_text().splitlines() if x.startswith("const CLASSES = "))
    return [tuple(pair) for pair in json.loads(line.removeprefix("const CLASSES = ").rstrip(";"))]


def test_the_dashboard_shows_every_request_class_the_metrics_have():
    # no browser needed: the page's class list, its chart per class and its phase columns follow IMAGE_CLASSES
    from firsttoken.metrics.window import IMAGE_CLASSES

    classes = dashboard_classes()
    assert [key for key, _ in classes] == ["all", *IMAGE_CLASSES]
    page = DASHBOARD.read_text()
    for _, sfx in classes:
        assert f'<canvas id="ttft-chart-{sfx}">' in page, sfx
    header = next(x for x in page.splitlines() if "<th>phase</th>" in x)
    assert header.count("<th>") == 1 + len(classes) and "<th>video</th>" in header


class _Values(HTMLParser):
    """id -> data-value of every element that has both, plus the body's data attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.body: dict[str, str] = {}
        self.styles: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = {k: v or "" for k, v in a.items()}
        if "id" in a and "data-value" in a:
            self.values[a["id"]] = a["data-value"] or ""
        if "id" in a:
            self.styles[a["id"]] = a.get("style") or ""


def chromium(url: str, tmp: Path, *extra: str) -> str:
    exe = require_program("chromium", "chromium", "chromium-browser")
    args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", f"--user-data-dir={tmp}", "--virtual-time-budget=4000", *extra, url]
    # its own session, killed whole on a timeout: chromium's zygote and renderers inherit its pipes, so killing the
    # browser alone leaves communicate() waiting for their EOF (a hung suite instead of a failed test)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"chromium did not finish in 60 s: {err[-2000:]}")
    assert proc.returncode == 0, err[-2000:]
    return out


def test_dashboard_in_chromium_plots_what_stats_reports_while_requests_flow(server: LiveServer, tmp_path: Path):
    locked = chromium(f"{server.base_url}/dashboard", tmp_path / "p0", "--dump-dom")
    page = _Values()
    page.feed(locked)
    assert page.body.get("data-auth") == "needed" and "display: block" in page.styles["key-form"]

    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            mixed_requests(server, max_tokens=2)

    mixed_requests(server, max_tokens=2)
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        url = f"{server.base_url}/dashboard?interval=300#key={KEY}"
        dom = chromium(url, tmp_path / "p1", "--dump-dom")
        shot = tmp_path / "dashboard.png"
        chromium(url, tmp_path / "p2", f"--screenshot={shot}", "--window-size=1400,1700", "--hide-scrollbars")
    finally:
        stop.set()
        worker.join(60)
    print(f"\ndashboard screenshot: {shot}")
    if os.environ.get("FIRSTTOKEN_DASHBOARD_PNG"):
        shutil.copy(shot, os.environ["FIRSTTOKEN_DASHBOARD_PNG"])
    assert shot.stat().st_size > 10_000

    page = _Values()
    page.feed(dom)
    assert page.body.get("data-auth") == "ok"
    seq = int(page.body["data-rendered"])
    assert int(page.values["seq"]) == seq > 0
    records = log_lines(server)[:seq]  # what /stats summarised when the page last polled
    for cls, sfx in dashboard_classes():
        mine = [r for r in records if cls in ("all", r["images"])]
        assert int(page.values["count-all-row" if sfx == "all" else f"count-{sfx}"]) == len(mine), cls
        if not mine:  # a class without traffic (video, here) shows its row empty, not zeros
            assert page.values[f"ttft-p50-{sfx}"] == page.values[f"phase-queue-mean-{sfx}"] == "", cls
            continue
        ttft = [r["timings"]["ttft_s"] for r in mine]
        for q in (50, 95, 99):
            assert float(page.values[f"ttft-p{q}-{sfx}"]) == nearest_rank(ttft, q), (cls, q)
        for p in PHASES:
            phase = [r["timings"][f"{p}_s"] for r in mine]
            assert float(page.values[f"phase-{p}-mean-{sfx}"]) == pytest.approx(sum(phase) / len(phase), rel=1e-12)
    # Time per output token: each request's mean gap between its streamed tokens, as the log has it.
    for cls, sfx in dashboard_classes():
        tpot = [r["itl_mean_s"] for r in records if cls in ("all", r["images"]) and r["itl_mean_s"] is not None]
        assert int(page.values[f"tpot-count-{sfx}"]) == len(tpot) and (len(tpot) > 0 or cls == "video"), cls
        for q in (50, 95, 99):
            got = page.values[f"tpot-p{q}-{sfx}"]
            assert (got == "" if not tpot else float(got) == nearest_rank(tpot, q)), (cls, q)
    stats = httpx.get(f"{server.base_url}/stats", headers=AUTH).json()
    assert page.values["itl-target"] == "" and stats["cost_model"]["itl_target_s"] is None  # off by default
    assert int(page.values["kv-total"]) == stats["engine"]["kv_blocks_total"]
    assert {k.removeprefix("queue-") for k in page.values if k.startswith("queue-")} == set(stats["engine"]["queued_by_lane"])
    prompt = sum(r["prompt_tokens"] for r in records)
    assert float(page.values["prefix-hit-rate"]) == pytest.approx(
        sum(r["timings"]["cached_prompt_tokens"] for r in records) / prompt, rel=1e-12)
    # Predicted vs measured TTFT: the page's error percentiles are the log's, request by request.
    for cls, sfx in dashboard_classes():
        errors = sorted(abs(r["timings"]["predicted_ttft_s"] - r["timings"]["ttft_s"]) / r["timings"]["ttft_s"]
                        for r in records if cls in ("all", r["images"])
                        and r["timings"].get("predicted_ttft_s") is not None)
        assert int(page.values[f"pred-n-{sfx}"]) == len(errors), cls
        for q, key in ((50, "p50"), (90, "p90")):
            want = nearest_rank(errors, q)
            got = page.values[f"pred-err-{key}-{sfx}"]
            assert (got == "" if want is None else float(got) == pytest.approx(want, rel=1e-12)), (cls, q)
        assert int(page.values[f"budget-lowered-{sfx}"]) == 0  # no --ttft-slo: nothing is ever lowered
    assert int(page.values["pred-n-all"]) > 0, "the cost model must be fitted after the warm-up traffic"
    assert int(page.values["refused-over-slo"]) == stats["totals"]["refused_over_slo"] == 0
    assert int(page.values["step-predictions"]) <= stats["cost_model"]["step_prediction"]["n"]


def test_a_fresh_calibrated_server_reports_no_traffic(tiny_model_dir, tmp_path):
    # start-up calibration (the default time-bounded steps) runs synthetic requests through the engine: they train
    # the cost model and nothing else; no count, histogram, window or log line may include them
    log = tmp_path / "requests.jsonl"
    live, srv, thread = start_server(tiny_model_dir, step_time_target="auto", request_log=log)
    try:
        engine = httpx.get(f"{live.base_url}/v1/engine/stats").json()
        assert engine["cost_model"], "the server did not calibrate"
        assert (engine["num_steps"], engine["num_images_encoded"], engine["num_preemptions"]) == (0, 0, 0)
        assert (engine["kv_blocks_cached"], engine["kv_blocks_used"], engine["encoder_cache_bytes"]) == (0, 0, 0)
        assert (engine["encoder_cache_hits"], engine["encoder_cache_misses"], engine["prefix_cache_query_tokens"]) \
            == (0, 0, 0)
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{live.base_url}/metrics").text)}
        assert [s.value for s in families["firsttoken_engine_steps"].samples if s.name.endswith("_total")] == [0]
        assert all(s.value == 0 for s in families["firsttoken_requests"].samples)
        assert all(s.value == 0 for s in families["firsttoken_time_to_first_token_seconds"].samples
                   if s.name.endswith("_count"))
        stats = httpx.get(f"{live.base_url}/stats").json()
        assert stats["classes"]["all"]["count"] == 0
        assert not log.exists() or log.read_text() == ""
        # and the first real request is the first one counted
        c = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
        c.completions.create(model=live.model, prompt="Hello", max_tokens=2)
        live.wait_idle()
        assert len(log.read_text().splitlines()) == 1
        assert httpx.get(f"{live.base_url}/stats").json()["classes"]["all"]["count"] == 1
    finally:
        stop_server(srv, thread, live.engine)


def test_calibration_reaches_no_observer(tiny_model_dir):
    # a Ray replica's recorder counts finished requests at once (no grace period): calibration's must never reach it
    from firsttoken.config import EngineConfig
    from firsttoken.engine.engine import LLMEngine
    from firsttoken.inputs.processor import load_tokenizer
    from firsttoken.metrics.recorder import Recorder

    recorder = Recorder(grace_s=0.0)
    engine = LLMEngine(tiny_model_dir, EngineConfig(dtype="float32"), load_tokenizer(tiny_model_dir), observer=recorder)
    engine.calibrate()
    snap = recorder.snapshot()
    assert engine.scheduler.cost_model.is_trained
    assert snap.counters["steps"] == 0 and sum(snap.requests.values()) == 0
    assert engine.stats().num_steps == 0 and engine.executor.encoder_cache_bytes == 0
