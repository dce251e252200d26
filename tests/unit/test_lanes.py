"""Lanes, chunking and KV admission on int-only fakes: the first-token-first guarantees, by step counts."""

from __future__ import annotations

import pytest

from firsttoken.config import SchedulerConfig
from firsttoken.types import PromptWork
from firsttoken.scheduler.lanes import (
    FCFS,
    LONG,
    SHORT,
    FcfsLanes,
    ShortLongLanes,
    lane_names,
    lane_policy,
    route_lane,
)
from firsttoken.scheduler.report import wait_reason
from tests.unit.fakes import complete_step, fake_request, make_scheduler, run_step


def lanes_scheduler(**kw):
    options = dict(num_blocks=512, max_batched_tokens=256, long_prompt_threshold=200, long_step_tokens=64,
                   long_max_wait_steps=3)
    options.update(kw)
    return make_scheduler(**options)


def ids_in(batch):
    return [c.request_id for c in batch.chunks]


def test_routing_is_a_pure_function_of_prompt_length():
    cfg = SchedulerConfig(long_prompt_threshold=1024)
    assert [route_lane(n, cfg) for n in (1, 1023, 1024, 9000)] == [SHORT, SHORT, LONG, LONG]
    assert route_lane(5000, SchedulerConfig(scheduling="fcfs")) == "fcfs"


@pytest.mark.parametrize("scheduling, policy, names, routes, time_bounded", [
    ("lanes", ShortLongLanes, (SHORT, LONG), [SHORT, SHORT, LONG, LONG], True),
    ("fcfs", FcfsLanes, (FCFS,), [FCFS] * 4, False),
])
def test_each_lane_policy_is_chosen_once_from_the_config_and_routes_as_documented(
        scheduling, policy, names, routes, time_bounded):
    # --scheduling picks the lane layout once: the scheduler, route_lane and lane_names all ask that policy, and a
    # request lands in the lane its prompt length alone decides, whatever the order they arrive in
    cfg = SchedulerConfig(scheduling=scheduling, long_prompt_threshold=200)
    assert type(lane_policy(cfg)) is policy and lane_names(cfg) == names
    assert [route_lane(n, cfg) for n in (1, 199, 200, 9000)] == routes
    sched = make_scheduler(num_blocks=512, max_batched_tokens=256, scheduling=scheduling, long_prompt_threshold=200)
    assert type(sched.lanes) is policy and tuple(sched.waiting.depths()) == names
    assert sched.lanes.time_bounded is time_bounded and sched.pacing.bounded is time_bounded  # step-time auto
    for i, n in enumerate((9000, 1, 200, 199)):
        sched.add(fake_request(f"r{n}", prompt_len=n, max_tokens=1, arrival_seq=i))
    assert [sched.requests[f"r{n}"].lane for n in (1, 199, 200, 9000)] == routes
    assert sum(sched.waiting.depths().values()) == 4


class RecordingLanes:
    """A LaneServer whose short lane always has work and whose long lane waits: it records what a policy asks."""

    def __init__(self):
        self.served = []

    def serve_lane(self, lane, budget, step, whole_prompt):
        self.served.append((lane, whole_prompt))
        return True

    def has_prefill_work(self, lane):
        return True

    def long_lane_budget(self, budget, step, aging, held_by_short):
        return budget if aging or not held_by_short else None  # held while short work took the step, unless aged


def test_fcfs_serves_its_one_lane_whole_prompt_and_lanes_serve_short_first_then_long_with_aging():
    from firsttoken.scheduler.budget import StepBudget
    from firsttoken.scheduler.step import StepDraft

    fcfs, server = FcfsLanes(SchedulerConfig(scheduling="fcfs")), RecordingLanes()
    fcfs.serve(server, StepBudget(64), StepDraft())
    assert server.served == [(FCFS, True)]
    lanes, server = ShortLongLanes(SchedulerConfig(long_max_wait_steps=2)), RecordingLanes()
    for _ in range(3):
        lanes.serve(server, StepBudget(64), StepDraft())
    # short work took each step: the long lane is held twice, then runs anyway (aged)
    assert server.served == [(SHORT, False), (SHORT, False), (SHORT, False), (LONG, False)]
    assert lanes.long_wait_steps == 0


def test_short_request_arriving_mid_long_prefill_runs_in_the_very_next_step():
    sched = lanes_scheduler()
    sched.add(fake_request("long", prompt_len=1000, max_tokens=2))
    for _ in range(3):
        run_step(sched)
    assert 0 < sched.running[0].num_computed_tokens < 1000  # half done
    sched.add(fake_request("short", prompt_len=50, max_tokens=2, arrival_seq=1))
    batch = run_step(sched)
    assert "short" in ids_in(batch)
    assert sched.stats().num_short_delayed_by_long == 0


def test_long_work_per_step_is_capped_and_yields_to_short_prefills():
    sched = lanes_scheduler()
    sched.add(fake_request("long", prompt_len=1000, max_tokens=1))
    batch = run_step(sched)
    assert [c.num_new_tokens for c in batch.chunks] == [64]  # long_step_tokens
    sched.add(fake_request("s1", prompt_len=100, max_tokens=1, arrival_seq=1))
    batch = run_step(sched)
    assert ids_in(batch) == ["s1"]  # the long lane is held while short work runs


def test_long_requests_are_not_starved_under_constant_short_load():
    sched = lanes_scheduler()
    long_req = fake_request("long", prompt_len=600, max_tokens=1)
    sched.add(long_req)
    steps_with_long = []
    for i in range(200):
        sched.add(fake_request(f"s{i}", prompt_len=60, max_tokens=1, arrival_seq=i + 1))
        batch = run_step(sched)
        steps_with_long.append("long" in ids_in(batch))
        if long_req.output_token_ids:
            break
    assert long_req.output_token_ids  # finished its prefill despite a short request every step
    gaps = [len(run) for run in "".join("L" if x else "." for x in steps_with_long).split("L")[1:-1]]
    assert max(gaps, default=0) <= 3  # aging: long work at least every long_max_wait_steps + 1 steps


@pytest.mark.parametrize("mode", ["token budget", "time bound"])
def test_an_image_whose_encoder_units_exceed_the_long_lanes_budget_is_not_starved(mode):
    # Each unit of the photo costs more than the long lane may take in one step (100 visual tokens a unit against
    # --long-step-tokens 64; 100 ms against a 60 ms time bound), and a short prompt arrives every step. Aging must
    # still run one unit per aged step: the photo's first token comes while the short traffic goes on.
    from firsttoken.scheduler.cost_model import FEATURE_NAMES, CostModel

    if mode == "time bound":
        costs = {"step": 0.002, "prefill_tokens": 0.0005, "encoder_patches": 0.00025}
        sched = lanes_scheduler(step_time_target="0.06",
                                cost_model=CostModel(prior=tuple(costs.get(n, 0.0) for n in FEATURE_NAMES)))
    else:
        sched = lanes_scheduler(step_time_target="off")
    photo = fake_request("photo", prompt_len=300, max_tokens=1, images=[("img", 0, 100)], encoder_depth=4)
    sched.add(photo)
    long_steps, units = [], 0
    for i in range(200):
        sched.add(fake_request(f"s{i}", prompt_len=60, max_tokens=1, arrival_seq=i + 1))
        batch = run_step(sched)
        units += sum(w.num_units for w in batch.encoder_work)
        long_steps.append(any(w.request_id == "photo" for w in batch.encoder_work) or "photo" in ids_in(batch))
        if photo.output_token_ids:
            break
    assert units == 4 and photo.output_token_ids  # encoded and prefilled under a short request every step
    gaps = [len(run) for run in "".join("L" if x else "." for x in long_steps).split("L")[1:-1]]
    assert max(gaps, default=0) <= 3  # at most long_max_wait_steps steps without long work


def test_decodes_keep_flowing_while_long_prefills_run():
    sched = lanes_scheduler()
    sched.add(fake_request("chat", prompt_len=40, max_tokens=30))
    run_step(sched)
    sched.add(fake_request("long", prompt_len=1500, max_tokens=1, arrival_seq=1))
    for _ in range(20):
        batch = run_step(sched)
        assert "chat" in ids_in(batch)  # one decode token every step


def test_vision_tower_is_split_across_steps_for_long_requests():
    sched = lanes_scheduler(long_step_tokens=300)
    req = fake_request("img", prompt_len=700, max_tokens=1, images=[("photo", 20, 400)], encoder_depth=4)
    sched.add(req)
    layers_per_step = []
    for _ in range(30):
        batch = run_step(sched)
        layers_per_step.append(sum(w.num_units for w in batch.encoder_work))
        if req.output_token_ids:
            break
    assert sum(layers_per_step) == 4 and max(layers_per_step) == 1  # 400 visual tokens x 1 layer <= 300? no: 1
    # a short request arriving while the image is half encoded is served next step
    sched2 = lanes_scheduler(long_step_tokens=300)
    sched2.add(fake_request("img", prompt_len=700, max_tokens=1, images=[("photo", 20, 400)], encoder_depth=4))
    run_step(sched2)
    run_step(sched2)
    sched2.add(fake_request("short", prompt_len=30, max_tokens=1, arrival_seq=1))
    assert "short" in ids_in(run_step(sched2))


def test_fcfs_runs_whole_prompts_and_whole_encodes_in_one_step():
    sched = make_scheduler(num_blocks=512, max_batched_tokens=256, scheduling="fcfs",
                           long_prompt_threshold=200)
    sched.add(fake_request("img", prompt_len=900, max_tokens=1, images=[("photo", 20, 400)], encoder_depth=4))
    sched.add(fake_request("short", prompt_len=30, max_tokens=1, arrival_seq=1))
    first = run_step(sched)
    assert [(c.request_id, c.num_new_tokens) for c in first.chunks] == [("img", 900)]
    assert [w.num_units for w in first.encoder_work] == [4]
    assert ids_in(run_step(sched)) == ["short"]  # it waited behind the whole prefill: the seed's problem
    assert sched.stats().num_short_delayed_by_long == 1


def test_whole_prompt_admission_never_preempts_a_prefill():
    # pool of 40 blocks; each 200-token prompt needs 13 blocks + reserve; decode growth forces preemptions
    sched = lanes_scheduler(num_blocks=40, decode_reserve_tokens=16, long_prompt_threshold=10_000)
    for i in range(6):
        sched.add(fake_request(f"r{i}", prompt_len=200, max_tokens=200, arrival_seq=i))
    for _ in range(2000):
        if not sched.has_work:
            break
        prefilling = {r.request_id for r in sched.running if r.num_computed_tokens < r.num_prompt_tokens}
        batch = run_step(sched)
        assert not prefilling & set(batch.preempted_request_ids)
    assert not sched.has_work
    assert set(sched.preemptions_by_reason) <= {"decode_growth"}
    assert sched.kv.num_used_blocks == 0


def test_a_decode_outgrowing_its_reserve_never_evicts_a_prefill_admitted_whole_prompt():
    # The audit's repro: 8 blocks of 16. "d" (14 tokens + 2 reserve = 1 block) decodes; "p" (100 tokens + 2 reserve
    # = 7 blocks) is admitted whole-prompt and prefills 32 tokens per step. When d needs its second block the pool
    # is dry: p's blocks were promised, so d itself steps back (and waits), and p's prefill runs to the end.
    sched = lanes_scheduler(num_blocks=8, decode_reserve_tokens=2, max_batched_tokens=33,
                            long_prompt_threshold=10_000)
    d = fake_request("d", prompt_len=14, max_tokens=30)
    sched.add(d)
    run_step(sched)  # d's prompt; it samples its first token
    p = fake_request("p", prompt_len=100, max_tokens=2, arrival_seq=1)
    sched.add(p)
    progress, preempted = [], []
    while sched.has_work:
        batch = run_step(sched)
        preempted += batch.preempted_request_ids
        progress.append(p.num_computed_tokens)
    assert "p" not in preempted and p.stats.num_preemptions == 0
    assert preempted == ["d"]  # the growing request itself: the only decoder
    assert sched.preemptions_by_reason == {"decode_growth": 1}
    assert len(d.output_token_ids) == 30 and len(p.output_token_ids) == 2
    assert progress[:4] == [32, 64, 97, 100]  # 32 per step (33 once d stepped back), never restarted


def test_whole_prompt_admission_keeps_its_promise_under_random_arrivals_aborts_and_a_tiny_pool():
    # Thousands of steps of random arrivals (text and images, both lanes), random aborts and a pool far too small:
    # no request admitted whole-prompt is ever preempted before its prefill completes, every preemption is a
    # decode's growth, and the pool's invariants hold after every step.
    import random

    from firsttoken.types import FinishReason

    rng = random.Random(1234)
    sched = lanes_scheduler(num_blocks=30, decode_reserve_tokens=4, max_batched_tokens=48, long_prompt_threshold=120,
                            long_step_tokens=32, encoder_capacity_tokens=64)
    live, seq, steps = {}, 0, 0
    while steps < 4000:
        if rng.random() < 0.3:
            n = rng.randint(8, 300)
            images = [(f"img{rng.randint(0, 5)}", 3, min(n - 4, rng.randint(4, 60)))] if rng.random() < 0.4 else []
            req = fake_request(f"r{seq}", prompt_len=n, max_tokens=rng.randint(1, 60), images=images, arrival_seq=seq,
                               encoder_depth=4)
            if sched.check_admission(PromptWork(n)).admitted:
                sched.add(req)
                live[req.request_id] = req
            seq += 1
        if live and rng.random() < 0.02:
            victim = live.pop(rng.choice(sorted(live)))
            sched.finish(victim, FinishReason.ABORT)
        decoding = {r.request_id for r in sched.running if r.output_token_ids
                    and r.num_computed_tokens == r.num_tokens - 1}
        batch = run_step(sched)
        steps += 1
        for rid in batch.preempted_request_ids:
            assert rid in decoding, f"step {steps}: {rid} preempted before its prefill completed"
        live = {rid: r for rid, r in live.items() if r.status.value != "finished"}
    assert sched.num_preemptions > 20  # the pool really was too small
    assert set(sched.preemptions_by_reason) == {"decode_growth"}


POLICIES = {  # every policy the config picks once: pacing, the long lane's order, KV admission, interrupts, fcfs
    "lanes, token budget": dict(step_time_target="off"),
    "lanes, time bound": dict(step_time_target="0.06"),
    "lanes, auto time bound and throughput steps": dict(step_time_target="auto"),
    "lanes, time bound and ITL pace": dict(step_time_target="0.06", itl_target="0.03"),
    "lanes, time bound, least-work": dict(step_time_target="0.06", long_order="least-work"),
    "lanes, time bound, no encoder interrupt": dict(step_time_target="0.06", encoder_interrupt=False),
    "lanes, optimistic admission": dict(step_time_target="off", kv_admission="optimistic"),
    "fcfs": dict(scheduling="fcfs"),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_live_request_progresses_or_waits_for_a_named_reason(policy):
    # Random arrivals (text, images, the same image twice in one prompt, both lanes), random aborts, a pool far too
    # small and few sequence slots: in every step each live request either gets work or waits for a reason the
    # scheduler names; no step is empty while requests are live (a request that can never make progress would
    # spin an empty engine for ever); once arrivals stop, everything finishes.
    import random

    from firsttoken.scheduler.cost_model import FEATURE_NAMES, CostModel
    from firsttoken.scheduler.step import WAIT_REASONS
    from firsttoken.types import FinishReason

    costs = {"step": 0.002, "prefill_tokens": 0.0005, "encoder_patches": 0.00025}
    rng = random.Random(sum(map(ord, policy)))
    now = [0.0]  # a virtual clock: each step takes its priced time, so the run is the same on any machine
    sched = lanes_scheduler(num_blocks=30, decode_reserve_tokens=4, max_batched_tokens=48, long_prompt_threshold=120,
                            long_step_tokens=32, encoder_capacity_tokens=64, max_num_seqs=6,
                            cost_model=CostModel(prior=tuple(costs.get(n, 0.0) for n in FEATURE_NAMES)),
                            clock=lambda: now[0], **POLICIES[policy])
    live, seq, reasons = {}, 0, {}
    for step in range(20_000):
        if step < 1500 and rng.random() < 0.15:
            n = rng.randint(1, 300)
            images = []
            if n > 12 and rng.random() < 0.4:
                size = min(n // 2 - 2, rng.randint(2, 40))
                h = f"img{rng.randint(0, 5)}"
                images = [(h, 1, size)] + ([(h, 2 + size, size)] if rng.random() < 0.3 else [])
            req = fake_request(f"r{seq}", prompt_len=n, max_tokens=rng.randint(1, 40), images=images,
                               arrival_seq=seq, encoder_depth=rng.randint(1, 4))
            if sched.check_admission(PromptWork(n)).admitted:
                sched.add(req)
                live[req.request_id] = req
            seq += 1
        if step < 1500 and live and rng.random() < 0.02:
            sched.finish(live.pop(rng.choice(sorted(live))), FinishReason.ABORT)
        batch = sched.schedule()
        if live:
            assert batch.has_work, f"step {step}: {len(live)} live requests and nothing scheduled"
        got_work = {c.request_id for c in batch.chunks} | {w.request_id for w in batch.encoder_work}
        for rid, req in live.items():
            if rid not in got_work:
                reason = wait_reason(sched, req)
                assert reason in WAIT_REASONS, f"step {step}: {rid} ({req.status.value}, {req.lane} lane) waits for no reason"
                reasons[reason] = reasons.get(reason, 0) + 1
        now[0] += costs["step"] + costs["prefill_tokens"] * sum(c.num_new_tokens for c in batch.chunks) \
            + costs["encoder_patches"] * 16 * sum(w.num_units for w in batch.encoder_work)
        complete_step(sched, batch)
        live = {rid: r for rid, r in live.items() if r.status.value != "finished"}
        if step >= 1500 and not live:
            break
    assert not live and not sched.has_work and sched.kv.num_used_blocks == 0
    assert seq > 200 and {"kv_blocks", "in_line"} <= set(reasons)  # the run really queued


def test_optimistic_admission_evicts_prefills_halfway_and_counts_it():
    sched = lanes_scheduler(num_blocks=24, decode_reserve_tokens=16, long_prompt_threshold=10_000,
                            kv_admission="optimistic", max_batched_tokens=64)
    for i in range(4):
        sched.add(fake_request(f"r{i}", prompt_len=150, max_tokens=50, arrival_seq=i))
    for _ in range(3000):
        if not sched.has_work:
            break
        run_step(sched)
    assert not sched.has_work
    assert sched.preemptions_by_reason.get("prefill_growth", 0) > 0
    assert sched.kv.num_used_blocks == 0


def test_a_request_that_can_never_fit_is_refused_with_its_reason():
    sched = lanes_scheduler(num_blocks=10)  # 160 tokens
    verdict = sched.check_admission(PromptWork(300))
    assert not verdict.admitted and verdict.reason == "never_fits" and verdict.status == 400
    assert "300 tokens" in verdict.message
    assert sched.check_admission(PromptWork(50)).admitted


def test_a_full_lane_answers_queue_full_without_touching_the_other_lane():
    sched = lanes_scheduler(max_queued_requests=2)
    for i in range(2):
        sched.add(fake_request(f"l{i}", prompt_len=300, arrival_seq=i))
    assert sched.check_admission(PromptWork(300)).reason == "queue_full"
    assert sched.check_admission(PromptWork(300)).status == 429
    assert sched.check_admission(PromptWork(20)).admitted  # the short lane still takes requests


def test_fcfs_admits_a_prompt_larger_than_the_budget_while_others_decode():
    sched = make_scheduler(num_blocks=512, max_batched_tokens=256, scheduling="fcfs")
    sched.add(fake_request("chat", prompt_len=20, max_tokens=50))
    run_step(sched)  # chat is decoding from now on
    sched.add(fake_request("big", prompt_len=1200, max_tokens=1, arrival_seq=1))
    batch = run_step(sched)
    assert [(c.request_id, c.num_new_tokens) for c in batch.chunks] == [("chat", 1), ("big", 1200)]


def test_idle_short_lane_lets_long_work_take_a_bigger_step():
    sched = lanes_scheduler(long_step_tokens=64, long_step_tokens_idle=200)
    sched.add(fake_request("long", prompt_len=1000, max_tokens=1))
    assert [c.num_new_tokens for c in run_step(sched).chunks] == [200]  # nobody short: the idle share
    sched.add(fake_request("s", prompt_len=40, max_tokens=1, arrival_seq=1))
    assert ids_in(run_step(sched)) == ["s"]  # short work first, long held
    assert [c.num_new_tokens for c in run_step(sched).chunks] == [200]
