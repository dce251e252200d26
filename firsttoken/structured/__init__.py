"""Constrained decoding: a request's output spec (JSON schema, JSON object, regex, choice, grammar)
compiled once per distinct spec, a matcher per request that says which tokens may come next, and the
bitmask applied to the logits. Which library and why: docs/structured_outputs.md."""

from firsttoken.structured.bitmask import allocate_bitmask, apply_bitmask
from firsttoken.structured.compiler import CacheStats, CompiledGrammar, GrammarCompiler
from firsttoken.structured.matcher import GrammarMatcher
from firsttoken.structured.spec import GrammarSpec, from_response_format, from_structured_outputs

__all__ = [
    "CacheStats",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "GrammarSpec",
    "allocate_bitmask",
    "apply_bitmask",
    "from_response_format",
    "from_structured_outputs",
]
