"""Incremental detokenization: token ids in, text deltas out, cheaply and safely.

Contract of ``IncrementalDetokenizer.add``:
- it never emits half a character: a byte-level BPE token may end inside a multi-byte UTF-8
  sequence; text whose decode ends in U+FFFD is held back until the next token completes it
  (``flush`` releases it as is);
- it never emits any part of a stop string: a suffix of the text that could still grow into a stop
  string is held back; when a stop string appears the text is cut just before it, ``stopped`` is
  set, the matched string is reported, and every later call returns nothing. When several stop
  strings complete within one step, the one that ends first wins (as if the text had arrived one
  character at a time), the longest on a tie;
- per token it decodes a window of a few tokens (vLLM's prefix/read offsets), not the whole output,
  and the stop strings cost O(new characters) (engine/stop_strings.py), however many there are: the
  cost per token is bounded by the token's own text plus what is held back (shorter than the longest
  stop string).

Offsets index ``self._ids``: ``[prefix_offset, read_offset)`` is the context already turned into
text (decoded again only so the new token joins it correctly, e.g. a leading space),
``[read_offset, len)`` is not yet text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from firsttoken.engine.stop_strings import StopMatcher

# Prompt tokens kept as decoding context: enough for any merge to see its left neighbour.
PROMPT_CONTEXT_TOKENS = 5
# Tokens already emitted are dropped from the window buffer once this many pile up.
TRIM_THRESHOLD_TOKENS = 64
REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """Anything with a HF-style decode: transformers tokenizers and ``tokenizers.Tokenizer`` both
    fit."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class DetokenizerDelta:
    text: str  # new text safe to send: whole characters, no part of a stop string
    stopped: bool  # a stop string was reached; generation should end with FinishReason.STOP
    stop_str: str | None = None  # the stop string that matched (not included in any text)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: Sequence[int] = (),
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = StopMatcher(stop) if stop else None
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pending = ""  # decoded but held back: may be the start of a stop string
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def num_stop_steps(self) -> int:
        """Work spent matching stop strings so far (automaton steps, at most 2 per character
        generated)."""
        return self._stop.steps if self._stop is not None else 0

    def add(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Take the new tokens of one step; return the text that may be sent now."""
        if self._stopped:
            return DetokenizerDelta("", True)
        decoded = []
        for token_id in token_ids:
            self._ids.append(token_id)
            decoded.append(self._decode_step())
        self._trim()
        return self._release("".join(decoded), final=False)

    def flush(self) -> str:
        """At the end of generation: everything still held back (incomplete characters decode as
        U+FFFD, a partial stop-string match is ordinary text after all), cut at a stop string if one
        completes."""
        if self._stopped:
            return ""
        tail = ""
        if self._read_offset < len(self._ids):
            prefix_text = self._decode(self._prefix_offset, self._read_offset)
            tail = self._decode(self._prefix_offset, len(self._ids))[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(tail, final=True).text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def _decode_step(self) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # a special token skipped, or a character still incomplete: wait for more tokens
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _trim(self) -> None:
        if self._prefix_offset >= TRIM_THRESHOLD_TOKENS:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _release(self, new_text: str, final: bool) -> DetokenizerDelta:
        text = self._pending + new_text
        if self._stop is None:
            self._pending = ""
            return DetokenizerDelta(text, False)
        # The matcher has seen the held-back text already: only the new characters are fed.
        hit = self._stop.feed(new_text)
        if hit is not None:
            # >= 0: the held text covers the match's start
            cut = len(self._pending) + hit.end - len(hit.stop)
            self._stopped = True
            self._pending = ""
            return DetokenizerDelta(text[:cut], True, hit.stop)
        keep = 0 if final else self._stop.held_len
        self._pending = text[len(text) - keep :] if keep else ""
        return DetokenizerDelta(text[: len(text) - keep], False)
