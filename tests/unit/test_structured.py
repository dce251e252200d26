"""Constrained decoding (firsttoken/structured): whatever the logits say, a constrained greedy decode over the
checkpoints' real tokenizer (16,000 BPE tokens + specials, padded to 16,064 logits) yields text that parses and
matches its spec; a repeated spec compiles once; a bad spec is refused with what is wrong; a matcher replays to the
same state; rows without a grammar are left as they were."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from firsttoken.inputs.tool_prompts import forced_call_spec
from firsttoken.models.recipe import TOKEN_IDS, VOCAB_SIZE
from firsttoken.models.train_tokenizer import ASSET_PATH
from firsttoken.structured import (
    GrammarCompiler,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
    apply_bitmask,
    from_response_format,
    from_structured_outputs,
)

EOS_IDS = (TOKEN_IDS["<|im_end|>"], TOKEN_IDS["<|endoftext|>"])
MAX_STEPS = 4000

RECEIPT_SCHEMA = {
    "type": "object",
    "properties": {
        "merchant": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "address": {"type": "string"},
                           "phone": {"type": "string", "pattern": "^\\+?[0-9 ()-]{6,20}$"}},
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CNY"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string", "maxLength": 40},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit_price": {"type": "number"},
                    "category": {"type": "string", "enum": ["food", "drink", "household", "other"]},
                },
                "required": ["description", "quantity", "unit_price", "category"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number"},
        "payment": {"type": "string", "enum": ["cash", "card", "other"]},
    },
    "required": ["merchant", "date", "currency", "items", "total", "payment"],
    "additionalProperties": False,
}
RECEIPT_FORMAT = {"type": "json_schema", "json_schema": {"name": "receipt", "schema": RECEIPT_SCHEMA, "strict": True}}
# a receipt as a model would write it (the replay tests walk part of it)
RECEIPT_TEXT = ('{"merchant": {"name": "Corner Bakery", "address": "12 Market St"}, "date": "2026-11-28", '
                '"currency": "EUR", "items": [{"description": "Flat white", "quantity": 2, "unit_price": 4.25, '
                '"category": "drink"}], "total": 8.5, "payment": "card"}')


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(ASSET_PATH))


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler.from_tokenizer_json(ASSET_PATH.read_text(), VOCAB_SIZE, EOS_IDS)


def decode_greedy(matcher: GrammarMatcher, seed: int, prefix: list[int] | None = None) -> list[int]:
    """Greedy decoding over random logits (a fresh [1, vocab] tensor each step), the matcher's mask applied first;
    the tokens before the EOS that ended it."""
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, VOCAB_SIZE)
    out = list(prefix or [])
    assert all(matcher.accept(t) for t in out)
    for _ in range(MAX_STEPS):
        logits = torch.randn(1, VOCAB_SIZE, generator=generator) * 4  # [1, vocab]
        matcher.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask, [0])
        token = int(torch.argmax(logits[0]))
        assert matcher.accept(token), matcher.error
        if token in EOS_IDS:
            assert matcher.is_finished
            return out
        out.append(token)
    raise AssertionError(f"no end of sequence in {MAX_STEPS} steps")


@pytest.mark.parametrize("seed", range(4))
def test_greedy_over_random_logits_writes_a_receipt_that_validates(compiler, tokenizer, seed):
    matcher = compiler.compile(from_response_format(RECEIPT_FORMAT)).matcher()
    text = tokenizer.decode(decode_greedy(matcher, seed), skip_special_tokens=False)
    receipt = json.loads(text)
    jsonschema.validate(receipt, RECEIPT_SCHEMA)
    assert 1 <= len(receipt["items"]) <= 3


@pytest.mark.parametrize("seed", range(4))
def test_json_object_mode_writes_a_json_object(compiler, tokenizer, seed):
    matcher = compiler.compile(from_response_format({"type": "json_object"})).matcher()
    assert isinstance(json.loads(tokenizer.decode(decode_greedy(matcher, seed))), dict)


# A random walk over any JSON can nest without bound (from '{"notes": "', seed 1 ends after 3,267 tokens; from
# deeper prefixes some seeds never end in 4,000): these seeds end within the step limit, and what ends must parse.
@pytest.mark.parametrize("seed", [0, 2, 3, 4, 5])
def test_json_object_mode_closes_what_was_opened(compiler, tokenizer, seed):
    opened = tokenizer.encode('{"notes": "', add_special_tokens=False).ids
    matcher = compiler.compile(from_response_format({"type": "json_object"})).matcher()
    value = json.loads(tokenizer.decode(decode_greedy(matcher, seed, prefix=opened), skip_special_tokens=False))
    assert isinstance(value["notes"], str)


@pytest.mark.parametrize("seed", range(4))
def test_a_tool_call_schema_from_structured_outputs_validates(compiler, tokenizer, seed):
    schema = {"type": "object", "required": ["name", "arguments"], "additionalProperties": False, "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "required": ["city"], "additionalProperties": False,
                      "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
    matcher = compiler.compile(from_structured_outputs({"json": json.dumps(schema)})).matcher()
    call = json.loads(tokenizer.decode(decode_greedy(matcher, seed), skip_special_tokens=False))
    jsonschema.validate(call, schema)


@pytest.mark.parametrize("seed", range(4))
def test_a_regex_is_matched_whole(compiler, tokenizer, seed):
    pattern = r"[A-Z]{2}-[0-9]{4}-[0-9]{6}( \((priority|standard)\))?"
    matcher = compiler.compile(from_structured_outputs({"regex": pattern})).matcher()
    assert re.fullmatch(pattern, tokenizer.decode(decode_greedy(matcher, seed), skip_special_tokens=False))


@pytest.mark.parametrize("seed", range(4))
def test_a_choice_is_one_of_the_choices(compiler, tokenizer, seed):
    choices = ["positive", "negative", "neutral", 'say "maybe"', "日本語"]
    matcher = compiler.compile(from_structured_outputs({"choice": choices})).matcher()
    assert tokenizer.decode(decode_greedy(matcher, seed), skip_special_tokens=False) in choices


# parameters as pydantic writes a nested model (a $defs entry and a "#/$defs/..." reference) and a recursive one ("#")
ADDRESS_TOOL = {"$defs": {"Address": {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lima"]}, "zip": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["city", "zip"], "additionalProperties": False}},
    "type": "object", "properties": {"home": {"$ref": "#/$defs/Address"},
                                     "work": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]}},
    "required": ["home", "work"], "additionalProperties": False}
TREE_TOOL = {"type": "object", "properties": {"label": {"type": "string", "enum": ["x", "y"]},
                                              "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
             "required": ["label", "kids"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(3))
def test_a_required_tool_choice_holds_tools_with_references_to_their_own_schemas(compiler, tokenizer, seed):
    """tool_choice "required" nests each tool's parameters under a new root: their "#..." references still name
    their own parts, so the calls validate against each tool's schema as the client wrote it."""
    tools = {"move": ADDRESS_TOOL, "grow": TREE_TOOL}
    spec = forced_call_spec(list(tools.items()), None, True)
    text = tokenizer.decode(decode_greedy(compiler.compile(spec).matcher(), seed), skip_special_tokens=False)
    calls = json.loads(text)
    assert calls
    for call in calls:
        jsonschema.validate(call["arguments"], tools[call["name"]])


@pytest.mark.parametrize("grammar", ['root ::= "yes" | "no"', 'start: "yes" | "no"'])
def test_a_grammar_in_gbnf_or_lark_is_followed(compiler, tokenizer, grammar):
    matcher = compiler.compile(from_structured_outputs({"grammar": grammar})).matcher()
    assert tokenizer.decode(decode_greedy(matcher, 0)) in ("yes", "no")


def test_a_repeated_spec_compiles_once():
    compiler = GrammarCompiler.from_tokenizer_json(ASSET_PATH.read_text(), VOCAB_SIZE, EOS_IDS)
    first = compiler.compile(from_response_format(RECEIPT_FORMAT))
    # the same schema sent again, as another dict and as vLLM's JSON string with other whitespace
    again = compiler.compile(from_response_format(json.loads(json.dumps(RECEIPT_FORMAT))))
    as_text = compiler.compile(from_structured_outputs({"json": json.dumps(RECEIPT_SCHEMA, indent=2)}))
    assert again is first and as_text is first
    stats = compiler.stats
    assert (stats.hits, stats.misses, stats.entries) == (2, 1, 1)
    assert stats.compile_s == pytest.approx(first.compile_s)
    # another key order is another grammar (properties are written in the order listed)
    reordered = dict(reversed(list(RECEIPT_SCHEMA["properties"].items())))
    compiler.compile(from_structured_outputs({"json": {**RECEIPT_SCHEMA, "properties": reordered}}))
    assert (compiler.stats.misses, compiler.stats.entries) == (2, 2)
    # non-strict is compiled apart: it ignores what strict refuses
    compiler.compile(from_response_format({**RECEIPT_FORMAT, "json_schema": {"schema": RECEIPT_SCHEMA}}))
    assert compiler.stats.misses == 3


def test_the_preprocessing_threads_may_compile_at_once(tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    compiler = GrammarCompiler.from_tokenizer_json(ASSET_PATH.read_text(), VOCAB_SIZE, EOS_IDS)
    specs = [from_structured_outputs({"choice": [f"answer {i % 3}", "other"]}) for i in range(60)]
    with ThreadPoolExecutor(4) as pool:
        compiled = list(pool.map(compiler.compile, specs))
    stats = compiler.stats
    assert stats.hits + stats.misses == 60 and 3 <= stats.misses < 60 and stats.entries == 3
    for spec, grammar in zip(specs, compiled):
        assert grammar.spec == spec
        text = tokenizer.decode(decode_greedy(grammar.matcher(), 0), skip_special_tokens=False)
        assert text in json.loads(spec.source)


def test_the_cache_keeps_the_most_recently_used():
    compiler = GrammarCompiler.from_tokenizer_json(ASSET_PATH.read_text(), VOCAB_SIZE, EOS_IDS, max_cached=2)
    a, b, c = (from_structured_outputs({"choice": [word]}) for word in ("a", "b", "c"))
    compiler.compile(a), compiler.compile(b), compiler.compile(a), compiler.compile(c)  # b is evicted
    compiler.compile(a)
    assert compiler.stats.hits == 2
    compiler.compile(b)
    assert compiler.stats.misses == 4


@pytest.mark.parametrize("request_field, value, says", [
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"total": {"type": "nmber"}}}}},
     ["response_format.json_schema.schema", "nmber"]),
    ("response_format", {"type": "json_schema", "json_schema": {"strict": True, "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}, ["uniqueItems"]),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {
        "type": "string", "minLength": 5, "maxLength": 2}}}, ["minLength", "maxLength"]),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/missing"}}},
     ["/$defs/missing"]),
    ("structured_outputs", {"regex": "(unclosed"}, ["structured_outputs.regex", "unclosed group"]),
    ("structured_outputs", {"grammar": "start: undefined_rule"}, ["structured_outputs.grammar", "undefined_rule"]),
])
def test_a_spec_that_does_not_compile_is_refused_with_what_is_wrong(compiler, request_field, value, says):
    spec = from_response_format(value) if request_field == "response_format" else from_structured_outputs(value)
    entries = compiler.stats.entries
    with pytest.raises(ValueError) as refused:
        compiler.compile(spec)
    for words in says:
        assert words in str(refused.value)
    assert compiler.stats.entries == entries  # refused specs are not cached
    with pytest.raises(ValueError):  # and refused again, not served from anywhere
        compiler.compile(spec)


# each matches no output at all, and the compile can tell
MATCH_NOTHING = [
    ("regex", r"[^\s\S]"),
    ("regex", r"id-[^\x00-\x{10FFFF}]"),
    ("grammar", r"start: /[^\s\S]/"),
    ("grammar", 'start: "The answer is " NOTHING\nNOTHING: /[^\\s\\S]/'),
]
# specs that look alike and still compile: each matches something, or shows its dead end only while decoding
COMPILES = [
    ("regex", r"a{0}"),  # only the empty answer
    ("grammar", 'start: "The answer is " ("yes" | "no")'),
    ("grammar", 'start: ("yes" | "no") /[^\\s\\S]/'),  # nothing after its first word, which is not forced
]


def test_a_spec_no_output_can_match_is_refused_whatever_its_kind(compiler):
    for kind, source in MATCH_NOTHING:
        with pytest.raises(ValueError, match=f"structured_outputs.{kind}: no output can match it"):
            compiler.compile(from_structured_outputs({kind: source}))
    for kind, source in COMPILES:
        compiler.compile(from_structured_outputs({kind: source}))


@pytest.mark.parametrize("parse, value, says", [
    (from_response_format, {"type": "xml"}, "response_format.type"),
    (from_response_format, {"type": "json_schema"}, "response_format.json_schema"),
    (from_response_format, {"type": "json_schema", "json_schema": {"schema": [1]}}, "JSON schema object"),
    (from_response_format, {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict"),
    (from_response_format, {"type": "json_schema", "json_schema": {"schema": {"maximum": float("nan")}}},
     "NaN or Infinity"),
    (from_structured_outputs, {"regex": "a", "choice": ["a"]}, "exactly one of"),
    (from_structured_outputs, {}, "got none"),
    (from_structured_outputs, {"choice": []}, "structured_outputs.choice"),
    (from_structured_outputs, {"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    (from_structured_outputs, {"structural_tag": "{}"}, "structural_tag not supported"),
    (from_structured_outputs, {"regex": "a", "whitespace_pattern": " *"}, "whitespace_pattern not supported"),
])
def test_a_malformed_spec_is_refused_naming_the_field(parse, value, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        parse(value)


def test_a_huge_spec_is_refused_before_compiling():
    compiler = GrammarCompiler.from_tokenizer_json(ASSET_PATH.read_text(), VOCAB_SIZE, EOS_IDS,
                                                   max_source_bytes=1000)
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(100)}}
    with pytest.raises(ValueError, match=r"structured_outputs.json is \d+ bytes; at most 1000"):
        compiler.compile(from_structured_outputs({"json": schema}))
    assert compiler.stats.compile_s < 0.01


def test_a_non_strict_schema_ignores_what_cannot_be_enforced_and_says_so(compiler):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    compiled = compiler.compile(from_response_format({"type": "json_schema", "json_schema": {"schema": schema}}))
    assert any("uniqueItems" in w for w in compiled.warnings)


def test_text_and_absent_formats_are_unconstrained():
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None
    assert from_structured_outputs(None) is None


def bitmask_of(matcher: GrammarMatcher) -> np.ndarray:
    bitmask = allocate_bitmask(1, VOCAB_SIZE)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask


def test_replay_after_reset_reaches_the_same_state(compiler, tokenizer):
    compiled = compiler.compile(from_response_format(RECEIPT_FORMAT))
    tokens = tokenizer.encode(RECEIPT_TEXT, add_special_tokens=False).ids
    for cut in (0, 1, 7, len(tokens) // 2, len(tokens)):
        original = compiled.matcher()
        assert all(original.accept(t) for t in tokens[:cut])
        mask_before = bitmask_of(original)
        original.accept(tokens[cut] if cut < len(tokens) else EOS_IDS[0])  # it moves on past the cut ...
        assert original.replay(tokens[:cut])  # ... and is put back, as after preemption by recompute
        assert original.num_accepted == cut
        assert np.array_equal(bitmask_of(original), mask_before)
        assert np.array_equal(bitmask_of(compiled.matcher()), bitmask_of(compiled.matcher()))  # copies start alike
    finished = compiled.matcher()
    assert finished.replay(tokens + [EOS_IDS[0]]) and finished.is_finished


def test_a_token_the_grammar_forbids_is_refused_and_leaves_only_the_end(compiler, tokenizer):
    matcher = compiler.compile(from_response_format(RECEIPT_FORMAT)).matcher()
    assert not matcher.accept(tokenizer.encode("hello", add_special_tokens=False).ids[0])
    assert matcher.error is not None and not matcher.is_finished
    allowed = np.flatnonzero(np.unpackbits(bitmask_of(matcher).view(np.uint8), bitorder="little")[:VOCAB_SIZE])
    assert set(allowed.tolist()) <= set(EOS_IDS)
    assert not matcher.replay(tokenizer.encode("[1]", add_special_tokens=False).ids)  # an object, not an array
    matcher.reset()
    assert matcher.error is None and matcher.accept(tokenizer.encode("{", add_special_tokens=False).ids[0])


def test_the_matchers_of_one_grammar_are_independent(compiler, tokenizer):
    compiled = compiler.compile(from_structured_outputs({"choice": ["alpha", "beta"]}))
    first, second = compiled.matcher(), compiled.matcher()
    assert first.accept(tokenizer.encode("alpha", add_special_tokens=False).ids[0])
    assert second.num_accepted == 0
    assert np.array_equal(bitmask_of(second), bitmask_of(compiled.matcher()))


def test_mask_ids_past_the_tokenizer_are_never_allowed(compiler):
    matcher = compiler.compile(from_response_format({"type": "json_object"})).matcher()
    matcher.replay([])
    bits = np.unpackbits(bitmask_of(matcher).view(np.uint8), bitorder="little")
    assert VOCAB_SIZE > len(Tokenizer.from_file(str(ASSET_PATH)).get_vocab())
    assert not bits[len(Tokenizer.from_file(str(ASSET_PATH)).get_vocab()):].any()


def test_apply_sets_forbidden_logits_to_minus_inf_in_the_listed_rows_only():
    vocab = 70  # not a multiple of 32: the last word is partly past the vocabulary
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=generator)  # [rows, vocab]
    before = logits.clone()
    bitmask = allocate_bitmask(4, vocab)
    rng = np.random.default_rng(0)
    bitmask[:] = rng.integers(-(2**31), 2**31, size=bitmask.shape, dtype=np.int64).astype(np.int32)
    apply_bitmask(logits, bitmask, [1, 3])
    for row in (1, 3):
        allowed = [(int(bitmask[row, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)]
        for t in range(vocab):
            assert logits[row, t].item() == (before[row, t].item() if allowed[t] else float("-inf"))
    for row in (0, 2):  # no grammar: bit for bit as they were, although their mask rows forbid things
        assert torch.equal(logits[row], before[row])


def test_apply_with_no_constrained_rows_changes_nothing():
    logits = torch.randn(3, 64)
    before = logits.clone()
    forbid_all = np.zeros((3, 2), dtype=np.int32)
    apply_bitmask(logits, forbid_all, [])
    assert torch.equal(logits, before)


def test_spec_keys_follow_content_not_origin():
    a = GrammarSpec("regex", "[0-9]+", origin="structured_outputs.regex")
    b = GrammarSpec("regex", "[0-9]+", origin="guided_regex")
    assert a.key == b.key and a == b
    assert GrammarSpec("regex", "[0-9]*").key != a.key
    assert GrammarSpec("json_schema", "{}", strict=False).key != GrammarSpec("json_schema", "{}", strict=True).key
