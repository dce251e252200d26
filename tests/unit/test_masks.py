"""Constrained rows' grammar work read by a step (structured/masks.py), with injected clocks and held matchers: a
pending mask is waited for once, not every step; a mask is read once; and the token rule the runner starts a job by
is the engine's."""

from __future__ import annotations

import threading

import pytest

from firsttoken.config import GrammarConfig
from firsttoken.structured.masks import STALE, ConstrainedRow, MaskWorker
from firsttoken.types import FinishReason, SamplingParams

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
