"""Constrained rows' grammar work read by a step (structured/masks.py), with injected clocks and held matchers: a
pending mask is waited for once, not every step; a mask is read once; the budget charges a job's CPU time, not its
wall time; a mask that never comes (its job queued behind slow ones, or never ending) ends its request in bounded
time; and the token rule the runner starts a job by is the engine's."""

from __future__ import annotations

import itertools
import threading

import pytest

from firsttoken.config import GrammarConfig
from firsttoken.structured.masks import STALE, ConstrainedRow, MaskWorker
from firsttoken.types import FinishReason, SamplingParams
from tests.unit.fakes import ManualClock

VOCAB = 64
HELD_AT_MOST_S = 60.0  # how long a held matcher waits to be released (only code that waits for it reaches this)


class TickingClock:
    """Each reading one second after the last: a wait measured on it is its number of readings, never wall time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class Matcher:
    """Allows every token. With ``release``, each mask is filled only once the test releases it (a library stuck on an
    ambiguous grammar); ``on_fill`` runs as each mask is filled."""

    error = None

    def __init__(self, release: threading.Event | None = None, on_fill=None) -> None:
        self.release, self.on_fill = release, on_fill

    def fill_bitmask(self, bitmask, row: int) -> None:
        if self.release is not None:
            self.release.wait(HELD_AT_MOST_S)
        if self.on_fill is not None:
            self.on_fill()
        bitmask[row] = -1

    def accept(self, token_id: int) -> bool:
        return True


def done(row: ConstrainedRow) -> ConstrainedRow:
    row.wait(HELD_AT_MOST_S)
    assert row.done
    return row


@pytest.mark.parametrize("token, num_output_tokens, reason", [
    (9, 1, None), (9, 4, FinishReason.LENGTH), (2, 1, FinishReason.STOP), (7, 1, FinishReason.STOP),
    (2, 4, FinishReason.STOP)])
def test_the_token_rule_says_why_an_answer_ends(token: int, num_output_tokens: int, reason) -> None:
    """The one rule the engine ends an answer by and the runner starts a grammar job by (no job after the last
    token): a stop token id or an EOS id is a stop, the max_tokens-th token a length, anything else goes on."""
    params = SamplingParams(max_tokens=4, stop_token_ids=(7,), eos_token_ids=(2,))
    assert params.finish_after(token, num_output_tokens) == reason


def test_with_ignore_eos_only_the_requests_own_stop_tokens_end_it() -> None:
    params = SamplingParams(max_tokens=4, stop_token_ids=(7,), eos_token_ids=(2,), ignore_eos=True)
    assert params.finish_after(2, 1) is None and params.finish_after(7, 1) == FinishReason.STOP


def test_a_mask_is_read_once_and_never_ready_again_without_a_new_job() -> None:
    """A row sampled under its mask whose next job was not started (a token the runner thought ended the answer)
    is an internal error, not a sample under the last token's mask."""
    worker = MaskWorker(GrammarConfig())
    row = ConstrainedRow(Matcher(), VOCAB)
    worker.start(row)
    done(row)
    assert worker.collect({"r": row}).ready == {"r"}
    stale = worker.collect({"r": row})
    assert stale.ready == frozenset() and stale.crashed == {"r": STALE}
    worker.start(row, token_id=5)
    done(row)
    assert worker.collect({"r": row}).ready == {"r"}


def test_a_pending_mask_is_waited_for_once_not_every_step() -> None:
    """A row pending for k steps costs its batch-mates one wait, in the first step that asks for its mask; each new
    job's mask is waited for once again. The seconds waited are reported on the worker's clock."""
    worker = MaskWorker(GrammarConfig(mask_wait_s=0.01, request_mask_s=1e6), clock=TickingClock())
    release = threading.Event()
    row = ConstrainedRow(Matcher(release), VOCAB)
    worker.start(row)
    try:
        held = [worker.collect({"r": row}) for _ in range(5)]
    finally:
        release.set()
    assert [s.pending for s in held] == [frozenset({"r"})] * 5
    assert [s.num_waits for s in held] == [1, 0, 0, 0, 0]
    assert [s.wait_s for s in held] == [1.0, 0.0, 0.0, 0.0, 0.0]  # one tick between its two readings
    done(row)
    step = worker.collect({"r": row})
    assert step.ready == {"r"} and step.num_waits == 0 and step.wait_s == 0.0

    again = threading.Event()
    row.matcher.release = again
    worker.start(row, token_id=3)  # the next token's job: a step may wait for it once more
    try:
        held = [worker.collect({"r": row}) for _ in range(3)]
    finally:
        again.set()
    assert [s.num_waits for s in held] == [1, 0, 0] and all(s.pending == {"r"} for s in held)


def test_the_budget_charges_a_jobs_cpu_time_not_its_wall_time() -> None:
    """A job whose thread waited long for a core (100 s of wall time here) spends only what it computed; the CPU
    seconds the injected thread clock says each job used add up to the budget, and past it the request ends."""
    wall = ManualClock()
    worker = MaskWorker(GrammarConfig(request_mask_s=1.0), clock=wall)
    row = ConstrainedRow(Matcher(on_fill=lambda: setattr(wall, "now", wall.now + 100.0)), VOCAB)
    worker.start(row)
    step = worker.collect({"r": done(row)})
    assert step.ready == {"r"} and step.refused == {}

    cpu = itertools.count(0.0, 0.4)  # each job reads it twice: 0.4 s of CPU a job
    worker = MaskWorker(GrammarConfig(request_mask_s=1.0), clock=wall, cpu_clock=lambda: next(cpu))
    row = ConstrainedRow(Matcher(), VOCAB)
    verdicts = []
    for token in (None, 1, 2):
        worker.start(row, token)
        step = worker.collect({"r": done(row)})
        verdicts.append("ready" if step.ready else step.refused["r"])
    assert verdicts[:2] == ["ready", "ready"]  # 0.4 s, 0.8 s
    assert "more than 1 s of work (--grammar-mask-budget)" in verdicts[2]  # 1.2 s


def test_a_mask_that_does_not_come_ends_its_request_after_the_pending_bound() -> None:
    """One grammar thread, held by a job that never ends (its CPU is counted only when it does), and a second
    request's job queued behind it (it spends nothing): both stay pending up to twice the budget in wall time from
    the first step that asked for their masks, then both end with the client's-grammar 400."""
    wall = ManualClock()
    config = GrammarConfig(mask_threads=1, mask_wait_s=0.0, request_mask_s=1.0)
    assert config.pending_mask_s == 2.0
    worker = MaskWorker(config, clock=wall)
    release = threading.Event()
    slow, queued = ConstrainedRow(Matcher(release), VOCAB), ConstrainedRow(Matcher(), VOCAB)
    worker.start(slow)
    worker.start(queued)
    try:
        rows = {"slow": slow, "queued": queued}
        verdicts = []
        for advance_s in (0.0, 1.5, 0.4, 0.2):
            wall.now += advance_s
            verdicts.append(worker.collect(rows))
    finally:
        release.set()
    assert [s.pending for s in verdicts[:3]] == [{"slow", "queued"}] * 3  # 0, 1.5, 1.9 s
    assert verdicts[3].pending == frozenset() and verdicts[3].refused.keys() == {"slow", "queued"}  # 2.1 s
    assert "waited more than 2 s" in verdicts[3].refused["queued"]
    assert "--grammar-mask-budget" in verdicts[3].refused["queued"]
