"""The fleet simulator: firsttoken's own scheduler on a virtual clock, priced by a step-cost profile. Checked by
arithmetic against the cost model, by counts and order of routing, and end to end through `firsttoken simulate`
with a profile read from a live server's /stats. Its error against measured runs is a benchmark
(benchmarks/validate_simulator.py), not a test: it depends on the machine's speed."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import httpx
import pytest

from firsttoken.cli.main import main
from firsttoken.config import SchedulerConfig
from firsttoken.models.registry import load_model_config
from firsttoken.scheduler.cost_model import CostModel, prefill_chunk
from firsttoken.tools import simulate as sim

COEF = {"step": 0.01, "sequences": 0.001, "sampled": 0.0005, "prefill_tokens": 2e-4, "prefill_attention": 1e-9,
        "decode_tokens": 0.002, "decode_context": 1e-7, "encoder_patches": 2e-5, "encoder_attention": 1e-10}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model_config(tiny_model_dir)


def profile(**kw) -> sim.Profile:
    return sim.Profile(COEF, SchedulerConfig(step_time_target="off"), preprocess_s={"0": 0.01, "1": 0.05, "2+": 0.1},
                       **kw)


def text_request(rid: str, t: float, tokens: int = 100, output: int = 4) -> sim.SimRequest:
    return sim.SimRequest(rid, t, "text", tokens, (), output)


def test_a_lone_request_costs_its_preprocess_plus_the_cost_models_prefill_step():
    p = profile()
    result = sim.simulate([text_request("a", 5.0, tokens=300, output=3)], [p], sim.Router("round-robin"))
    (outcome,) = result.outcomes
    prefill = CostModel(prior=p.prior).predict(prefill_chunk(300, 0, True))
    assert outcome.ttft_s == pytest.approx(0.01 + prefill, rel=1e-12)
    assert outcome.e2e_s > outcome.ttft_s and result.replica_steps == [3 + 1]  # prefill, 2 decodes, the release


def test_each_token_is_timed_so_the_gaps_between_them_add_up_to_the_answer_after_its_first_token():
    result = sim.simulate([text_request("a", 5.0, tokens=300, output=4)], [profile()], sim.Router("round-robin"))
    (outcome,) = result.outcomes
    assert len(outcome.token_s) == 4 and outcome.token_s[0] == outcome.ttft_s
    assert len(outcome.itl_s) == 3 and sum(outcome.itl_s) == pytest.approx(outcome.e2e_s - outcome.ttft_s, rel=1e-9)
    text = result.summary()["classes"]["text"]
    assert text["itl_n"] == 3 and text["itl_p99"] == max(outcome.itl_s)


def test_every_request_is_answered_and_the_run_is_deterministic(model):
    workload = sim.seed_mix(model, rate=4.0, num_requests=60, seed=3)
    assert Counter(r.cls for r in workload) == Counter({"text": 29, "1img": 23, "3img": 8})  # seeded draws
    runs = [sim.simulate(workload, [profile()] * 2, sim.Router("least-loaded")) for _ in range(2)]
    assert [o.ttft_s for o in runs[0].outcomes] == [o.ttft_s for o in runs[1].outcomes]
    summary = runs[0].summary()["classes"]
    assert {c: (s["sent"], s["n"], s["refused"]) for c, s in summary.items()} == {
        "text": (29, 29, 0), "1img": (23, 23, 0), "3img": (8, 8, 0)}
    assert all(o.e2e_s >= o.ttft_s > 0 for o in runs[0].outcomes)


def test_round_robin_spreads_evenly_and_least_loaded_avoids_a_busy_replica():
    burst = [text_request(f"r{i}", 1.0, tokens=400) for i in range(9)]
    result = sim.simulate(burst, [profile()] * 3, sim.Router("round-robin"))
    assert Counter(o.replica for o in result.outcomes) == {0: 3, 1: 3, 2: 3}
    # least-loaded: six requests arriving together land two per replica (the router counts what it sent)
    result = sim.simulate(burst[:6], [profile()] * 3, sim.Router("least-loaded"))
    assert [o.replica for o in result.outcomes] == [0, 1, 2, 0, 1, 2]


def test_lane_pools_keep_image_prompts_off_the_short_replicas(model):
    workload = sim.seed_mix(model, rate=2.0, num_requests=40, seed=1)
    pools = {"short": [0], "long": [1, 2]}
    result = sim.simulate(workload, [profile()] * 3, sim.Router("least-loaded", pools, long_prompt_threshold=1024))
    for o in result.outcomes:
        expected = pools["long"] if o.request.num_prompt_tokens >= 1024 else pools["short"]
        assert o.replica in expected, (o.request.cls, o.request.num_prompt_tokens, o.replica)
    assert {o.replica for o in result.outcomes if o.request.cls == "text"} == {0}


def test_a_prompt_larger_than_the_pool_is_refused_like_the_server_refuses_it():
    result = sim.simulate([text_request("huge", 0.0, tokens=5000)], [profile(num_kv_blocks=64)],
                          sim.Router("round-robin"))
    assert result.outcomes[0].refused == "never_fits" and result.outcomes[0].ttft_s is None


def test_profile_from_a_live_servers_stats_drives_the_cli(tiny_model_dir, tmp_path, capsys):
    from tests.e2e.conftest import start_server, stop_server

    live, server, thread = start_server(tiny_model_dir)
    try:
        client = live.client()
        for i in range(3):  # enough steps for the server to fit its step-cost model
            client.chat.completions.create(model=live.model, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": f"Describe the sea {i}."}])
        stats = httpx.get(f"{live.base_url}/stats").json()
        assert stats["cost_model"]["coefficients"], "the server fits its cost model from its own steps"
        out = tmp_path / "sim.json"
        saved = tmp_path / "profile.json"
        code = main(["simulate", "--model", str(tiny_model_dir), "--profile", live.base_url, "--rate", "2",
                     "--num-requests", "30", "--replicas", "1,2", "--search-pools", "--target-p99",
                     "text=600,image=600", "--json", str(out), "--save-profile", str(saved)])
    finally:
        stop_server(server, thread, live.engine)
    assert code == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["replicas"], r["pools"]) for r in rows] == [(1, None), (2, None), (2, {"short": 1, "long": 1})]
    # which rows meet the target depends on the coefficients the live server fitted from its own step timings (a
    # few noisy steps on a loaded machine once predicted minutes per request): the conclusion must be the rows' own
    assert all(r["meets"] is not None for r in rows)
    meeting = [r for r in rows if r["meets"]]
    if meeting:
        best = min(meeting, key=lambda r: (r["replicas"], max(c["p99"] or 0 for c in r["classes"].values())))
        pools = f"{best['pools']['short']} short + {best['pools']['long']} long" if best["pools"] else "one pool"
        assert f"fewest replicas meeting P99 text=600,image=600: {best['replicas']} ({pools})" in text
    else:
        assert "no configuration simulated meets P99 text=600,image=600" in text
    assert sum(c["n"] for c in rows[0]["classes"].values()) == 30
    # the server saw chat prompts (and at most its start-up calibration's small image): the workload's 1024x1024
    # images need vision-tower work far beyond what its fit saw, and the CLI says so before the table
    coverage = stats["cost_model"]["coverage"]
    assert coverage["prefill_tokens"]["steps"] > 0 and coverage["prefill_tokens"]["max"] > 0
    warned = json.loads(out.read_text())["warnings"]
    assert any(w.startswith("encoder_attention: ") for w in warned)
    assert text.index("warning: encoder_attention: ") < text.index("fewest replicas") if meeting else True
    # the saved profile reproduces the same simulation
    assert main(["simulate", "--model", str(tiny_model_dir), "--profile", str(saved), "--rate", "2",
                 "--num-requests", "30", "--json", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())["rows"][0]
    assert again["classes"] == rows[0]["classes"]


@pytest.mark.parametrize("argv, message", [
    (["--rate", "0"], "--rate"),
    (["--rate", "1", "--replicas", "0"], "replica counts >= 1"),
    (["--rate", "1", "--replicas", "3", "--pools", "1,1"], "add up to 2"),
    (["--rate", "1", "--target-p99", "video=3"], "classes are text and image"),
    (["--rate", "1", "--image-size", "big"], "WIDTHxHEIGHT"),
])
def test_cli_mistakes_are_one_line(tiny_model_dir, tmp_path, capsys, argv, message):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"coefficients": COEF, "num_kv_blocks": 512}))
    code = main(["simulate", "--model", str(tiny_model_dir), "--profile", str(prof), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_profile_without_a_fitted_cost_model_is_refused(tiny_model_dir, tmp_path, capsys):
    prof = tmp_path / "stats.json"
    prof.write_text(json.dumps({"cost_model": {"coefficients": {}}, "engine": {"kv_blocks_total": 64}}))
    assert main(["simulate", "--model", str(tiny_model_dir), "--profile", str(prof), "--rate", "1"]) == 2
    assert "had not fitted its cost model" in capsys.readouterr().err


def test_router_rejects_an_unknown_policy():
    with pytest.raises(ValueError, match="round-robin, least-loaded, p2c, least-work"):
        sim.Router("random")



# A replica of the `small` checkpoint on an AVX2 machine, as its start-up calibration fitted it (seconds per unit).
SMALL_AVX2 = {"step": 0.01745, "sequences": 0.0, "sampled": 0.0, "prefill_tokens": 3.827e-4,
              "prefill_attention": 1.551e-7, "decode_tokens": 0.0, "decode_context": 1.373e-8,
              "encoder_patches": 6.62e-6, "encoder_attention": 1.01e-10}


@pytest.mark.parametrize("utilization", [0.6, 0.8])
def test_predicted_ttft_matches_a_world_that_costs_what_the_model_says(utilization):
    """The admission check's prediction, for the seed mix with time-bounded steps (the default), in a world whose
    steps cost exactly what the cost model predicts: issue 15's targets hold per class at U = 0.6 and 0.8 (median
    |error| <= 15%, P90 <= 35%). The backlog a prediction reads excludes the work of the step in flight (that is the
    residual): counting it twice put the one-image P90 at 35.2% once a lone request's throughput step held a whole
    prompt, and text's P90 at 15% at U = 0.8."""
    from firsttoken.models.qwen2_vl_checkpoint import SIZES, build_hf_config
    from firsttoken.models.registry import model_config_from_dict

    model = model_config_from_dict(build_hf_config(SIZES["small"]).to_dict())  # the shapes alone, no weights
    # the prediction as the cost model makes it (--ttft-bias-step 0): in this world it has no bias to learn
    p = sim.Profile(SMALL_AVX2, SchedulerConfig(ttft_bias_step=0.0), num_kv_blocks=8192,
                    preprocess_s={"0": 0.01, "1": 0.12, "2+": 0.4})
    capacity = sim.capacity_rps(p, sim.seed_mix(model, rate=1.0, num_requests=300, seed=1))
    assert 0.2 < capacity < 1.0  # requests/s (the server these coefficients came from measured 0.36 under load)
    workload = sim.seed_mix(model, rate=utilization * capacity, num_requests=600, seed=1)
    classes = sim.simulate(workload, [p], sim.Router("round-robin")).summary()["classes"]
    errors = {cls: (c["prediction_error_p50"], c["prediction_error_p90"]) for cls, c in classes.items()}
    assert set(errors) == {"text", "1img", "3img"}
    assert all(p50 <= 0.15 for p50, _ in errors.values()), errors
    assert all(p90 <= 0.35 for _, p90 in errors.values()), errors


def test_the_cost_model_reports_what_its_fit_has_seen_per_term():
    cm = CostModel(refit_every=1)
    for tokens in (100, 300, 200):
        cm.observe(prefill_chunk(tokens, 0, True), 0.01 + tokens * 1e-4)
    coverage = cm.coverage
    assert coverage["prefill_tokens"] == {"steps": 3, "max": 300.0}
    assert coverage["encoder_patches"] == {"steps": 0, "max": 0.0}
    cm.reset()
    assert cm.coverage == {}


def test_a_simulation_reports_the_largest_work_it_priced_per_term():
    result = sim.simulate([text_request("a", 0.0, tokens=300, output=3)], [profile()], sim.Router("round-robin"))
    assert result.max_terms["prefill_tokens"] == 300 and result.max_terms["decode_tokens"] == 1
    assert result.max_terms["decode_context"] == 301  # the last decode step: the prompt and one generated token
    assert result.max_terms["encoder_patches"] == 0 == result.max_terms["encoder_attention"]


def test_prices_beyond_what_the_profile_saw_are_named():
    seen = {"prefill_tokens": {"steps": 40, "max": 1000.0}, "encoder_patches": {"steps": 0, "max": 0.0},
            "encoder_attention": {"steps": 5, "max": 1e5}}
    p = profile(coverage=seen)
    warned = p.extrapolations({"prefill_tokens": 3000.0, "encoder_patches": 5000.0, "encoder_attention": 3e7,
                               "decode_tokens": 0.0})
    assert len(warned) == 2
    assert warned[0].startswith("encoder_patches: the profile's fit saw no step with it")
    assert warned[1].startswith("encoder_attention: the workload needs up to 3e+07 per step, 300x the largest")
    assert p.extrapolations({"prefill_tokens": 4000.0}) == []  # 4x what was seen: still within the factor
    assert profile().extrapolations({"encoder_patches": 5000.0}) == []  # a profile that does not say: no guess


def test_the_cli_warns_before_the_table_when_the_profile_never_saw_the_workloads_images(tiny_model_dir, tmp_path,
                                                                                      capsys):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"coefficients": COEF, "num_kv_blocks": 512, "coverage": {
        "prefill_tokens": {"steps": 50, "max": 2048.0}, "encoder_patches": {"steps": 0, "max": 0.0},
        "encoder_attention": {"steps": 0, "max": 0.0}}}))
    out = tmp_path / "sim.json"
    assert main(["simulate", "--model", str(tiny_model_dir), "--profile", str(prof), "--rate", "1",
                 "--num-requests", "12", "--json", str(out)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("warning: encoder_patches: the profile's fit saw no step with it")
    assert text[1].startswith("warning: encoder_attention: the profile's fit saw no step with it")
    assert [w.split(":")[0] for w in json.loads(out.read_text())["warnings"]] == ["encoder_patches",
                                                                                 "encoder_attention"]


def test_over_its_objective_an_image_request_is_re_planned_at_lower_budgets_before_it_is_refused():
    """As the server's input processor: a burst of three-image requests against an objective of 1.5 x one alone.
    With the checkpoint's config in the profile the later ones are admitted at halved budgets (the outcome says
    which); without it (a profile that cannot re-plan images) they are refused."""
    from firsttoken.models.qwen2_vl_checkpoint import SIZES, build_hf_config
    from firsttoken.models.registry import model_config_from_dict

    model = model_config_from_dict(build_hf_config(SIZES["small"]).to_dict())
    burst = [replace(r, arrival_s=0.1 * i) for i, r in
             enumerate(sim.seed_mix(model, rate=1.0, num_requests=8, seed=0, mix=(("3img", 3, 1.0),)))]
    base = sim.Profile(SMALL_AVX2, SchedulerConfig(), num_kv_blocks=8192)
    alone = sim.simulate(burst[:1], [base], sim.Router("round-robin")).outcomes[0].ttft_s
    slo = SchedulerConfig(ttft_slo=f"text=10,image={1.5 * alone:.3f}", ttft_slo_wait_margin=0.0)
    refusing = sim.simulate(burst, [replace(base, scheduler=slo)], sim.Router("round-robin")).outcomes
    degrading = sim.simulate(burst, [replace(base, scheduler=slo, model=model)], sim.Router("round-robin")).outcomes
    assert [o.image_budget for o in refusing] == [None] * 8 and sum(o.refused == "over_slo" for o in refusing) >= 4
    lowered = [o.image_budget for o in degrading if o.image_budget is not None]
    assert lowered and all(b in (640, 320, 256) for b in lowered)  # 1280 halved, down to the floor (256)
    assert sum(o.refused is None for o in degrading) > sum(o.refused is None for o in refusing)
    assert all(o.ttft_s <= 1.2 * 1.5 * alone for o in degrading if o.refused is None)
