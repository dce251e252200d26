"""Stop strings found in O(new characters) per token, however many there are (an Aho–Corasick
automaton).

The old check ran ``text.find(stop)`` for every stop string, and then compared every suffix of the
held-back text with every stop string: per token O(number of stops × their length), which let one
request with 100,000 stop strings run for minutes. Here the stop strings become one trie with
failure links, built once per request in O(total stop characters); then each generated character is
one transition.

The state after a character is the node of the longest suffix of all text fed so far that is a
prefix of some stop string. So:
- a stop string has just ended when that node (or a node reached by following failure links: a
  shorter suffix) ends one; ``_ends[node]`` holds the longest stop string ending there, precomputed;
- the node's depth is exactly how many trailing characters must be held back: they could still grow
  into a stop string, and nothing before them can.

Work bound: a transition adds at most one to the depth, and each failure step removes at least one,
so the failure steps never outnumber the characters fed: ``steps <= 2 x characters``. ``steps``
counts them, so tests check the bound by counting, not timing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = 0


@dataclass(frozen=True)
class StopHit:
    # index just past the stop string's last character, in the text of the ``feed`` call that found
    # it
    end: int
    stop: str  # the stop string; when several end at the same character, the longest


class StopMatcher:
    """Feed text in pieces; ``feed`` returns the first stop string that ends inside the new
    piece."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._next: list[dict[str, int]] = [{}]  # node -> character -> child node
        self._depth: list[int] = [0]  # node -> length of the prefix it stands for
        self._word: list[int] = [-1]  # node -> index of the stop string it completes, -1 if none
        for index, stop in enumerate(stops):
            node = ROOT
            for ch in stop:
                child = self._next[node].get(ch)
                if child is None:
                    child = len(self._next)
                    self._next[node][ch] = child
                    self._next.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._word.append(-1)
                node = child
            self._word[node] = index
        self._stops = tuple(stops)
        self._fail, self._ends = self._link()
        self._node = ROOT
        self.steps = 0  # transitions and failure steps taken since construction (the work done)

    def _link(self) -> tuple[list[int], list[int]]:
        """Failure links (the node of the longest proper suffix that is also in the trie) and, per
        node, the longest stop string ending at it: its own, else its failure node's. Breadth-first:
        O(trie size)."""
        fail = [ROOT] * len(self._next)
        ends = list(self._word)
        queue = deque(self._next[ROOT].values())
        while queue:
            node = queue.popleft()
            if ends[node] < 0:
                ends[node] = ends[fail[node]]
            for ch, child in self._next[node].items():
                f = fail[node]
                while f != ROOT and ch not in self._next[f]:
                    f = fail[f]
                fail[child] = self._next[f].get(ch, ROOT)
                queue.append(child)
        return fail, ends

    @property
    def held_len(self) -> int:
        """Trailing characters of the text fed so far that could still begin a stop string."""
        return self._depth[self._node]

    def feed(self, text: str) -> StopHit | None:
        """Consume ``text``; stop at (and report) the first stop string to end in it. After a hit
        the matcher must not be fed again (generation is over)."""
        node = self._node
        nxt, fail = self._next, self._fail
        for i, ch in enumerate(text):
            while node != ROOT and ch not in nxt[node]:
                node = fail[node]
                self.steps += 1
            node = nxt[node].get(ch, ROOT)
            self.steps += 1
            if self._ends[node] >= 0:
                self._node = node
                return StopHit(i + 1, self._stops[self._ends[node]])
        self._node = node
        return None
