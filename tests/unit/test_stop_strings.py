"""StopMatcher against a brute-force oracle, and its work counted: O(new characters) per token, whatever the
number and length of the stop strings (the limits a request may bring: 32 strings of 256 characters)."""

from __future__ import annotations

import random

import pytest

from firsttoken.engine.stop_strings import StopMatcher
from firsttoken.types import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Oracle: the stop string that ends first in ``text`` (longest on a tie), as (end index, stop)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def held_oracle(text: str, stops: tuple[str, ...]) -> int:
    """Oracle: the longest suffix of ``text`` that is a prefix of some stop string."""
    return max((k for k in range(len(text) + 1) if any(s.startswith(text[len(text) - k :]) for s in stops)), default=0)


def test_matcher_agrees_with_brute_force_on_random_texts_fed_in_random_pieces() -> None:
    for seed in range(500):  # small alphabets: overlapping, nested and repeated stops are the common case
        rng = random.Random(seed)
        alphabet = "ab" if seed % 2 else "abc"
        stops = tuple({"".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 6))})
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
        matcher = StopMatcher(stops)
        fed, found = "", None
        while len(fed) < len(text) and found is None:
            piece = text[len(fed) : len(fed) + rng.randint(1, 4)]
            hit = matcher.feed(piece)
            if hit is not None:
                found = (len(fed) + hit.end, hit.stop)
            else:
                fed += piece
                assert matcher.held_len == held_oracle(fed, stops), (seed, stops, fed)
        assert found == first_stop(text, stops), (seed, stops, text)


def test_the_stop_that_ends_first_wins_and_the_longest_on_a_tie() -> None:
    hit = StopMatcher(("abcd", "bc")).feed("xabcd")
    assert (hit.end, hit.stop) == (4, "bc")  # "bc" was complete before "abcd" could be
    hit = StopMatcher(("cd", "abcd")).feed("xabcd")
    assert (hit.end, hit.stop) == (5, "abcd")  # both end at "d": the longer one, so no part of it is sent


def test_work_per_character_is_constant_whatever_the_stops() -> None:
    """Adversarial stops (long near-misses of the generated text), at the request limits: the matcher takes at
    most two steps per character fed, where the old scan took O(#stops x length) per token."""
    stops = tuple("a" * (MAX_STOP_STRING_CHARS - 1 - i) + "b" for i in range(MAX_STOP_STRINGS))
    matcher = StopMatcher(stops)
    text = ("a" * 300 + "c") * 50  # every run of a's nearly completes every stop, then fails
    for i in range(0, len(text), 3):  # about one token's worth per step
        assert matcher.feed(text[i : i + 3]) is None
    assert matcher.steps <= 2 * len(text)
    assert matcher.held_len == 0  # the text ended on "c", which starts no stop


def test_many_stops_cost_the_same_per_character_as_one() -> None:
    text = "the quick brown fox jumps over the lazy dog " * 200
    one, many = StopMatcher(("###",)), StopMatcher(tuple(f"##{i}" for i in range(10_000)))
    assert one.feed(text) is None and many.feed(text) is None
    assert one.steps == many.steps == len(text)  # no "#" in the text: one transition per character


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopMatcher(("ok", ""))
