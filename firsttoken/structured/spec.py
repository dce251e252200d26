"""What a request asks its output to match, as one canonical value: ``GrammarSpec``.

Built from OpenAI's ``response_format`` (``json_object``; ``json_schema`` with ``strict``) or vLLM's
``structured_outputs`` (exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
``json_object``), both given as the plain mappings the API's models dump to. A malformed spec is a
``ValueError`` naming the field; whether the grammar itself compiles is the compiler's question
(``compiler.py``).

The canonical text keeps a JSON schema's key order (properties are generated in the order the schema
lists them, so two orders are two grammars) and drops only insignificant whitespace; the cache key
hashes kind, strictness and that text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from firsttoken.quoting import quote

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# vLLM's structured_outputs fields we enforce; the others it has (structural_tag,
# whitespace_pattern, ...) are refused
STRUCTURED_OUTPUT_KINDS: dict[str, GrammarKind] = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
# fields of vLLM's StructuredOutputsParams that change nothing when left at these values
_NEUTRAL_OPTIONS = {"disable_fallback": (None, False), "disable_any_whitespace": (None, False),
                    "disable_additional_properties": (None, False), "whitespace_pattern": (None,),
                    "structural_tag": (None,)}


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    # json_schema: the schema as compact JSON; choice: the choices as a JSON list; else the text as
    # given
    source: str
    # json_schema only: True refuses a schema keyword the library cannot enforce, False ignores it
    # (enforcing the rest)
    strict: bool = True
    # the request field it came from, named in errors
    origin: str = field(default="", compare=False)

    @property
    def key(self) -> str:
        """The cache key: sha256 over kind, strictness and canonical source (hex)."""
        text = f"{self.kind}\0{int(self.strict)}\0{self.source}"
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


def canonical_json(value: Any) -> str:
    """Compact JSON with the keys in their given order (see the module docstring)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def json_object_spec(origin: str) -> GrammarSpec:
    """Any JSON object (OpenAI's JSON mode: the answer is an object, not a bare value)."""
    return GrammarSpec("json_object", canonical_json({"type": "object"}), True, origin)


def from_response_format(value: Mapping[str, Any] | None) -> GrammarSpec | None:
    """OpenAI's ``response_format``: None or ``{"type": "text"}`` -> None (unconstrained)."""
    if value is None:
        return None
    body = value.get("json_schema") if value.get("type") == "json_schema" else value
    if not isinstance(body, Mapping):
        raise ValueError("response_format.json_schema must be an object with a 'schema'")
    return _format_spec(value.get("type"), body, "response_format", "response_format.json_schema")


def from_text_format(value: Mapping[str, Any] | None) -> GrammarSpec | None:
    """The Responses API's ``text.format`` (``response_format`` flattened: ``name``, ``schema`` and
    ``strict`` sit beside ``type``): None or ``{"type": "text"}`` -> None."""
    if value is None:
        return None
    if value.get("type") == "json_schema" and "schema" not in value:
        raise ValueError("text.format of type 'json_schema' needs a 'schema'")
    return _format_spec(value.get("type"), value, "text.format", "text.format")


def _format_spec(
    kind: object, body: Mapping[str, Any], field: str, schema_field: str
) -> GrammarSpec | None:
    """A ``response_format``-shaped ``kind`` and the object holding its ``schema`` and ``strict``
    (``field``: the request field, ``schema_field``: where the schema sits, for messages)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_spec(field)
    if kind != "json_schema":
        got = f"'{quote(kind)}'" if isinstance(kind, str) else repr(kind)[:40]
        raise ValueError(f"{field}.type must be 'text', 'json_object' or 'json_schema', got {got}")
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{schema_field}.strict must be true or false, got {strict!r}")
    return _schema_spec(body.get("schema"), bool(strict), f"{schema_field}.schema")


def from_structured_outputs(value: Mapping[str, Any] | None) -> GrammarSpec | None:
    """vLLM's ``structured_outputs`` (``guided_*`` in older vLLM): exactly one constraint; None ->
    None."""
    if value is None:
        return None
    unknown = sorted(
        k for k in value if k not in STRUCTURED_OUTPUT_KINDS and k not in _NEUTRAL_OPTIONS
    )
    unsupported = sorted(
        k for k, neutral in _NEUTRAL_OPTIONS.items() if value.get(k) not in neutral
    )
    if unknown or unsupported:
        raise ValueError(f"structured_outputs: {', '.join(unknown + unsupported)} not supported; give exactly one of "
                         f"{', '.join(STRUCTURED_OUTPUT_KINDS)}")
    given = [k for k in STRUCTURED_OUTPUT_KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise ValueError(f"structured_outputs must give exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got "
                         f"{', '.join(given) or 'none'}")
    name = given[0]
    origin, item = f"structured_outputs.{name}", value[name]
    if name == "json_object":
        if item is not True:
            raise ValueError(f"{origin} must be true")
        return json_object_spec(origin)
    if name == "json":
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as e:
                raise ValueError(f"{origin} is not valid JSON: {e}") from None
        return _schema_spec(item, True, origin)
    if name == "choice":
        return choice_spec(item, origin)
    if not isinstance(item, str) or not item:
        raise ValueError(f"{origin} must be a non-empty string")
    return GrammarSpec(STRUCTURED_OUTPUT_KINDS[name], item, True, origin)


def choice_spec(choices: Any, origin: str) -> GrammarSpec:
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ValueError(f"{origin} must be a non-empty list of non-empty strings")
    return GrammarSpec("choice", canonical_json(choices), True, origin)


def _schema_spec(schema: Any, strict: bool, origin: str) -> GrammarSpec:
    if schema is True:
        schema = {}
    if schema is False:
        raise ValueError(f"{origin} is false: no output matches it")
    if not isinstance(schema, Mapping):
        raise ValueError(f"{origin} must be a JSON schema object, got {type(schema).__name__}")
    try:
        source = canonical_json(schema)
    except ValueError:
        raise ValueError(f"{origin} holds NaN or Infinity, which JSON cannot") from None
    return GrammarSpec("json_schema", source, strict, origin)
