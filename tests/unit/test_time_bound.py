"""Time-bounded, work-conserving steps on int-only fakes with a known step-cost model (no timing involved): every
step's predicted time stays within the target, a short request arriving mid-encode runs in the very next step, the
long lane fills the steps short work leaves, and nobody in the long lane is passed over for ever."""

from __future__ import annotations

import math

import pytest

from firsttoken.models.model_config import VisionConfig
from firsttoken.models.qwen2_vl_vision import full_attention_units
from firsttoken.scheduler.cost_model import FEATURE_NAMES, CostModel, encoder_units, prefill_chunk
from firsttoken.scheduler.admission import protected_place
from firsttoken.scheduler.lanes import LONG_MIN_SHARE
from firsttoken.types import PromptWork
from tests.unit.fakes import ManualClock, fake_request, make_scheduler, run_step

# seconds per unit: 10 ms a step, 1 ms per prefill token, 0.25 ms per encoder patch (a fake image of n visual
# tokens has 4n patches per unit: 1 ms per visual token per unit); every other term free
COSTS = {"step": 0.010, "prefill_tokens": 0.001, "encoder_patches": 0.00025}
PRIOR = tuple(COSTS.get(name, 0.0) for name in FEATURE_NAMES)
TARGET = 0.25  # seconds a step may take


def scheduler(**kw):
    options = dict(num_blocks=512, max_batched_tokens=4096, long_prompt_threshold=200, step_time_target=str(TARGET),
                   cost_model=CostModel(prior=PRIOR))
    options.update(kw)
    return make_scheduler(**options)


def predicted(sched, batch) -> float:
    return sched.cost_model.predict(batch.features)


def test_every_step_stays_within_the_target_and_a_short_request_waits_one_step():
    sched = scheduler()
    photo = fake_request("photo", prompt_len=700, max_tokens=1, images=[("img", 20, 100)], encoder_depth=6)
    sched.add(photo)
    first = run_step(sched)
    assert predicted(sched, first) <= TARGET + 1e-9
    assert [w.num_units for w in first.encoder_work] == [2]  # 100 ms per unit: two fit, a third would not
    chat = fake_request("chat", prompt_len=120, max_tokens=2, arrival_seq=1)
    sched.add(chat)  # arrives while the photo's encode is half done
    second = run_step(sched)
    assert [c.request_id for c in second.chunks if not c.is_decode] == ["chat"]
    assert [c.num_new_tokens for c in second.chunks] == [120]  # its whole prompt: its first token comes now
    assert predicted(sched, second) <= TARGET + 1e-9  # what is left (120 ms) went to one more photo unit
    assert [w.num_units for w in second.encoder_work] == [1]
    while sched.has_work:
        batch = run_step(sched)
        assert predicted(sched, batch) <= TARGET + 1e-9 or len(batch.encoder_work) + len(batch.chunks) == 1


def test_a_step_holding_a_short_prefill_gets_no_long_unit_that_does_not_fit():
    # a chat of 180 tokens (180 ms) leaves 60 ms of the 240 ms bound: the photo's next unit (100 ms) would make the
    # chat's first-token step 290 ms; it waits for the next step instead (the long lane's one-unit progress rule
    # applies to steps without a short prefill)
    sched = scheduler()
    sched.add(fake_request("photo", prompt_len=700, max_tokens=1, images=[("img", 20, 100)], encoder_depth=6))
    assert [w.num_units for w in run_step(sched).encoder_work] == [2]
    sched.add(fake_request("chat", prompt_len=180, max_tokens=2, arrival_seq=1))
    second = run_step(sched)
    assert [(c.request_id, c.num_new_tokens) for c in second.chunks] == [("chat", 180)]
    assert second.encoder_work == () and predicted(sched, second) <= TARGET + 1e-9
    third = run_step(sched)
    assert [(w.start_unit, w.num_units) for w in third.encoder_work] == [(2, 2)]  # the photo goes on at once


def test_a_block_longer_than_the_bound_runs_in_row_slices_so_a_short_request_waits_one_bounded_step():
    # the `small` checkpoint's tower (4 full-attention blocks of width 256) over a 1024² image (74 x 74 patches),
    # priced at 10 us per patch and 20 ns per query-key pair: one whole block is 0.66 s, over the 0.25 s bound, and a
    # step that has to run one holds a short request arriving meanwhile for all of it. Its 4 query-row slices are
    # 0.16-0.17 s each: a step is the bound, plus at most one slice (the long lane always moves by a unit)
    costs = {"step": 0.010, "prefill_tokens": 0.001, "encoder_patches": 1e-5, "encoder_attention": 2e-8}
    model = CostModel(prior=tuple(costs.get(name, 0.0) for name in FEATURE_NAMES))
    vision = VisionConfig(depth=4, embed_dim=256, num_heads=4, intermediate_size=1024, out_hidden_size=512)
    units = full_attention_units(vision, (1, 74, 74))
    assert len(units) == 4 * 4 and [u.block for u in units] == [b for b in range(4) for _ in range(4)]
    block_s = model.predict(encoder_units(74 * 74, (74 * 74) ** 2)) - costs["step"]
    slice_s = max(model.predict(encoder_units(u.num_patches, u.attention_pairs)) - costs["step"] for u in units)
    assert block_s > TARGET and slice_s < TARGET and slice_s < block_s / 3
    sched = scheduler(cost_model=model, encoder_capacity_tokens=4096)
    photo = fake_request("photo", prompt_len=1369 + 100, max_tokens=1, images=[("img", 20, 1369)], units=units)
    sched.add(photo)
    first = run_step(sched)
    assert [(w.start_unit, w.num_units) for w in first.encoder_work] == [(0, 1)]  # one slice of block 0
    sched.add(fake_request("chat", prompt_len=120, max_tokens=2, arrival_seq=1))  # arrives mid-block
    second = run_step(sched)
    assert [(c.request_id, c.num_new_tokens) for c in second.chunks] == [("chat", 120)]  # its first token now
    done = sum(w.num_units for w in first.encoder_work + second.encoder_work)
    steps = [first, second]
    while sched.has_work:
        steps.append(run_step(sched))
        done += sum(w.num_units for w in steps[-1].encoder_work)
    assert done == 16  # every slice ran once
    assert all(predicted(sched, b) <= TARGET + slice_s + 1e-9 for b in steps)  # never a whole block's 0.66 s


def test_the_long_lane_fills_steps_short_work_leaves():
    # work-conserving: with nothing short to do, every step carries as much long work as the target allows
    sched = scheduler()
    for i in range(3):
        sched.add(fake_request(f"doc{i}", prompt_len=1000, max_tokens=1, arrival_seq=i))
    tokens, seconds = [], []
    while sched.has_work:
        batch = run_step(sched)
        tokens.append(sum(c.num_new_tokens for c in batch.chunks if not c.is_decode))
        seconds.append(predicted(sched, batch))
    assert sum(tokens) == 3000 and len(tokens) == 13  # 3000 tokens at ~240 per step: 12.5 steps
    assert all(s >= TARGET - 0.002 for s in seconds[:-1])  # full steps until the last (1 ms rounding per chunk)


def test_least_remaining_work_first_and_nobody_passed_over_for_ever():
    # a big long request among a stream of small ones: the small go first, but the big one is passed over at most
    # long_max_passes steps in a row before it gets work
    sched = scheduler(long_order="least-work", long_max_passes=4)
    big = fake_request("big", prompt_len=2000, max_tokens=1)
    sched.add(big)
    seq, max_gap, gap = 1, 0, 0
    for step in range(60):
        if step % 2 == 0:  # a new small long request every other step
            sched.add(fake_request(f"s{seq}", prompt_len=230, max_tokens=1, arrival_seq=seq))
            seq += 1
        batch = run_step(sched)
        got = any(c.request_id == "big" for c in batch.chunks)
        gap = 0 if got else gap + 1
        max_gap = max(max_gap, gap)
        if big.status.value == "finished":
            break
    assert big.num_computed_tokens > 0
    assert max_gap <= 4 + 1


def long_chunks(batch) -> list[str]:
    return [c.request_id for c in batch.chunks if not c.is_decode]


def test_deadline_order_a_later_request_goes_first_only_while_its_place_is_earlier():
    # places in line: arrival + 1 x own predicted work (1 ms per token). big: 0 + 2.0 s. quick (0.5 s later,
    # 0.23 s of work): 0.73 s, ahead of big. late (1.9 s later): 2.13 s, behind big, although smaller
    clock = ManualClock()
    sched = scheduler(clock=clock)
    sched.add(fake_request("big", prompt_len=2000, max_tokens=1))
    assert long_chunks(run_step(sched)) == ["big"]
    clock.now = 0.5
    sched.add(fake_request("quick", prompt_len=230, max_tokens=1, arrival_seq=1))
    assert long_chunks(run_step(sched)) == ["quick", "big"]  # all of quick's 230 tokens first, big fills the rest
    clock.now = 1.9
    sched.add(fake_request("late", prompt_len=230, max_tokens=1, arrival_seq=2))
    order = []
    while sched.has_work:
        order += [rid for rid in long_chunks(run_step(sched)) if not order or order[-1] != rid]
    assert order == ["big", "late"]  # big's prefill runs to its end before late gets a token


def test_deadline_order_nobody_waits_for_work_that_arrives_after_its_place():
    # a stream of small long requests, one per step (~92% of what the lane can do): least-remaining-work order
    # would serve each of them first. In deadline order big's place is 2.0 s, a small one's its arrival + 0.23 s:
    # those arriving before 1.77 s go first, every later one waits for big
    clock = ManualClock()
    sched = scheduler(clock=clock)
    big = fake_request("big", prompt_len=2000, max_tokens=1)
    sched.add(big)
    assert sched.long_order.place_s(big) == pytest.approx(2.0)
    arrived, ran_first, steps = {}, set(), 0
    while big.status.value != "finished":
        rid = f"s{len(arrived)}"
        arrived[rid] = clock.now
        sched.add(fake_request(rid, prompt_len=230, max_tokens=1, arrival_seq=len(arrived)))
        batch = run_step(sched)
        steps += 1
        if big.status.value != "finished":  # (its last step's spare time goes to the next in line)
            ran_first |= {r for r in long_chunks(batch) if r != "big"}
        clock.now += predicted(sched, batch)
    assert ran_first == {rid for rid, t in arrived.items() if t + 0.23 < 2.0}  # exactly those placed before it
    assert len(ran_first) == 7
    assert steps == 15  # its own 2.0 s and theirs (7 x 0.23 s) at 0.24 s of work per step: big is not starved


def test_deadline_order_with_no_slack_is_first_come_first_served_within_the_lane():
    clock = ManualClock()
    sched = scheduler(clock=clock, long_slack=0.0)
    sched.add(fake_request("big", prompt_len=2000, max_tokens=1))
    run_step(sched)
    clock.now = 0.01
    sched.add(fake_request("small", prompt_len=230, max_tokens=1, arrival_seq=1))
    order = []
    while sched.has_work:
        order += [rid for rid in long_chunks(run_step(sched)) if not order or order[-1] != rid]
    assert order == ["big", "small"]


def test_the_predicted_wait_counts_only_the_queued_work_whose_place_comes_first():
    # a queued big request (2 s of work, place 2.0): a small newcomer's place (0.23 s) is ahead of it, so big's
    # work is not in its prediction; with slack 0 the newcomer's place is behind big's and it is
    def predicted_small(slack: float) -> float:
        clock = ManualClock()
        sched = scheduler(clock=clock, long_slack=slack)
        sched.add(fake_request("big", prompt_len=2000, max_tokens=1))
        run_step(sched)
        return sched.admission.predict_ttft(PromptWork(230))

    ahead, alone = predicted_small(0.0), predicted_small(1.0)
    assert alone < 0.23 / LONG_MIN_SHARE + TARGET  # its own work (at worst the lane's minimum share) and one step
    assert ahead - alone >= 2.0 - 0.24  # big's remaining prefill (one chunk done) is in front of it


def test_least_work_order_still_gives_running_prefills_their_chunk_first():
    # the earlier order, kept for side-by-side runs: a running prefill's next chunk (the whole step) before a
    # smaller newcomer; in deadline order the newcomer, whose place is earlier, goes first
    def second_step(order: str) -> list[str]:
        sched = scheduler(long_order=order, clock=ManualClock())
        sched.add(fake_request("running", prompt_len=600, max_tokens=1))
        assert long_chunks(run_step(sched)) == ["running"]
        sched.add(fake_request("newcomer", prompt_len=230, max_tokens=1, arrival_seq=1))
        return long_chunks(run_step(sched))

    assert second_step("least-work") == ["running"]
    assert second_step("deadline") == ["newcomer", "running"]


def test_a_prompt_the_prefix_cache_serves_gets_the_place_of_its_uncached_work():
    # a follow-up turn: 2,000 tokens shared with a finished request, 16 new. Its place is its arrival plus the
    # work the cache does not serve (16 tokens + the last block recomputed), not 2 s of prefill it will not run
    clock = ManualClock()
    sched = scheduler(clock=clock)
    sched.add(fake_request("first", prompt_len=2000, max_tokens=1, shared_prefix=True))
    while sched.has_work:
        run_step(sched)
    clock.now = 10.0
    follow = fake_request("follow", prompt_len=2016, max_tokens=1, shared_prefix=True, arrival_seq=1)
    sched.add(follow)
    assert sched.long_order.place_s(follow) - 10.0 < 0.05
    fresh = fake_request("fresh", prompt_len=2016, max_tokens=1, arrival_seq=2)
    sched.add(fresh)
    assert sched.long_order.place_s(fresh) > 10.0 + 2.0


def test_with_no_slack_every_request_still_preprocessing_counts_as_ahead():
    clock = ManualClock()
    sched = scheduler(clock=clock, long_slack=0.0)
    alone = sched.admission.predict_ttft(PromptWork(230))
    behind_big = sched.admission.predict_ttft(PromptWork(230), pending=(PromptWork(2000),))
    assert behind_big - alone >= 2.0  # first come, first served: the bigger one admitted first is ahead


def test_off_keeps_the_token_budgets():
    sched = scheduler(step_time_target="off", long_step_tokens=64)
    assert math.isinf(sched.pacing.step_time_target())
    sched.add(fake_request("doc", prompt_len=1000, max_tokens=1))
    assert [c.num_new_tokens for c in run_step(sched).chunks] == [64]


def test_progress_even_when_the_model_says_only_steps_cost_anything():
    # a tiny model: the fit puts all the time in the per-step constant, so no token "fits" a time budget; every
    # lane must still move (the short lane's first prefill is whole, the long lane gets at least a block)
    only_steps = tuple(0.05 if name == "step" else 0.0 for name in FEATURE_NAMES)
    sched = scheduler(step_time_target="auto", cost_model=CostModel(prior=only_steps))
    sched.add(fake_request("chat", prompt_len=90, max_tokens=3))
    sched.add(fake_request("doc", prompt_len=600, max_tokens=3, images=[("img", 20, 60)], encoder_depth=4,
                           arrival_seq=1))
    for _ in range(200):
        if not sched.has_work:
            break
        run_step(sched)
    assert not sched.has_work


def test_long_chunk_share_caps_the_long_prefill_chunk_and_leaves_the_rest_to_encoder_units():
    # 240 ms of work per step (the 250 ms bound less the 10 ms constant), 1 ms per prefill token
    whole = scheduler()
    whole.add(fake_request("doc", prompt_len=700, max_tokens=1))
    assert [c.num_new_tokens for c in run_step(whole).chunks] == [240]
    half = scheduler(long_chunk_share=0.5)
    half.add(fake_request("doc", prompt_len=700, max_tokens=1))
    sizes = []
    while half.has_work:
        sizes += [c.num_new_tokens for c in run_step(half).chunks if not c.is_decode]
    assert sizes == [125] * 5 + [75]  # at most half the bound (125 ms) per step, the whole prompt in the end
    # beside a photo's encode: the document's chunk takes its half, the photo's 100 ms units what the bound leaves
    mixed = scheduler(long_chunk_share=0.5)
    mixed.add(fake_request("doc", prompt_len=700, max_tokens=1))
    mixed.add(fake_request("photo", prompt_len=700, max_tokens=1, images=[("img", 0, 100)], encoder_depth=6,
                           arrival_seq=1))
    first = run_step(mixed)
    assert [c.num_new_tokens for c in first.chunks] == [125]
    assert [w.num_units for w in first.encoder_work] == [1]  # 125 + 100 ms fit in 240, a second unit would not
    assert predicted(mixed, first) <= TARGET + 1e-9


def test_with_an_objective_an_image_prompt_is_asked_to_lower_its_budget_only_when_its_wait_counted_twice_is_over():
    # an image prompt: 600 tokens (0.6 s of prefill) + 1,000 patches (0.25 s): 0.85 s of its own work, objective
    # 2 s. Alone it fits with room (no wait to count); behind a step in flight that holds a 0.5 s request its
    # predicted TTFT still fits, but with the margin (2 x its wait) it is over: admitted, asked to lower its budget
    image = PromptWork(600, 1, 1000)

    def verdict(queued: int, **kw):
        clock = ManualClock()
        sched = scheduler(clock=clock, ttft_slo="text=1,image=2", long_slack=0.0, **kw)
        if queued:
            sched.add(fake_request("ahead", prompt_len=queued, max_tokens=1))
            run_step(sched)
        return sched.check_admission(image)

    alone, behind = verdict(0), verdict(500)
    # its prediction is over a third of the objective, yet nothing is lowered: the margin counts only its wait
    assert alone.admitted and not alone.lower_budget and alone.predicted_ttft_s > 2.0 / 3
    assert behind.admitted and behind.lower_budget and behind.predicted_ttft_s <= 2.0
    assert not verdict(500, ttft_slo_wait_margin=0.0).lower_budget  # margin 0: lower only while over
    assert not verdict(500, ttft_slo_wait_margin=0.5).lower_budget  # its wait counted 1.5 times fits
    # idle after a busy spell: the long lane's remembered share (0.6) stretches its own work, which is not wait
    from firsttoken.scheduler.admission import Backlog

    idle = scheduler(clock=ManualClock(), ttft_slo="text=1,image=2")
    idle.admission.backlog = Backlog(long_frac=0.6)
    after_busy = idle.check_admission(image)
    assert after_busy.admitted and not after_busy.lower_budget and after_busy.predicted_ttft_s > 0.85 / 0.6 - 0.01
    over = verdict(3000)
    assert not over.admitted and over.reason == "over_slo"  # the prediction itself over: refused, as before
    text = scheduler(clock=ManualClock(), ttft_slo="text=1,image=2")
    text.add(fake_request("ahead", prompt_len=150, max_tokens=1))
    run_step(text)
    assert not text.check_admission(PromptWork(150)).lower_budget  # text has no budget to lower


def test_with_objectives_a_newcomer_does_not_pass_a_request_it_would_push_past_its_objective():
    # "big" (2 s of prefill, its place 2.0) is admitted at t = 0 under a 3.5 s objective; at t = 1 a 0.85 s prompt
    # arrives, whose own place (1.85) is earlier. Passing would finish big at ~4 s, past its objective, so the
    # newcomer's admission gives it big's place (behind it: the earlier arrival first) and its prediction counts
    # big's work left after the step in flight; it still meets its own objective. Without objectives it passes.
    from dataclasses import replace

    def second_step(slo: str) -> tuple[list[str], float, float]:
        clock = ManualClock()
        sched = scheduler(clock=clock, ttft_slo=slo)
        sched.add(fake_request("big", prompt_len=2000, max_tokens=1))
        run_step(sched)
        left = sched.remaining_work_s(sched.requests["big"])
        clock.now = 1.0
        verdict = sched.check_admission(PromptWork(850))
        assert verdict.admitted
        newcomer = fake_request("newcomer", prompt_len=850, max_tokens=1, arrival_seq=1)
        newcomer.engine_request = replace(newcomer.engine_request, arrival_s=1.0, long_place_s=verdict.long_place_s)
        sched.add(newcomer)
        return long_chunks(run_step(sched)), verdict.predicted_ttft_s, left

    protected, predicted, left = second_step("text=3.5,image=3.5")
    assert 1.0 < left < 2.0
    assert protected[0] == "big" and left + 0.85 <= predicted <= 3.5  # big's work left ahead of it
    free, predicted_free, _ = second_step("")
    assert free[0] == "newcomer" and predicted_free < 1.0


def test_with_objectives_a_newcomer_does_not_pass_a_request_already_late_for_its_objective():
    # a queued request with 2 s of work left, its place at 2.0, its objective's deadline at 2.9: at t = 1 it misses
    # even if nobody passes it (1 + 2 = 3.0). A 0.85 s newcomer whose own place (1.85) is earlier goes behind it all
    # the same: passing would make the late request later still. One that is not late and keeps its deadline with
    # the newcomer ahead is passed; a request with no objective (deadline inf) never holds a newcomer back.
    late = [(2.0, 2.0, 2.9)]
    assert protected_place(1.85, 0.85, late, now=1.0, rate=1.0) == 2.0
    roomy = [(2.0, 2.0, 4.0)]  # 1 + 2 + 0.85 = 3.85 <= 4.0: still on time with the newcomer ahead
    assert protected_place(1.85, 0.85, roomy, now=1.0, rate=1.0) == 1.85
    assert protected_place(1.85, 0.85, [(2.0, 2.0, math.inf)], now=1.0, rate=1.0) == 1.85
    # only those it would pass: a late request whose place is already earlier is ahead of it anyway
    assert protected_place(2.5, 0.85, late, now=1.0, rate=1.0) == 2.5
    # the last protected one sets the place: behind both late requests, ahead of the roomy one after them
    queue = [(0.5, 2.0, 2.0), (0.5, 2.2, 2.6), (0.2, 3.0, 9.0)]
    assert protected_place(1.9, 0.85, queue, now=1.0, rate=1.0) == 2.2


def _doc_tokens_per_step(sched, clock, steps: int, add=None) -> list[int]:
    """Run steps with the clock moving by each step's predicted time; the long document's prefill tokens in each
    (``add(step_index)`` may add requests before a step)."""
    out = []
    for i in range(steps):
        if add:
            add(i)
        batch = run_step(sched)
        clock.now += predicted(sched, batch)
        out.append(sum(c.num_new_tokens for c in batch.chunks if c.request_id == "doc"))
    return out


def near(tokens: list[int], expected: list[int]) -> bool:
    """Token counts as expected, give or take the one token a float's rounding moves at a budget's edge."""
    return len(tokens) == len(expected) and all(abs(a - b) <= 1 for a, b in zip(tokens, expected))


def test_with_an_itl_target_steps_that_carry_a_decode_keep_its_pace():
    # a chat decodes while a long document prefills: by default each step is the 0.25 s bound (240 document
    # tokens beside the decode); with --itl-target 0.1 the steps that carry its decodes are 0.1 s (90 tokens), and
    # once it has finished the document gets whole steps again
    for itl, during in (("off", 240), ("0.1", 90)):
        clock = ManualClock()
        sched = scheduler(itl_target=itl, clock=clock)
        sched.add(fake_request("doc", prompt_len=3000, max_tokens=1))
        sched.add(fake_request("chat", prompt_len=120, max_tokens=6, arrival_seq=1))
        tokens = _doc_tokens_per_step(sched, clock, 8)
        assert near(tokens[:1], [120])  # the chat's whole prefill (120 ms) and what the bound leaves
        assert near(tokens[1:6], [during] * 5)  # its 5 decode steps
        assert near(tokens[6:], [240, 240])  # it has finished: whole steps again


def test_an_answer_ahead_of_its_pace_lets_steps_run_long_until_it_is_back_on_it():
    # the chat decodes alone for 5 steps of 10 ms (0.45 s ahead of a 0.1 s pace); a document arriving then gets
    # whole 0.25 s steps until the chat's next token would come later than its pace, then 0.1 s steps
    clock = ManualClock()
    sched = scheduler(itl_target="0.1", clock=clock)
    sched.add(fake_request("chat", prompt_len=120, max_tokens=20))

    def add(i: int) -> None:
        if i == 6:
            sched.add(fake_request("doc", prompt_len=3000, max_tokens=1, arrival_seq=1))

    tokens = _doc_tokens_per_step(sched, clock, 13, add)
    assert tokens[:6] == [0] * 6  # the chat's prefill, then 5 decode-only steps (origin at step 1's start)
    assert near(tokens[6:], [240, 240, 240, 90, 90, 90, 90])


def test_an_answer_behind_its_pace_gets_short_steps_never_shorter_than_four_step_constants():
    # a stall (the clock jumps 0.5 s) puts the chat 0.4 s behind a 0.1 s pace: the next steps are the floor, 4 x
    # the 10 ms per-step constant (30 document tokens), until it has caught up (0.06 s per step)
    clock = ManualClock()
    sched = scheduler(itl_target="0.1", clock=clock)
    sched.add(fake_request("chat", prompt_len=120, max_tokens=40))
    sched.add(fake_request("doc", prompt_len=5000, max_tokens=1, arrival_seq=1))
    assert near(_doc_tokens_per_step(sched, clock, 3), [120, 90, 90])
    clock.now += 0.5
    tokens = _doc_tokens_per_step(sched, clock, 10)
    assert near(tokens[:6], [30] * 6) and near(tokens[-1:], [90])  # 0.4 s behind, 0.06 s caught up a step


def test_itl_target_auto_is_a_fifth_of_a_second_but_at_least_four_step_constants():
    assert scheduler(itl_target="auto").pacing.itl_bound() == pytest.approx(0.2)
    slow = CostModel(prior=tuple({**COSTS, "step": 0.08}.get(name, 0.0) for name in FEATURE_NAMES))
    assert scheduler(itl_target="auto", cost_model=slow).pacing.itl_bound() == pytest.approx(0.32)
    assert math.isinf(scheduler().pacing.itl_bound())  # off by default
    # without time-bounded steps there is nothing to bound: the pace is not in force (nor reported)
    assert math.isinf(scheduler(itl_target="auto", step_time_target="off").pacing.itl_bound())
    assert math.isinf(scheduler(itl_target="auto", scheduling="fcfs").pacing.itl_bound())
    with pytest.raises(ValueError, match="itl_target"):
        scheduler(itl_target="fast")


# ---- idle means full speed (--step-time-target auto) ---------------------------------------------------------

def test_a_lone_request_runs_throughput_steps_whole_images_and_the_fastest_chunk():
    # Alone, nobody the automatic bound protects is there: each step prefills the throughput chunk S or stops
    # before an image, which it encodes whole in that step. So a prompt of N tokens and k images takes at most
    # ceil(N / S) + k steps, against ~N / 110 bounded steps (the target here is 110 ms: a typical short prompt's 100
    # tokens + the 10 ms constant). S: the smallest size holding a typical short prompt priced within 5% of the
    # cheapest for a cap-sized prompt: 256 (1.024 s + 4 x 10 ms, 2.9% over 1,024's one step; 128's 8 steps, 6.8%)
    sched = scheduler(step_time_target="auto", max_batched_tokens=1024)
    assert sched.pacing.throughput_chunk_tokens() == 256
    photos = fake_request("photos", prompt_len=3000, max_tokens=1, encoder_depth=4,
                          images=[("a", 100, 500), ("b", 1000, 500), ("c", 2000, 500)])
    sched.add(photos)
    target = sched.pacing.step_time_target()
    steps, bounded = 0, 0
    while sched.has_work:
        batch = run_step(sched)
        steps += 1
        bounded += predicted(sched, batch) <= target
        for w in batch.encoder_work:
            assert (w.start_unit, w.num_units, w.interruptible) == (0, 4, True)  # whole, and a short arrival cuts it
    assert steps <= math.ceil(3000 / 256) + 3
    assert bounded <= 1  # none bounded by the target (the last step may be small)


def test_a_lone_video_is_not_cut_at_every_grid_the_next_chunks_grids_are_encoded_ahead():
    # a video is one vision item per temporal grid: 24 grids of 100 tokens after 100 tokens of text. A throughput
    # step that stops its chunk before a grid it encodes also encodes the grids the next chunk (S = 256 tokens) will
    # span, so the prompt takes at most ceil(N / S) + 2 steps, not one step per grid (24)
    sched = scheduler(step_time_target="auto", max_batched_tokens=1024)
    size = sched.pacing.throughput_chunk_tokens()
    grids = [(f"g{k}", 100 + 100 * k, 100) for k in range(24)]
    sched.add(fake_request("clip", prompt_len=2600, max_tokens=1, encoder_depth=2, images=grids))
    steps = 0
    while sched.has_work:
        batch = run_step(sched)
        steps += 1
        assert all(w.interruptible for w in batch.encoder_work)  # a short arrival still cuts the encode
    assert steps <= math.ceil(2600 / size) + 2 < 24


def test_a_request_arriving_mid_way_brings_the_bound_back_for_its_first_token_only():
    # a short arrival during long-lane-only work is served whole in the very next step, bounded; once it decodes,
    # the short lane has no prefill work and the long lane's steps are throughput-sized again, its decodes riding
    # along. With --itl-target its answer's pace bounds the steps while it decodes
    for itl in ("off", "auto"):
        sched = scheduler(step_time_target="auto", max_batched_tokens=1024, itl_target=itl)
        size = sched.pacing.throughput_chunk_tokens()
        sched.add(fake_request("doc", prompt_len=4000, max_tokens=1))
        first = run_step(sched)
        assert sum(c.num_new_tokens for c in first.chunks) == size  # long lane only: the throughput chunk
        sched.add(fake_request("chat", prompt_len=60, max_tokens=3, arrival_seq=1))
        target = sched.pacing.step_time_target()
        second = run_step(sched)
        assert [(c.request_id, c.num_new_tokens) for c in second.chunks if c.request_id == "chat"] == [("chat", 60)]
        assert predicted(sched, second) <= target + 1e-9 and not sched.last_step.throughput
        while "chat" in sched.requests:
            batch = run_step(sched)
            assert any(c.request_id == "chat" and c.is_decode for c in batch.chunks)
            assert sched.last_step.throughput == (itl == "off")
            if itl == "auto":
                assert predicted(sched, batch) <= max(target, sched.pacing.itl_bound()) + 1e-9
        alone_again = run_step(sched)
        assert sum(c.num_new_tokens for c in alone_again.chunks) == size > 60


def test_while_an_answer_decodes_a_throughput_step_holds_only_the_bounds_worth_of_vision_work():
    # a reader's next token waits for the step's vision work: with a decode in the step, the long lane's units are
    # held to the step-time bound (at least one a step: progress); with nobody decoding, images are encoded whole
    sched = scheduler(step_time_target="auto", max_batched_tokens=1024)
    sched.add(fake_request("chat", prompt_len=60, max_tokens=400))
    run_step(sched)  # its prompt: from now on it decodes
    sched.add(fake_request("photos", prompt_len=3000, max_tokens=1, encoder_depth=4, arrival_seq=1,
                           images=[("a", 100, 50), ("b", 1000, 50), ("c", 2000, 50)]))
    bound = sched.pacing.step_time_target() - sched.cost_model.coef[0]
    photos = sched.requests["photos"]
    vision_steps = 0
    while photos.num_computed_tokens < photos.num_prompt_tokens:
        batch = run_step(sched)
        assert sched.last_step.throughput and any(c.request_id == "chat" for c in batch.chunks)
        priced = [sched.cost_model.work_s(encoder_units(u.num_patches, u.attention_pairs))
                  for w in batch.encoder_work
                  for u in photos.images[w.image_index].encoder_units[w.start_unit:w.start_unit + w.num_units]]
        vision_steps += bool(priced)
        assert sum(priced) <= bound + 1e-9 or len(priced) == 1
    assert vision_steps >= 6  # 12 units of 50 ms under a 60 ms bound: spread over steps, not encoded whole


def test_deep_into_a_lone_prompt_a_throughput_chunk_is_no_longer_than_the_first():
    # attention makes a chunk at context c cost more than at 0: a throughput step's forward (which a short request
    # arriving during it must wait for) is held to the throughput chunk's price at context 0, so deeper chunks are
    # shorter. Steps: at most ceil(N / n_end), n_end the chunk that fits at the prompt's end
    costs = {**COSTS, "prefill_attention": 1e-6}
    model = CostModel(prior=tuple(costs.get(name, 0.0) for name in FEATURE_NAMES))
    sched = scheduler(step_time_target="auto", max_batched_tokens=1024, cost_model=model)
    size = sched.pacing.throughput_chunk_tokens()
    first_s = model.work_s(prefill_chunk(size, 0, True))
    sched.add(fake_request("doc", prompt_len=3000, max_tokens=1))
    chunks = []
    while sched.has_work:
        chunks += [c for c in run_step(sched).chunks]
    assert chunks[0].num_new_tokens == size
    assert all(model.work_s(prefill_chunk(c.num_new_tokens, c.context_len, c.sample)) <= first_s + 1e-9
               for c in chunks)
    n_end = max(n for n in range(1, size + 1) if model.work_s(prefill_chunk(n, 3000 - n, True)) <= first_s)
    assert chunks[-1].num_new_tokens < size and len(chunks) <= math.ceil(3000 / n_end)


def test_long_requests_together_share_throughput_steps_and_a_given_target_bounds_every_step():
    two = scheduler(step_time_target="auto")
    for i in range(2):
        two.add(fake_request(f"doc{i}", prompt_len=2000, max_tokens=1, arrival_seq=i))
    steps = 0
    while two.has_work:
        batch = run_step(two)
        steps += 1
        assert two.last_step.throughput  # nobody in the short lane: the long lane runs at its speed alone
        assert sum(c.num_new_tokens for c in batch.chunks) <= two.pacing.throughput_chunk_tokens()
    assert steps <= math.ceil(2 * 2000 / two.pacing.throughput_chunk_tokens()) + 1
    fixed = scheduler()  # --step-time-target 0.25 (seconds): the operator's bound holds even for a lone request
    fixed.add(fake_request("doc", prompt_len=2000, max_tokens=1))
    assert predicted(fixed, run_step(fixed)) <= TARGET + 1e-9


def test_in_throughput_steps_the_vision_tower_serves_long_requests_first_come_first_served():
    # two one-image prompts arrive together: the second's image waits until the first's prompt is finished, so the
    # first gets its first token in the steps it takes alone (its leftover token budget still prefills the second's
    # text up to its image); before, the second's whole encode ran in the first's steps and delayed its next chunk
    def first_token_steps(sched, rid: str, log: list) -> int:
        steps = 0
        while sched.has_work:
            batch = run_step(sched)
            steps += 1
            log.append(batch)
            if any(c.request_id == rid and c.sample for c in batch.chunks):
                return steps
        raise AssertionError("no first token")

    def photo(rid: str, seq: int):
        return fake_request(rid, prompt_len=1500, max_tokens=1, encoder_depth=4, arrival_seq=seq,
                            images=[(f"img-{rid}", 100, 500)])

    alone = scheduler(step_time_target="auto", max_batched_tokens=1024)
    alone.add(photo("first", 0))
    alone_steps = first_token_steps(alone, "first", [])
    pair = scheduler(step_time_target="auto", max_batched_tokens=1024)
    pair.add(photo("first", 0))
    pair.add(photo("second", 1))
    log: list = []
    assert first_token_steps(pair, "first", log) == alone_steps
    assert not any(w.request_id == "second" for batch in log[:-1] for w in batch.encoder_work)
    assert any(c.request_id == "second" for batch in log for c in batch.chunks)  # (the budget it left was used)


def test_the_throughput_chunk_is_the_shortest_near_the_cheapest_that_holds_a_typical_short_prompt():
    # attention pairs add up to the same however a prompt is cut: only per-step terms (10 ms here) tell the sizes
    # apart. A shorter chunk is a shorter wait for a short request arriving during the step's forward, so the
    # smallest size within 5% of the cheapest wins, but never one shorter than a typical short prompt
    sched = scheduler(step_time_target="auto", max_batched_tokens=3000)
    assert sched.pacing.throughput_chunk_tokens() == 256  # 3.0 s + 12 x 10 ms, 3.7% over one step; 128: 24 steps, 7.6% over
    for _ in range(10):
        sched.add(fake_request(f"q{len(sched.requests)}", prompt_len=190, max_tokens=1))
    assert sched.pacing.throughput_chunk_tokens() == 256  # typical short prompts of 190 tokens: still 256
    flat = CostModel(prior=tuple({"prefill_tokens": 0.001, "prefill_attention": 1e-6}.get(n, 0.0) for n in FEATURE_NAMES))
    assert scheduler(step_time_target="auto", max_batched_tokens=3000, cost_model=flat).pacing.throughput_chunk_tokens() == 128
    costly_steps = CostModel(prior=tuple({**COSTS, "step": 0.5}.get(n, 0.0) for n in FEATURE_NAMES))
    assert scheduler(step_time_target="auto", max_batched_tokens=3000,
                     cost_model=costly_steps).pacing.throughput_chunk_tokens() == 3000  # a step costs more than 5%: the cap
