"""How many tokens a text has at least, found without tokenizing more of it than the limit needs.

A prompt far over the limit is refused without being tokenized whole. The text is measured in three
steps, each taken only when the ones before could not decide:

1. characters: no token covers more than ``max_chars_per_token`` characters (the longest string in
   the tokenizer's vocabulary, added tokens included: a byte-level token's string has one character
   per byte, and a byte decodes to at most one character), so the text has at least
   ``ceil(chars / max_chars_per_token)`` tokens. Over the limit: refused, nothing tokenized;
2. bytes: every byte-level token covers at least one byte, so text of at most ``limit`` UTF-8 bytes
   cannot pass the limit: nothing more to do here. Nor is there for text of at most ``PIECE_CHARS``
   characters: counting it would cost as much as the exact tokenization the caller does next, which
   says more;
3. pieces: the text is tokenized ``PIECE_CHARS`` characters at a time, cut just before a space that
   follows a non-space (where GPT-2-style pre-tokenizers split anyway), and counting stops as soon
   as the count passes the limit. A cut changes only the tokens around it, by fewer than
   ``CUT_SLACK_TOKENS``, which is subtracted per piece, so the count stays a lower bound.

Special tokens are honoured while counting (``<|im_start|>`` typed as text counts as 1 token, though
a chat template would split it into several): the fewest tokens the text could be, so a lower bound
either way. What passes is tokenized exactly by the caller; this only ever refuses early, never lets
through a prompt the exact count would refuse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

PIECE_CHARS = 8192  # characters tokenized at a time (~2,000 tokens of English: milliseconds)
CUT_SLACK_TOKENS = 8  # tokens a cut between pieces can save at most, subtracted per piece
MAX_UTF8_BYTES_PER_CHAR = 4


@dataclass(frozen=True)
class TextSize:
    num_chars: int
    min_tokens: int  # a proven lower bound on the tokens of the text (exact only by chance)
    num_chars_tokenized: int  # the work done: characters handed to the tokenizer


def longest_token_chars(vocabulary: Sequence[str]) -> int:
    """The most characters one token can stand for, from the token strings of a vocabulary."""
    return max((len(token) for token in vocabulary), default=1)


def measure_text(
    texts: Sequence[str],
    limit: int,
    encode: Callable[[str], Sequence[int]],
    max_chars_per_token: int,
) -> TextSize:
    """A lower bound on the tokens of ``texts`` (tokenized separately), exceeding ``limit`` whenever
    one of the three steps proves the texts exceed it. ``encode`` must honour special tokens (the
    fewest tokens)."""
    num_chars = sum(map(len, texts))
    by_chars = -(-num_chars // max_chars_per_token)
    if by_chars > limit or num_chars * MAX_UTF8_BYTES_PER_CHAR <= limit or num_chars <= PIECE_CHARS:
        return TextSize(num_chars, by_chars, 0)
    if sum(len(t.encode("utf-8")) for t in texts) <= limit:
        return TextSize(num_chars, by_chars, 0)
    counted = 0
    tokenized = 0
    for text in texts:
        for piece in pieces(text, PIECE_CHARS):
            counted += len(encode(piece)) - CUT_SLACK_TOKENS
            tokenized += len(piece)
            if counted > limit:
                return TextSize(num_chars, counted, tokenized)
    return TextSize(num_chars, max(by_chars, counted), tokenized)


def pieces(text: str, size: int) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``size`` characters, each cut (where the back half
    of the piece allows) just before a space that follows a non-space."""
    start = 0
    while len(text) - start > size:
        end = start + size
        cut = text.rfind(" ", start + size // 2, end)
        if cut > start and not text[cut - 1].isspace():
            end = cut
        yield text[start:end]
        start = end
    if start < len(text) or not text:
        yield text[start:]
