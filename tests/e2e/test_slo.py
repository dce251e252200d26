"""Predicted TTFT through the real server: /tokenize answers "how long if I send this now?", usage reports the
prediction beside the measure, and with --ttft-slo a request predicted over its objective gets a 429 with
Retry-After (and an image request first gets a smaller visual-token budget)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from firsttoken.tools.doctor import doctor_from_texts
from firsttoken.tools.doctor.report import format_report
from tests.e2e.conftest import image_message, make_image, start_server, stop_server


@pytest.fixture(scope="module")
def timed_server(tiny_model_dir):
    live, server, thread = start_server(tiny_model_dir, step_time_target="auto")  # the production default
    yield live
    stop_server(server, thread, live.engine)


def test_tokenize_and_usage_carry_the_predicted_ttft(timed_server):
    live = timed_server
    body = {"model": live.model, "messages": image_message("What is this?", make_image(128, 96))}
    predicted = httpx.post(f"{live.base_url}/tokenize", json=body).json()["predicted_ttft_s"]
    assert isinstance(predicted, float) and predicted > 0  # the server calibrated its cost model at start-up
    out = live.client().chat.completions.create(model=live.model, messages=body["messages"], max_tokens=4,
                                                temperature=0)
    timings = out.usage.model_extra["firsttoken"]
    assert timings["predicted_ttft_s"] > 0 and timings["ttft_s"] > 0
    stats = httpx.get(f"{live.base_url}/stats").json()["cost_model"]
    assert stats["step_time_target_s"] > 0 and stats["coefficients"]["step"] >= 0
    assert stats["step_prediction"]["n"] > 0
    assert stats["ttft_prediction"]["1"]["n"] == 1 and stats["ttft_prediction"]["0"]["n"] == 0
    # the first token taught the one-image class's correction one step (up or down), and /metrics shows it
    assert list(stats["ttft_bias"]) == ["1"]
    assert stats["ttft_bias"]["1"] == pytest.approx(math.exp(0.05)) or \
        stats["ttft_bias"]["1"] == pytest.approx(math.exp(-0.05))
    metrics = {s.labels["images"]: s.value for f in text_string_to_metric_families(
        httpx.get(f"{live.base_url}/metrics").text) if f.name == "firsttoken_ttft_prediction_bias" for s in f.samples}
    assert metrics == pytest.approx(stats["ttft_bias"])
    # doctor shows the fit and the prediction the request got, from the same /metrics
    report = doctor(live)
    prediction = report.to_dict()["state"]["prediction"]
    assert prediction["ttft"]["1"]["n"] == 1 and prediction["ttft"]["0"]["n"] == 0
    assert prediction["step"]["n"] == stats["step_prediction"]["n"]
    assert prediction["step_time_target_s"] == pytest.approx(stats["step_time_target_s"])
    text = format_report(report)
    assert "step-cost model         predicted/actual step time:" in text
    assert "predicted TTFT 1 image  predicted/measured:" in text and "(n=1)" in text
    assert "image budget lowered for 0 requests; 0 refused (429)" in text


def doctor(live):
    return doctor_from_texts(httpx.get(f"{live.base_url}/metrics").text, httpx.get(f"{live.base_url}/stats").json(),
                             url=live.base_url)


def test_over_the_objective_a_request_is_refused_with_retry_after(tiny_model_dir):
    live, server, thread = start_server(tiny_model_dir, ttft_slo="text=0.000001,image=0.000001")
    try:
        with pytest.raises(openai.RateLimitError) as err:
            live.client().chat.completions.create(model=live.model, messages=image_message("Hi", make_image(96, 96)),
                                                  max_tokens=4)
        response = err.value.response
        assert int(response.headers["retry-after"]) >= 1
        assert "objective" in response.json()["error"]["message"]
        metrics = httpx.get(f"{live.base_url}/metrics").text
        assert 'firsttoken_rejections_total{reason="over_slo"} 1.0' in metrics
        assert live.stats()["num_running"] == 0 and live.stats()["num_waiting"] == 0
        assert doctor(live).to_dict()["state"]["ttft_objective"] == {"image_budget_lowered": 0, "refused": 1}
        assert "image budget lowered for 0 requests; 1 refused (429)" in format_report(doctor(live))
    finally:
        stop_server(server, thread, live.engine)
