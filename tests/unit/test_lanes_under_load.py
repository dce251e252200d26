"""The lanes under load, work-conserving by construction (issue 52): firsttoken's own scheduler on the simulator's
virtual clock, the seed's mix at loads calibrated to the profile's capacity, seeded arrivals. Checked by counts: the
long lane's steps while the short lane has no prefill work are throughput-sized, the engine never idles while it has
work, and the work the lanes price for the whole run stays within a stated bound of fcfs's on the same arrivals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from firsttoken.config import SchedulerConfig
from firsttoken.models.registry import load_model_config
from firsttoken.scheduler.request import LONG, SHORT
from firsttoken.tools import simulate as sim

COEF = {"step": 0.01, "sequences": 0.001, "sampled": 0.0005, "prefill_tokens": 2e-4, "prefill_attention": 1e-9,
        "decode_tokens": 0.002, "decode_context": 1e-7, "encoder_patches": 2e-5, "encoder_attention": 1e-10}
WORK_BOUND = 1.05  # the lanes' priced busy seconds over fcfs's, same arrivals: per-step constants of extra steps


class Counting(sim.SimReplica):
    """A replica that counts, at each step it starts: whether only the long lane had prefill work (and if so whether
    the step was sized for throughput), and whether it had work but started nothing."""

    counts: dict[str, int] = {"idle_with_work": 0, "long_only_steps": 0, "long_only_steps_bounded": 0}
    last: "Counting | None" = None  # the replica that started the last step

    def start_step(self, now: float) -> float | None:
        s = self.scheduler
        live = list(s.running) + list(s.waiting)
        long_only = (s.lanes.names == (SHORT, LONG) and any(r.lane == LONG and not r.is_decoding for r in live)
                     and not any(r.lane == SHORT and not r.is_decoding for r in live))
        end = super().start_step(now)
        c = Counting.counts
        Counting.last = self
        c["idle_with_work"] += end is None and s.has_work
        if long_only and end is not None:
            c["long_only_steps"] += 1
            c["long_only_steps_bounded"] += not s.last_step.throughput
        return end


def run(workload, profile) -> tuple[sim.SimResult, dict[str, int]]:
    Counting.counts = dict.fromkeys(Counting.counts, 0)
    return sim.simulate(workload, [profile], sim.Router("round-robin")), dict(Counting.counts)


# step-cost models fitted on the machines this project meets, one per CPU class, dtype and thread count measured
MEASURED = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "cost_models.json").read_text())["models"]
PROFILES = {"synthetic": (COEF, 2), **{name: (m["coefficients"], 1) for name, m in MEASURED.items()}}


@pytest.mark.parametrize("utilization", [0.6, 0.8])
@pytest.mark.parametrize("machine", list(PROFILES))
def test_the_long_lane_runs_at_its_own_speed_whenever_no_short_prompt_waits(tiny_model_dir, monkeypatch,
                                                                             utilization, machine):
    """By construction on every machine: the step bound and the throughput chunk come from the machine's own cost
    model (injected here, as fitted on each CPU class, dtype and thread count in tests/fixtures/cost_models.json)."""
    monkeypatch.setattr(sim, "SimReplica", Counting)
    model = load_model_config(tiny_model_dir)
    coefficients, num_seeds = PROFILES[machine]
    lanes = sim.Profile(coefficients, SchedulerConfig(), preprocess_s={"0": 0.01, "1": 0.05, "2+": 0.1})  # defaults
    fcfs = sim.replace_scheduler(lanes, scheduling="fcfs")
    for seed in range(num_seeds):
        capacity = sim.capacity_rps(lanes, sim.seed_mix(model, rate=1.0, num_requests=80, seed=seed))
        workload = sim.seed_mix(model, rate=utilization * capacity, num_requests=80, seed=seed)
        with_lanes, counts = run(workload, lanes)
        alone, fcfs_counts = run(workload, fcfs)
        assert counts["long_only_steps"] > 50  # the mix leaves the long lane on its own often
        assert counts["long_only_steps_bounded"] == 0  # each of those steps was sized for throughput
        assert counts["idle_with_work"] == 0 == fcfs_counts["idle_with_work"]
        assert all(o.ttft_s is not None for o in with_lanes.outcomes + alone.outcomes)
        assert sum(with_lanes.replica_busy_s) <= WORK_BOUND * sum(alone.replica_busy_s)


def doctor_sees(scheduler) -> tuple[object, list]:
    """What doctor reads of a replica's long-lane-only counters from the /metrics page its stats would export."""
    from prometheus_client import generate_latest

    from firsttoken.api.observability import engine_snapshot
    from firsttoken.metrics.prometheus import make_registry
    from firsttoken.metrics.recorder import Recorder
    from firsttoken.tools.doctor import doctor_from_texts

    snapshot = engine_snapshot(scheduler.stats())
    report = doctor_from_texts(generate_latest(make_registry(Recorder(window_s=60), lambda: snapshot)).decode())
    return report.obs, [f for f in report.findings if f.key == "long_lane"]


@pytest.mark.parametrize(("flags", "change"), [({}, None), ({"step_time_target": "0.05"}, "--step-time-target auto"),
                                              ({"itl_target": "0.03"}, "--itl-target off")],
                         ids=["default", "fixed-bound", "paced"])
def test_doctor_says_how_far_below_its_throughput_the_long_lane_ran(tiny_model_dir, monkeypatch, flags, change):
    """The scheduler counts the steps in which only the long lane had prefill work, by how they were sized, with
    their wall seconds and what their work would take in throughput steps; doctor turns that into "the long lane
    ran N% below its throughput" and names the setting that bounded those steps."""
    monkeypatch.setattr(sim, "SimReplica", Counting)
    model = load_model_config(tiny_model_dir)
    profile = sim.Profile(COEF, SchedulerConfig(**flags), preprocess_s={"0": 0.01, "1": 0.05, "2+": 0.1})
    capacity = sim.capacity_rps(profile, sim.seed_mix(model, rate=1.0, num_requests=60, seed=0))
    workload = sim.seed_mix(model, rate=0.8 * capacity, num_requests=60, seed=0)
    run(workload, profile)
    replica = Counting.last
    counted = replica.scheduler.stats().long_lane_only
    assert counted["throughput"]["steps"] + counted["bounded"]["steps"] == Counting.counts["long_only_steps"]
    assert counted["bounded"]["steps"] == Counting.counts["long_only_steps_bounded"]
    obs, findings = doctor_sees(replica.scheduler)
    assert obs.long_lane_only["bounded"]["steps"] == counted["bounded"]["steps"]
    if change is None:  # every such step sized for throughput: the lane ran at its speed alone
        assert counted["bounded"]["steps"] == 0 and counted["throughput"]["steps"] > 30
        assert not findings
    else:  # bounded (a fixed bound, or a pace for the answers streaming beside the images): each step pays the
        assert counted["bounded"]["steps"] > 30  # per-step constant again
        (finding,) = findings
        assert finding.change == change and finding.evidence["below_throughput"] >= 0.10
