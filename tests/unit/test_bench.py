"""firsttoken bench against a stub that replays recorded vLLM exchanges (and variants without usage, with
the firsttoken timing extension, with a mid-stream error, cut short). Counts and order, never milliseconds."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from firsttoken.cli.main import main
from firsttoken.tools.bench import (
    BenchConfig,
    format_report,
    parse_mix,
    parse_size,
    run_bench,
)
from firsttoken.tools.bench.calibrate import (
    CALIBRATION_SEED_OFFSET,
    calibrate,
    capacity_rps,
)
from firsttoken.tools.bench.client import RequestRecord
from firsttoken.tools.bench.images import decode_data_url
from firsttoken.tools.bench.sse import SSEEvent, SSEParser
from firsttoken.tools.bench.workload import Workload, count_images
from tests.conftest import VLLM_FIXTURES

FIXTURES = VLLM_FIXTURES
TIMINGS = {"ttft_s": 0.5, "preprocess_s": 0.1, "queue_s": 0.05, "encode_s": 0.2, "prefill_s": 0.1,
           "sample_s": 0.01, "send_s": 0.04, "e2e_s": 0.9, "prefill_steps": 2}


def load_exchange(name: str) -> tuple[int, list[tuple[str, str]], bytes]:
    """(status, headers, body) exactly as recorded in NAME.txt."""
    raw = (FIXTURES / f"{name}.txt").read_bytes()
    head, _, body = raw.partition(b"\n\n")
    lines = head.decode().splitlines()
    status = int(lines[0].split()[1])
    headers = [tuple(part.strip() for part in line.split(":", 1)) for line in lines[1:]]
    return status, headers, body  # type: ignore[return-value]


def request_body(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.txt.request.json").read_text())["body"]


class ReplayServer:
    """POST /v1/chat/completions and GET /v1/models answered from the fixtures; `variant` edits the stream."""

    def __init__(self, variant: str = "vllm") -> None:
        self.variant = variant
        self.received: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._reply(*load_exchange("models"))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                server.received.append(body)
                if body.get("model") == "nope":
                    self._reply(*load_exchange("error-unknown-model"))
                elif body.get("max_tokens", 1) < 1:
                    self._reply(*load_exchange("error-bad-max-tokens"))
                elif body.get("stream"):
                    status, headers, raw = load_exchange("chat-stream-image")
                    self._reply(status, headers, server.edit_stream(raw))
                else:
                    self._reply(*load_exchange("chat-image"))

            def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("content-length", "transfer-encoding", "date", "server"):
                        self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def edit_stream(self, raw: bytes) -> bytes:
        events = [e for e in raw.decode().split("\n\n") if e.strip()]
        if self.variant == "no-usage":
            events = [e for e in events if '"usage"' not in e]
        elif self.variant == "firsttoken":
            out = []
            for e in events:
                if '"usage"' in e:
                    chunk = json.loads(e.removeprefix("data: "))
                    chunk["usage"]["firsttoken"] = TIMINGS
                    e = "data: " + json.dumps(chunk)
                out.append(e)
            events = out
        elif self.variant == "stream-error":
            events = events[:3] + ['data: {"error": {"message": "engine died", "code": 500}}', "data: [DONE]"]
        elif self.variant == "truncated":
            events = events[:4]
        return ("".join(e + "\n\n" for e in events)).encode()

    def __enter__(self) -> "ReplayServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def write_jsonl(path: Path, bodies: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    return str(path)


def file_config(url: str, path: str, **kw: Any) -> BenchConfig:
    return BenchConfig(url=url, workload="file", workload_file=path, concurrency=1, progress=False,
                       num_requests=kw.pop("num_requests", 4), **kw)


@pytest.fixture
def mixed_file(tmp_path: Path) -> str:
    ok = request_body("chat-stream-image")
    return write_jsonl(tmp_path / "w.jsonl", [ok, request_body("error-bad-max-tokens"),
                                              request_body("error-unknown-model"), request_body("chat-image")])


def test_replayed_vllm_stream_errors_and_order(mixed_file: str):
    with ReplayServer() as server:
        report = run_bench(file_config(server.url, mixed_file))
    s = report.summary
    assert report.model == "qwen2vl"  # from the recorded /v1/models
    assert [r.index for r in report.records] == [0, 1, 2, 3]
    assert [b["model"] for b in server.received] == ["qwen2vl", "qwen2vl", "nope", "qwen2vl"]  # bodies keep theirs
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in server.received)
    assert [r.status for r in report.records] == [200, 400, 404, 200]
    assert s.num_requests == 4 and s.num_ok == 2
    assert s.errors == {"http_400": 1, "http_404": 1}
    assert "max_tokens must be at least 1" in (report.records[1].error_message or "")
    assert set(s.classes) == {"0", "1", "all"}
    assert s.classes["1"].num_ok == 2 and s.classes["0"].errors == {"http_400": 1, "http_404": 1}
    for r in (report.records[0], report.records[3]):
        assert r.saw_done and r.finish_reason == "length"
        assert r.output_text == "ax" * 6  # the role-only first chunk carried no content
        assert r.num_content_chunks == 6 and len(r.itl_s) == 5
        assert (r.prompt_tokens, r.completion_tokens, r.tokens_from_usage) == (39, 6, True)
        assert r.ttft_s is not None and r.e2e_s is not None and r.ttft_s <= r.e2e_s
        assert r.server_timings is None
    assert s.classes["all"].completion_tokens == 12 and s.tokens_from_usage
    assert s.classes["all"].itl.count == 10 and s.classes["all"].tpot.count == 2
    assert not s.server_timings_seen and "not reported by this server" in format_report(report)


def test_goodput_counts_errors_as_missing_the_slo(mixed_file: str):
    with ReplayServer() as server:
        lenient = run_bench(file_config(server.url, mixed_file, slo_ttft_s=3600.0, slo_tpot_s=3600.0))
        strict = run_bench(file_config(server.url, mixed_file, slo_ttft_s=1e-9))
        no_slo = run_bench(file_config(server.url, mixed_file))
    assert lenient.summary.goodput_fraction == 0.5 and lenient.summary.classes["1"].num_good == 2
    assert strict.summary.goodput_fraction == 0.0 and strict.summary.goodput_rate == 0.0
    assert no_slo.summary.goodput_fraction is None and no_slo.summary.classes["all"].num_good is None


def test_stream_without_usage_counts_content_chunks(mixed_file: str):
    with ReplayServer("no-usage") as server:
        report = run_bench(file_config(server.url, mixed_file))
    ok = [r for r in report.records if r.ok]
    assert len(ok) == 2
    assert all(r.completion_tokens == 6 and not r.tokens_from_usage and r.prompt_tokens is None for r in ok)
    assert not report.summary.tokens_from_usage
    assert "from content chunks" in format_report(report)


def test_firsttoken_timing_extension_becomes_phase_percentiles(mixed_file: str):
    with ReplayServer("firsttoken") as server:
        report = run_bench(file_config(server.url, mixed_file))
    s = report.summary
    assert s.server_timings_seen
    phases = s.classes["1"].server_phases
    assert {"ttft_s", "preprocess_s", "queue_s", "encode_s", "prefill_s", "sample_s", "send_s", "e2e_s"} <= set(phases)
    assert "prefill_steps" not in phases  # counts are not seconds
    assert phases["encode_s"].count == 2 and phases["encode_s"].p50 == pytest.approx(0.2)
    assert "server phases (usage.firsttoken)" in format_report(report)


@pytest.mark.parametrize("variant, error", [("stream-error", "stream_error"), ("truncated", "incomplete_stream")])
def test_broken_streams_are_errors(tmp_path: Path, variant: str, error: str):
    path = write_jsonl(tmp_path / "w.jsonl", [request_body("chat-stream-image")])
    with ReplayServer(variant) as server:
        report = run_bench(file_config(server.url, path, num_requests=2))
    assert report.summary.errors == {error: 2} and report.summary.num_ok == 0


def test_seed_mix_classes_warmup_and_model(tmp_path: Path):
    config = BenchConfig(url="http://unused", image_size=(64, 48), text_tokens=50, num_requests=12,
                         warmup=3, concurrency=4, progress=False, seed=7)
    expected = [Workload(config).session(i).requests[0].cls for i in range(15)]
    with ReplayServer() as server:
        report = run_bench(BenchConfig(**{**config.__dict__, "url": server.url}))
    assert len(report.records) == 15 and sum(r.warmup for r in report.records) == 3
    assert sorted(r.cls for r in report.records) == sorted(expected)
    s = report.summary
    assert s.num_requests == 12 and s.num_ok == 12
    measured = expected[3:]
    for name in ("text", "1img", "3img"):
        n = measured.count(name)
        assert (s.classes[name].num_requests if name in s.classes else 0) == n
    images = sorted(count_images(b) for b in server.received)
    assert images == sorted({"text": 0, "1img": 1, "3img": 3}[c] for c in expected)
    assert all(b["model"] == "qwen2vl" and b["max_tokens"] == 128 and b["ignore_eos"] for b in server.received)


def test_multiturn_resends_history_and_images():
    with ReplayServer() as server:
        report = run_bench(BenchConfig(url=server.url, workload="multiturn", turns=2, multiturn_images=2,
                                       image_size=(32, 32), text_tokens=20, num_requests=2, concurrency=1,
                                       progress=False))
    assert [(r.session, r.turn, r.cls) for r in report.records] == [
        (0, 0, "first"), (0, 1, "follow-up"), (0, 2, "follow-up"),
        (1, 0, "first"), (1, 1, "follow-up"), (1, 2, "follow-up")]
    third = server.received[2]["messages"]
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[1]["content"] == "ax" * 6  # the server's reply, fed back
    assert count_images(server.received[2]) == 2
    assert third[0] == server.received[0]["messages"][0]  # the same images every turn
    assert report.summary.classes["follow-up"].num_requests == 4


def test_same_seed_same_requests_and_image_sizes():
    config = BenchConfig(url="http://x", image_size=(200, 120), num_requests=10, seed=3,
                         mix=parse_mix("text=1,2img=1"), image_format="png")
    a = [Workload(config).session(i) for i in range(10)]
    b = [Workload(config).session(i) for i in range(10)]
    other = [Workload(BenchConfig(**{**config.__dict__, "seed": 4})).session(i) for i in range(10)]
    assert a == b and a != other
    image_parts = [p for s in a for m in s.requests[0].body["messages"] if isinstance(m["content"], list)
                   for p in m["content"] if p["type"] == "image_url"]
    assert image_parts and all(decode_data_url(p["image_url"]["url"]).size == (200, 120) for p in image_parts)
    assert all(p["image_url"]["url"].startswith("data:image/png;base64,") for p in image_parts)
    assert len({p["image_url"]["url"] for p in image_parts}) == len(image_parts)  # no accidental cache hits
    text = next(s for s in a if s.requests[0].cls == "text").requests[0].body["messages"][0]["content"]
    assert len(text.split()) == 800


def test_video_class_is_one_seeded_clip_of_the_asked_length_size_and_rate_in_a_video_url_part():
    import base64

    from firsttoken.config import VideoConfig
    from firsttoken.inputs.video import plan_video_bytes
    from firsttoken.models.model_config import ImageProcessorConfig

    config = BenchConfig(url="http://x", mix=parse_mix("text=1,video=1"), num_requests=6, seed=5,
                         video_seconds=1.5, video_size=(96, 64), video_fps=8)
    a = [Workload(config).session(i).requests[0] for i in range(6)]
    b = [Workload(config).session(i).requests[0] for i in range(6)]
    other = [Workload(BenchConfig(**{**config.__dict__, "seed": 6})).session(i).requests[0] for i in range(6)]
    assert a == b and a != other  # the same seed sends the same bytes
    videos = [r for r in a if r.cls == "video"]
    assert videos and all((r.num_videos, r.num_images) == (1, 0) for r in videos)
    urls = []
    for r in videos:
        (message,) = r.body["messages"]
        video, text = message["content"]
        assert video["type"] == "video_url" and text["type"] == "text" and len(text["text"].split()) == 32
        urls.append(video["video_url"]["url"])
    assert len(set(urls)) == len(urls)  # a clip per session: no accidental encoder-cache hits
    head, _, data = urls[0].partition(",")
    assert head == "data:video/mp4;base64"
    header, _, plan = plan_video_bytes(base64.b64decode(data), VideoConfig(), ImageProcessorConfig())
    assert (header.width, header.height, header.fps, header.num_frames) == (96, 64, 8.0, 12)
    assert plan.num_frames == 4  # what the server samples from it at 2 fps (its minimum)
    assert Workload(config).describe()["video_size"] == "96x64"
    with pytest.raises(ValueError, match="even"):
        BenchConfig(url="http://x", video_size=(95, 64))


def test_workload_file_bodies_with_video_parts_are_the_video_class(tmp_path: Path):
    path = tmp_path / "w.jsonl"
    clip = {"type": "video_url", "video_url": {"url": "file:///clip.mp4"}}
    frames = {"type": "video", "video": ["data:image/png;base64,AA==", "data:image/png;base64,AA=="]}
    lines = [{"messages": [{"role": "user", "content": [clip, {"type": "text", "text": "what happens?"}]}]},
             {"messages": [{"role": "user", "content": [frames]}]},
             {"messages": [{"role": "user", "content": "hi"}]}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    w = Workload(BenchConfig(url="http://x", workload="file", workload_file=str(path)))
    assert [(r.cls, r.num_videos) for r in (w.session(i).requests[0] for i in range(3))] == [
        ("video", 1), ("video", 1), ("0", 0)]


def test_big_image_has_requested_size():
    config = BenchConfig(url="http://x", mix=parse_mix("1img=1"), image_size=(1024, 768))
    url = Workload(config).session(0).requests[0].body["messages"][0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,") and decode_data_url(url).size == (1024, 768)


def test_sse_parser_framing():
    p = SSEParser()
    lines = [": keep-alive", "event: error", "data: {\"a\":", "data: 1}", "", "data: [DONE]"]
    events = [e for e in (p.feed_line(line) for line in lines) if e is not None]
    assert events == [SSEEvent('{"a":\n1}', "error")]
    assert p.flush() == SSEEvent("[DONE]") and p.flush() is None


def test_parse_flags():
    assert parse_mix("text=2,1img=1,3img=1") == (("text", 0.5), ("1img", 0.25), ("3img", 0.25))
    assert parse_size("1024x768") == (1024, 768)
    assert parse_mix("text=1,video=1") == (("text", 0.5), ("video", 0.5))
    with pytest.raises(ValueError):
        parse_mix("audio=1")
    with pytest.raises(ValueError):
        parse_size("big")


def test_cli_writes_report_json_and_plot(tmp_path: Path, mixed_file: str, capsys: pytest.CaptureFixture[str]):
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    with ReplayServer() as server:
        rc = main(["bench", "--url", server.url + "/v1", "--workload-file", mixed_file, "--num-requests", "4",
                   "--concurrency", "2", "--json", str(out_json), "--plot", str(out_png), "--no-progress",
                   "--slo-ttft", "60"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "class 1: 2 requests, 2 ok" in stdout and "goodput (TTFT <= 60.0s)" in stdout
    data = json.loads(out_json.read_text())
    assert data["summary"]["errors"] == {"http_400": 1, "http_404": 1}
    assert len(data["records"]) == 4 and data["workload"]["bodies"] == 4
    assert out_png.stat().st_size > 1000


# ------------------------------------------------------------------------------ --utilization (calibrate.py)


class FakeProbe:
    """Stands in for sending: answers each probe config with records whose e2e seconds are given per class."""

    def __init__(self, e2e_s: dict[str, list[list[float]]], errors: dict[str, str] | None = None) -> None:
        self.e2e_s = e2e_s  # class -> per measured session, its requests' e2e seconds
        self.errors = errors or {}
        self.configs: list[BenchConfig] = []

    async def __call__(self, config: BenchConfig) -> list[RequestRecord]:
        self.configs.append(config)
        cls = config.mix[0][0] if config.workload == "seed-mix" else config.workload
        records = [RequestRecord(0, 0, 0, cls, 0, True, 0.0, e2e_s=99.0)]  # the warm-up: never counted
        for session, turns in enumerate(self.e2e_s[cls], start=config.warmup):
            for turn, e2e in enumerate(turns):
                records.append(RequestRecord(len(records), session, turn, cls, 0, False, 0.0, e2e_s=e2e,
                                             error=self.errors.get(cls)))
        return records


def test_utilization_rate_is_u_over_the_mix_weighted_unloaded_service_time():
    config = BenchConfig(url="http://x", utilization=0.6, seed=5, rate=None, slo_ttft_s=1.0)
    probe = FakeProbe({"text": [[0.4], [0.6], [0.5]], "1img": [[2.0]] * 3, "3img": [[4.0], [6.0], [5.0]]})
    cal = asyncio.run(calibrate(config, probe))
    assert cal.service_s == pytest.approx({"text": 0.5, "1img": 2.0, "3img": 5.0})
    assert cal.shares == {"text": 0.5, "1img": 0.3, "3img": 0.2}
    assert cal.capacity_rps == pytest.approx(1 / (0.5 * 0.5 + 0.3 * 2.0 + 0.2 * 5.0))  # 1 / 1.85 s
    assert cal.rate == pytest.approx(0.6 / 1.85) and cal.utilization == 0.6 and cal.num_probes == 3
    assert capacity_rps({"a": 0.25, "b": 0.75}, {"a": 4.0, "b": 0.0}) == 1.0
    # each class alone, one session at a time after one warm-up, on images the measured run never sends
    assert [c.mix for c in probe.configs] == [(("text", 1.0),), (("1img", 1.0),), (("3img", 1.0),)]
    for c in probe.configs:
        assert (c.concurrency, c.rate, c.utilization, c.warmup, c.num_requests) == (1, None, None, 1, 3)
        assert c.seed == 5 + CALIBRATION_SEED_OFFSET and c.slo_ttft_s is None


def test_multiturn_service_time_is_a_whole_conversation_alone():
    config = BenchConfig(url="http://x", workload="multiturn", utilization=1.0, calibration_requests=2)
    cal = asyncio.run(calibrate(config, FakeProbe({"multiturn": [[1.0, 0.5, 0.5], [2.0, 1.0, 1.0]]})))
    assert cal.service_s == {"multiturn": 3.0} and cal.rate == pytest.approx(1 / 3.0)


def test_failed_probe_refuses_to_calibrate_and_rate_excludes_utilization():
    probe = FakeProbe({"text": [[0.1]], "1img": [[0.1]], "3img": [[0.1]]}, errors={"1img": "http_400"})
    with pytest.raises(ValueError, match="class 1img: 1 of 1 probe requests failed"):
        asyncio.run(calibrate(BenchConfig(url="http://x", utilization=0.5), probe))
    with pytest.raises(ValueError, match="rate or utilization"):
        BenchConfig(url="http://x", rate=0.4, utilization=0.5)
    with pytest.raises(ValueError, match="utilization must be > 0"):
        BenchConfig(url="http://x", utilization=0.0)


def test_cli_utilization_measures_each_class_alone_then_records_the_rate(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]):
    out_json = tmp_path / "run.json"
    with ReplayServer() as server:
        rc = main(["bench", "--url", server.url, "--utilization", "0.5", "--calibration-requests", "2",
                   "--num-requests", "4", "--image-size", "32x32", "--text-tokens", "10", "--no-progress",
                   "--json", str(out_json)])
    assert rc == 0
    # 3 classes x (1 warm-up + 2 probes), sent class by class, then the 4 measured requests
    probes = [count_images(b) for b in server.received[:9]]
    assert probes == [0, 0, 0, 1, 1, 1, 3, 3, 3] and len(server.received) == 13
    data = json.loads(out_json.read_text())
    cal = data["calibration"]
    assert set(cal) == {"utilization", "shares", "service_s", "num_probes", "capacity_rps", "rate"}
    assert cal["utilization"] == 0.5 and cal["num_probes"] == 2 and set(cal["service_s"]) == {"text", "1img", "3img"}
    assert cal["capacity_rps"] == pytest.approx(1 / sum(cal["shares"][c] * cal["service_s"][c] for c in cal["shares"]))
    assert cal["rate"] == pytest.approx(0.5 * cal["capacity_rps"]) and data["rate"] == cal["rate"]
    assert data["config"]["utilization"] == 0.5 and data["config"]["rate"] is None
    assert data["summary"]["num_requests"] == 4 and len(data["records"]) == 4  # probes are not the run's records
    stdout = capsys.readouterr().out
    assert "calibrated: unloaded service time" in stdout and "utilization 0.5 -> Poisson" in stdout
