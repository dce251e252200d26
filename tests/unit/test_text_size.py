"""measure_text: huge text is refused after tokenizing a bounded part of it (work counted, not timed), and what
it reports is a lower bound of the exact count (checked against the shipped tokenizer)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer

from firsttoken.inputs.text_size import (
    CUT_SLACK_TOKENS,
    PIECE_CHARS,
    longest_token_chars,
    measure_text,
    pieces,
)
from firsttoken.models.train_tokenizer import ASSET_PATH


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(ASSET_PATH))


class CountingEncoder:
    """The shipped tokenizer, counting the characters it was asked to encode."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.chars = 0

    def __call__(self, text: str) -> Sequence[int]:
        self.chars += len(text)
        return self.tok.encode(text, add_special_tokens=False).ids


def test_text_over_the_character_bound_is_refused_without_tokenizing(tok: Tokenizer) -> None:
    encode = CountingEncoder(tok)
    longest = longest_token_chars(list(tok.get_vocab()))
    size = measure_text(["x" * 5_000_000], 1000, encode, longest)
    assert size.min_tokens > 1000 and encode.chars == 0 and size.num_chars_tokenized == 0


def test_text_between_the_bounds_is_tokenized_only_until_the_limit_is_passed(tok: Tokenizer) -> None:
    encode = CountingEncoder(tok)
    text = "a few ordinary words " * 200_000  # 4.2 M characters, ~800 k tokens; the limit is 2,000
    size = measure_text([text], 2000, encode, max_chars_per_token=10**9)  # the character bound cannot decide
    assert size.min_tokens > 2000
    assert encode.chars == size.num_chars_tokenized <= 3 * PIECE_CHARS  # not 4.2 M


def test_short_or_fitting_text_is_not_tokenized_here(tok: Tokenizer) -> None:
    encode = CountingEncoder(tok)
    assert measure_text(["hello " * 1000], 100_000, encode, 96).min_tokens <= 100_000  # bytes <= limit
    assert measure_text(["hello " * 1000], 10, encode, 96).num_chars_tokenized == 0  # one piece: exact path decides
    assert encode.chars == 0


def test_the_count_never_exceeds_the_exact_tokenization(tok: Tokenizer) -> None:
    """The lower bound is sound: across cuts, on varied text, counted <= exact (which the caller computes)."""
    rng = random.Random(3)
    words = ["word", " word", "  ", "\n", "中文", "😀", "don't", " 123", "...", "<|im_start|>", "\t", "ab" * 40]
    for _ in range(20):
        text = "".join(rng.choices(words, k=rng.randint(3000, 9000)))
        exact = len(tok.encode(text, add_special_tokens=False).ids)
        size = measure_text([text], 1, CountingEncoder(tok), max_chars_per_token=10**9)  # forces the pieces path
        assert size.min_tokens <= exact


def test_pieces_cover_the_text_and_cut_before_a_space_after_a_word() -> None:
    text = ("lorem ipsum dolor " * 2000) + "tail"
    parts = list(pieces(text, 1000))
    assert "".join(parts) == text and all(len(p) <= 1000 for p in parts)
    assert all(p.startswith(" ") for p in parts[1:])  # cut where a GPT-2 pre-tokenizer splits anyway
    no_spaces = "中" * 2500
    assert [len(p) for p in pieces(no_spaces, 1000)] == [1000, 1000, 500]
    assert list(pieces("", 1000)) == [""]


def test_slack_is_subtracted_per_piece() -> None:
    one_token_per_char = lambda text: list(text)  # noqa: E731
    limit = 3 * PIECE_CHARS - 1  # just under the text's bytes, so the pieces decide
    size = measure_text(["a" * (3 * PIECE_CHARS)], limit, one_token_per_char, max_chars_per_token=10**9)
    assert size.min_tokens == 3 * PIECE_CHARS - 3 * CUT_SLACK_TOKENS and size.num_chars_tokenized == 3 * PIECE_CHARS
