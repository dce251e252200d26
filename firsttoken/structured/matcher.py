"""One request's place in its grammar: ``GrammarMatcher``.

Contract: ``fill_bitmask(bitmask, row)`` writes which tokens may come next into that row of a
bitmask (``bitmask.py``: bit ``t % 32`` of word ``t // 32`` set = token t allowed);
``accept(token)`` advances by one token and returns False when the grammar does not allow it, after
which the matcher is in error (``error`` says why) and allows only the end-of-sequence tokens until
``reset``; a fill that finds no token to continue an incomplete output (a grammar that matches
nothing, or nothing past this point) leaves it in error too: ``error`` is then ``DEAD_END`` (the EOS
such a mask allows is no answer); ``is_finished`` once the grammar has ended (an EOS was accepted
where the grammar may end, or nothing can follow). ``replay(tokens)`` resets and accepts a request's
output again, for preemption by recompute. Not thread-safe: one request, one thread at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np

from firsttoken.structured.messages import one_line

DEAD_END = "no token can continue the output: the grammar matches no text that begins with it"
# llguidance's error where a mask allows no token (and so only EOS)
_NO_EXTENSION = "NoExtensionBias"


class GrammarMatcher:
    def __init__(self, pristine: llguidance.LLMatcher) -> None:
        """``pristine``: the compiled grammar's matcher at its start; only copied, never advanced (a
        reset takes a fresh copy: an llguidance matcher in error stays in error through its own
        reset)."""
        self._pristine = pristine
        self._matcher = pristine.deep_copy()
        self._num_accepted = 0

    @property
    def num_accepted(self) -> int:
        """Tokens accepted since the start (or the last reset)."""
        return self._num_accepted

    @property
    def is_finished(self) -> bool:
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the grammar failed (a token it does not allow, a parser limit, a dead end: after a
        fill, no token can continue the output and the grammar is not complete), or None."""
        m = self._matcher
        if not m.is_error():
            return DEAD_END if m.is_stopped() and not m.is_accepting() else None
        why = one_line(m.get_error() or "grammar error")
        return DEAD_END if why == _NO_EXTENSION else why

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """bitmask: [rows, ceil(vocab / 32)] int32 (``allocate_bitmask``); writes row ``row``
        only."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows next and nothing else, in order (after a fill): every
        answer from here goes on with them."""
        return list(self._matcher.compute_ff_tokens())

    def accept(self, token_id: int) -> bool:
        if not self._matcher.consume_token(token_id):
            return False
        self._num_accepted += 1
        return True

    def reset(self) -> None:
        """Back to the grammar's start, out of any error."""
        self._matcher = self._pristine.deep_copy()
        self._num_accepted = 0

    def replay(self, token_ids: Sequence[int]) -> bool:
        """Reset, then accept ``token_ids`` in order; False (and in error) at the first one not
        allowed."""
        self.reset()
        return all(self.accept(t) for t in token_ids)
