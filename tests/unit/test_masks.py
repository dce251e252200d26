"""Constrained rows' grammar work read by a step (structured/masks.py), with held matchers: a mask is read once;
and the token rule the runner starts a job by is the engine's."""

from __future__ import annotations

import threading

import pytest

from firsttoken.config import GrammarConfig
from firsttoken.structured.masks import STALE, ConstrainedRow, MaskWorker
from firsttoken.types import FinishReason, SamplingParams

VOCAB = 64
HELD_AT_MOST_S = 60.0  # how long a held matcher waits to be released (only code that waits for it reaches this)


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
