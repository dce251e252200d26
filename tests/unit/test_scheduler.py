"""Scheduler behaviour on tiny fakes: continuous batching, chunked prefill, admission, preemption, reuse."""

from __future__ import annotations

import pytest

from firsttoken.batch import RunnerOutput
from firsttoken.scheduler.cost_model import CostModel
from firsttoken.scheduler.request import RequestStatus
from firsttoken.types import FinishReason
from tests.unit.fakes import ManualClock, fake_request, make_scheduler, run_step


def test_long_prompt_is_chunked_under_the_step_budget_and_samples_only_at_the_end():
    sched = make_scheduler(max_batched_tokens=64)
    req = fake_request("a", prompt_len=150, max_tokens=2)
    sched.add(req)
    sizes, samples = [], []
    while sched.has_work:
        batch = run_step(sched)
        sizes.append([c.num_new_tokens for c in batch.chunks])
        samples.append([c.sample for c in batch.chunks])
    assert sizes == [[64], [64], [22], [1]]
    assert samples == [[False], [False], [True], [True]]
    assert sched.kv.num_used_blocks == 0


def test_new_request_joins_a_running_batch_without_waiting_for_it_to_drain():
    sched = make_scheduler(max_batched_tokens=64)
    sched.add(fake_request("a", prompt_len=20, max_tokens=10))
    run_step(sched)
    run_step(sched)  # a is decoding
    sched.add(fake_request("b", prompt_len=20, max_tokens=2, arrival_seq=1))
    batch = run_step(sched)
    assert [(c.request_id, c.num_new_tokens, c.is_decode) for c in batch.chunks] == [
        ("a", 1, True),
        ("b", 20, False),
    ]


def test_decodes_are_served_before_new_prefills_take_the_budget():
    sched = make_scheduler(max_batched_tokens=32)
    sched.add(fake_request("a", prompt_len=10, max_tokens=5))
    run_step(sched)
    sched.add(fake_request("b", prompt_len=100, max_tokens=1, arrival_seq=1))
    batch = run_step(sched)
    assert [(c.request_id, c.num_new_tokens) for c in batch.chunks] == [("a", 1), ("b", 31)]


def test_admission_waits_for_blocks_for_the_whole_prompt_plus_reserve():
    # 8 blocks of 16 = 128 tokens; each request needs ceil((40 + 16) / 16) = 4 blocks
    sched = make_scheduler(num_blocks=8, max_batched_tokens=512, decode_reserve_tokens=16)
    for i in range(3):
        sched.add(fake_request(f"r{i}", prompt_len=40, max_tokens=3, arrival_seq=i))
    batch = run_step(sched)
    assert [c.request_id for c in batch.chunks] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2"]
    while sched.has_work:
        run_step(sched)
    assert sched.kv.num_used_blocks == 0
    assert sched.num_preemptions == 0


def test_decode_growth_that_runs_the_pool_dry_preempts_the_latest_by_recompute():
    # 4 blocks; each 14-token prompt + 2 reserve = 1 block; growth to 3 blocks each forces a preemption
    sched = make_scheduler(num_blocks=4, block_size=16, max_batched_tokens=256, decode_reserve_tokens=2)
    a = fake_request("a", prompt_len=14, max_tokens=40)
    b = fake_request("b", prompt_len=14, max_tokens=40, arrival_seq=1)
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(200):
        if not sched.has_work:
            break
        batch = run_step(sched)
        preempted += batch.preempted_request_ids
    assert not sched.has_work
    assert preempted and set(preempted) == {"b"}
    assert b.stats.num_preemptions == len(preempted)
    assert len(a.output_token_ids) == len(b.output_token_ids) == 40
    assert sched.kv.num_used_blocks == 0


def test_finish_frees_blocks_and_encoder_pins_at_once():
    sched = make_scheduler(max_batched_tokens=16)
    req = fake_request("a", prompt_len=60, images=[("img1", 10, 30)])
    sched.add(req)
    run_step(sched)
    assert sched.kv.num_used_blocks > 0
    sched.finish(req, FinishReason.ABORT)
    assert req.status == RequestStatus.FINISHED
    assert sched.kv.num_used_blocks == 0
    sched.check_invariants()


def test_an_image_is_encoded_once_even_when_its_tokens_span_several_chunks():
    sched = make_scheduler(max_batched_tokens=16, encoder_capacity_tokens=0)
    req = fake_request("a", prompt_len=80, images=[("img1", 10, 50)])
    sched.add(req)
    encodes = []
    while sched.has_work:
        batch = run_step(sched)
        encodes += [w.content_hash for w in batch.encoder_work if w.finishes]
    assert encodes == ["img1"]


def test_repeated_image_in_a_later_request_hits_the_encoder_cache():
    sched = make_scheduler(max_batched_tokens=512, prefix_caching=False)
    sched.add(fake_request("a", prompt_len=60, images=[("img1", 10, 30)]))
    first = run_step(sched)
    while sched.has_work:
        run_step(sched)
    b = fake_request("b", prompt_len=70, images=[("img1", 20, 30)], arrival_seq=1)
    sched.add(b)
    second = run_step(sched)
    assert [w.content_hash for w in first.encoder_work] == ["img1"]
    assert second.encoder_work == ()
    assert b.stats.num_encoder_cache_hits == 1


def test_follow_up_turn_reuses_prompt_blocks_including_image_blocks():
    sched = make_scheduler(max_batched_tokens=512)
    first = fake_request("a", prompt_len=100, images=[("img1", 10, 50)], shared_prefix=True)
    sched.add(first)
    while sched.has_work:
        run_step(sched)
    follow = fake_request("b", prompt_len=130, images=[("img1", 10, 50)], arrival_seq=1, shared_prefix=True)
    sched.add(follow)
    batch = run_step(sched)
    assert batch.chunks[0].context_len == 96  # 6 full blocks of the first turn's 100-token prompt
    assert batch.chunks[0].num_new_tokens == 130 - 96
    assert follow.stats.num_cached_prompt_tokens == 96


def test_different_image_with_same_placeholders_does_not_reuse_blocks():
    sched = make_scheduler(max_batched_tokens=512)
    sched.add(fake_request("a", prompt_len=100, images=[("img1", 10, 50)], shared_prefix=True))
    while sched.has_work:
        run_step(sched)
    other = fake_request("b", prompt_len=100, images=[("img2", 10, 50)], arrival_seq=1, shared_prefix=True)
    sched.add(other)
    batch = run_step(sched)
    assert batch.chunks[0].context_len == 0  # block 0 (tokens 0..15) already covers image tokens 10..15


class Observed(CostModel):
    """The cost model, keeping the seconds it was taught for each step."""

    def __init__(self) -> None:
        super().__init__()
        self.taught_s: list[float] = []

    def observe(self, features, seconds: float) -> None:
        self.taught_s.append(seconds)
        super().observe(features, seconds)


def test_the_cost_model_learns_a_steps_work_not_its_wait_for_grammar_masks():
    """A step that waited for a constrained row's mask ran no model work meanwhile: the step-cost model is taught
    its wall time less that wait (else every step beside a slow grammar would price the next ones higher)."""
    clock, model = ManualClock(), Observed()
    sched = make_scheduler(clock=clock, cost_model=model)
    sched.add(fake_request("a", prompt_len=20, max_tokens=4))
    batch = sched.schedule()
    started = clock()
    clock.now += 0.05
    result = RunnerOutput({"a": 7}, {}, {}, mask_wait_s=0.01)
    sched.update(batch, result)
    report = sched.learn_step(batch, result, started)
    assert model.taught_s == [pytest.approx(0.04)]
    assert report.duration_s == pytest.approx(0.05)  # the step's wall time, as it was
