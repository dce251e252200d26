"""GrammarSpec -> CompiledGrammar, once per distinct spec: ``GrammarCompiler``.

llguidance does the work: a spec becomes an llguidance grammar (JSON schema, Lark, regex), and an
``LLMatcher`` built from it over the model's tokenizer is the compiled form (building it parses the
grammar and checks it against the vocabulary; an error there is the spec's fault). A grammar no
output can match is refused too, whatever its kind: the JSON schema compiler proves many schemas
unsatisfiable itself; for every kind, a grammar whose first mask, or a mask after the text every
answer must begin with, allows no token (a regex of an empty class, a Lark rule of one after a
literal) is refused here (a dead end further on ends its request while decoding: masks.py). The
compiled grammar keeps that matcher untouched; each request gets a copy
(``CompiledGrammar.matcher()``), so a repeated spec costs one dictionary look-up and a copy.

Thread-safe: the preprocessing pools compile from several threads. Two threads compiling the same
new spec at once both compile it (the second result replaces the first; both are equal); the cache
is a bounded LRU.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from firsttoken.structured.bitmask import allocate_bitmask
from firsttoken.structured.matcher import DEAD_END, GrammarMatcher
from firsttoken.structured.messages import one_line
from firsttoken.structured.spec import GrammarSpec

# JSON whitespace between tokens: any of JSON's four whitespace characters, at most 16 in a row (a
# line break and 15 spaces of indentation). Unbounded (vLLM's default) lets a weak model spend its
# answer on whitespace (the random demo model's receipts then ran to thousands of tokens, nearly all
# spaces and line breaks).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
# how far along the text every answer must begin with (a Lark literal, a schema's "{") a compile
# looks for a dead end
FORCED_PROBE_TOKENS = 128


@dataclass(frozen=True)
class CompiledGrammar:
    spec: GrammarSpec
    compile_s: float  # what compiling it took, the first time
    warnings: tuple[str, ...]  # what a non-strict schema's compile ignored (unenforceable keywords)
    _pristine: llguidance.LLMatcher  # never advanced: only copied

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start, owned by one request."""
        return GrammarMatcher(self._pristine)


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int  # = compiles, refused specs included
    entries: int
    compile_s: float  # total seconds spent compiling


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary width (the logits' width, which may exceed
    the tokenizer's: ids past the tokenizer are never allowed)."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        *,
        max_cached: int = 256,
        max_source_bytes: int = 1 << 20,
        json_whitespace: str | None = JSON_WHITESPACE,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``json_whitespace``: a regex for the whitespace JSON may carry between tokens (None: any
        amount, as vLLM's default). ``max_source_bytes``: a longer spec is refused before
        compiling."""
        if max_cached < 1:
            raise ValueError("max_cached must be at least 1")
        self.tokenizer = tokenizer
        self._max_cached = max_cached
        self._max_source_bytes = max_source_bytes
        self._json_whitespace = json_whitespace
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._hits = self._misses = 0
        self._compile_s = 0.0

    @classmethod
    def from_tokenizer_json(cls, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                            **options: Any) -> GrammarCompiler:
        """Over a Hugging Face ``tokenizer.json`` (its text). Building the token trie is a one-off
        cost (a fraction of a second at 16k tokens, seconds at Qwen's 151k): do it once at
        start-up."""
        if not eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token (the grammar's end)")
        tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        return cls(tokenizer, **options)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._cache), self._compile_s)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The spec's compiled grammar, from the cache when it was compiled before. ValueError
        (naming the spec's field and what is wrong) for a spec that does not compile; refused specs
        are not cached."""
        return self.lookup(spec)[0]

    def lookup(self, spec: GrammarSpec) -> tuple[CompiledGrammar, bool]:
        """(the compiled grammar, whether it came from the cache): ``compile``, saying which."""
        with self._lock:
            cached = self._cache.get(spec.key)
            if cached is not None:
                self._cache.move_to_end(spec.key)
                self._hits += 1
                return cached, True
            self._misses += 1
        start = self._clock()
        try:
            pristine, warnings = self._build(spec)
        finally:
            seconds = self._clock() - start
            with self._lock:
                self._compile_s += seconds
        compiled = CompiledGrammar(spec, seconds, warnings, pristine)
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled, False

    def _build(self, spec: GrammarSpec) -> tuple[llguidance.LLMatcher, tuple[str, ...]]:
        where = spec.origin or spec.kind
        size = len(spec.source.encode("utf-8"))
        if size > self._max_source_bytes:
            raise ValueError(
                f"{where} is {size} bytes; at most {self._max_source_bytes} are accepted"
            )
        try:
            grammar = self._grammar(spec)
        except ValueError as e:
            raise ValueError(f"{where}: {one_line(str(e))}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{where}: {one_line(matcher.get_error())}")
        dead_end = self._dead_end(matcher)
        if dead_end is not None:
            why = "" if dead_end == DEAD_END else f" ({dead_end})"
            raise ValueError(f"{where}: no output can match it{why}")
        return matcher, tuple(one_line(w) for w in matcher.get_grammar_warnings())

    def _dead_end(self, pristine: llguidance.LLMatcher) -> str | None:
        """Why no output can match the grammar, where the output every answer begins with shows it:
        the first mask, then each mask after the tokens the grammar forces from there (at most
        ``FORCED_PROBE_TOKENS`` in all); None where none is found (a dead end further on ends its
        request while decoding)."""
        # a copy: the compiled grammar's own matcher stays at its start
        probe = GrammarMatcher(pristine)
        mask = allocate_bitmask(1, self.vocab_size)
        budget = FORCED_PROBE_TOKENS
        while True:
            probe.fill_bitmask(mask, 0)
            if probe.error is not None:
                return probe.error
            forced = probe.forced_tokens()[:budget]
            if not forced:
                return None
            if not all(probe.accept(t) for t in forced):
                return probe.error
            budget -= len(forced)

    def _grammar(self, spec: GrammarSpec) -> str:
        if spec.kind in ("json_schema", "json_object"):
            options: dict[str, object] = {"whitespace_flexible": True, "lenient": not spec.strict}
            if self._json_whitespace is not None:
                options["whitespace_pattern"] = self._json_whitespace
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=options)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            return llguidance.grammar_from("choice", spec.source)
        # Lark, or GBNF (llama.cpp's, as vLLM takes) to Lark
        return llguidance.grammar_from("grammar", spec.source)

