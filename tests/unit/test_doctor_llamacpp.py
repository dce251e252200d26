"""firsttoken doctor on llama.cpp's real /metrics page (tests/fixtures/doctor/llamacpp/, captured from
llama-server after a 12-request `firsttoken bench` run): it names the server, derives what the page allows
(requests served, prompt and generation throughput, the queue) and lists what llama.cpp's metrics cannot show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from firsttoken.cli.main import main
from firsttoken.tools.doctor import doctor_from_texts, format_report

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "doctor" / "llamacpp"
CASE = json.loads((FIXTURE / "case.json").read_text())


def load(name: str = "metrics.txt") -> str:
    return (FIXTURE / name).read_text()


def test_llamacpp_page_is_recognised_with_the_requests_it_served() -> None:
    report = doctor_from_texts(load())
    o = report.obs
    assert o.source == "llamacpp"
    assert o.num_requests == CASE["requests_ok"] == 11  # derived: generated tokens - generation steps
    # computed + prompt-cache tokens are exactly what the client's usage counted, images included
    assert o.prompt_tokens_total == CASE["prompt_tokens_from_usage"]
    assert o.prompt_tokens_mean == pytest.approx(CASE["prompt_tokens_from_usage"] / 11)
    assert o.output_tokens_mean == pytest.approx(CASE["completion_tokens_from_usage"] / 11)
    assert o.prefix_hit_tokens == 155 and o.prefix_query_tokens == CASE["prompt_tokens_from_usage"]
    assert o.num_running == 0 and o.waiting_by_lane == {"all": 0}


def test_throughput_is_per_sequence_from_the_counters() -> None:
    t = doctor_from_texts(load()).obs.throughput
    assert t is not None
    assert t.prompt_tokens == 21985 and t.prompt_s == pytest.approx(119.409)
    assert t.prompt_tokens_per_s == pytest.approx(21985 / 119.409)
    assert t.generation_steps == 352 - 11  # each request's first token comes from its prompt's logits
    assert t.generation_s_per_token == pytest.approx(179.412 / 341)
    assert t.decode_calls == 203 and t.sequences_per_call == pytest.approx(1.78325)


def test_request_count_is_withheld_once_an_earlier_scrape_reset_the_rate_window() -> None:
    report = doctor_from_texts(load("metrics-rescraped.txt"))
    o = report.obs
    assert o.source == "llamacpp" and o.num_requests is None
    assert o.prompt_tokens_mean is None and o.throughput is not None and o.throughput.generation_steps is None
    assert o.cannot_see[0].startswith("requests served")
    text = format_report(report)
    assert "llama.cpp (/metrics), requests not exported" in text
    assert "21,985 tokens computed" in text  # the counters still read


def test_report_says_what_llamacpp_cannot_show() -> None:
    report = doctor_from_texts(load())
    text = format_report(report)
    assert text.splitlines()[0] == "firsttoken doctor: saved metrics: llama.cpp (/metrics), 11 requests"
    assert "unknown server" not in text
    for shown in ("11 finished", "tokens/s", "155 from the prompt cache", "ms per output token",
                  "0 processing, 0 deferred"):  # fmt: skip
        assert shown in text, text
    seen = " ".join(report.obs.cannot_see)
    for blind in ("TTFT", "--probe", "per-class split", "phases", "vision-encoder time", "visual tokens per image",
                  "KV cache usage"):  # fmt: skip
        assert blind in seen
    assert "cannot see here" in text
    assert not report.notes  # requests were served: no "nothing reached a first token" note


def test_no_finding_names_a_firsttoken_flag_for_llamacpp() -> None:
    # as after --probe: follow-ups resent 80% of their prompt and the client saw no cache report
    report = doctor_from_texts(load(), measured_reuse=0.8, measured_hit_rate=0.0)
    assert report.findings == []


def test_an_idle_llamacpp_server_is_named_and_says_nothing_was_served() -> None:
    idle = "\n".join(
        f"# TYPE llamacpp:{name} {kind}\nllamacpp:{name} 0"
        for name, kind in (("prompt_tokens_total", "counter"), ("prompt_seconds_total", "counter"),
                           ("tokens_predicted_total", "counter"), ("tokens_predicted_seconds_total", "counter"),
                           ("prompt_tokens_seconds", "gauge"), ("predicted_tokens_seconds", "gauge"))
    )  # fmt: skip
    report = doctor_from_texts(idle + "\n")
    assert report.obs.source == "llamacpp" and report.obs.num_requests == 0
    assert report.notes and "try --probe" in report.notes[0]


def test_a_page_without_known_names_is_an_unknown_server() -> None:
    report = doctor_from_texts("# TYPE http_requests_total counter\nhttp_requests_total 12\n")
    assert report.obs.source == "prometheus"
    assert "llamacpp:*" in report.obs.cannot_see[0]
    assert "unknown server" in format_report(report)


def test_cli_json_for_a_llamacpp_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--metrics-file", str(FIXTURE / "metrics.txt"), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["source"] == "llamacpp" and body["breakdown"] == {} and body["findings"] == []
    state = body["state"]
    assert state["requests"] == 11 and state["running"] == 0 and state["waiting"] == {"all": 0}
    assert state["throughput"]["prompt_tokens"] == 21985 and state["throughput"]["generation_steps"] == 341
