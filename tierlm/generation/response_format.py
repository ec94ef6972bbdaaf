"""OpenAI's `response_format`, validated and compiled to an llguidance grammar (no torch here).

{"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}} becomes a
`ResponseFormat` when the GenerationConfig is built; a schema feature llguidance cannot enforce is a
ValueError naming it. tierlm's "regex", "choice" and "grammar" types carry vLLM's other constraints.
`tierlm.generation.grammar` enforces it while decoding.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tierlm.errors import RequestError
from tierlm.generation.closing import ChoiceCloser, JsonCloser

FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "choice", "grammar")
# tierlm's types beside OpenAI's: vLLM's structured_outputs constraints, each its own key's value
GUIDED = {"regex": "regular expression", "choice": "list of choices", "grammar": "Lark grammar"}
_SCHEMA_FIELDS = ("name", "description", "schema", "strict")
# Compact JSON with OpenAI's separators; pinned (overrides) so a schema's "x-guidance" cannot allow
# unbounded whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def llguidance_module():
    try:
        import llguidance
    except ImportError as err:  # a declared dependency; only a broken install lacks it
        raise ImportError("structured output needs llguidance: pip install llguidance") from err
    return llguidance


@dataclass(frozen=True)
class ResponseFormat:
    """A validated response_format: "json_object", "json_schema" with its schema, or "regex", "choice",
    "grammar" with theirs (`schema`), and its compiled grammar."""

    type: str
    schema: str | None = None  # json_schema's schema as canonical JSON text; the regex, choices or grammar
    name: str | None = None
    grammar: str = ""  # llguidance's grammar, compiled from the schema
    # () -> the closer of an empty answer (tierlm.generation.closing; tool calls: generation.tools), or None
    closer: Any = field(default=None, compare=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI form this was parsed from."""
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type in GUIDED:
            return {
                "type": self.type,
                self.type: json.loads(self.schema) if self.type == "choice" else self.schema,
            }
        inner: dict[str, Any] = {"schema": json.loads(self.schema or "{}")}
        if self.name is not None:
            inner["name"] = self.name
        return {"type": "json_schema", "json_schema": inner}


def parse_response_format(value: Any) -> ResponseFormat | None:
    """OpenAI's response_format dict (or a ResponseFormat) -> ResponseFormat; None for {"type": "text"}.

    Raises ValueError naming the bad field, or the schema feature that cannot be enforced.
    """
    if value is None or isinstance(value, ResponseFormat):
        return value
    example = "{'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'schema': {...}}}"
    if not isinstance(value, dict):
        raise RequestError(f"response_format must be a dict such as {example}, got {_short(value)}")
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        choices = ", ".join(map(repr, FORMAT_TYPES))
        raise RequestError(f"response_format.type must be one of {choices}, got {_short(kind)}")
    allowed = ("type", kind) if kind in ("json_schema", *GUIDED) else ("type",)
    _refuse_unknown(value, allowed, "response_format")
    if kind == "text":
        return None
    if kind in GUIDED:
        return guided(kind, value.get(kind), f"response_format.{kind}")
    if kind == "json_object":
        return ResponseFormat(
            "json_object",
            grammar=_compile({"type": "object"}),
            closer=partial(JsonCloser, {"type": "object"}),
        )
    return _parse_json_schema(value.get("json_schema"))


def _parse_json_schema(spec: Any) -> ResponseFormat:
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise RequestError(
            f"{where} must be a dict with a 'schema' (a JSON Schema object), got {_short(spec)}"
        )
    _refuse_unknown(spec, _SCHEMA_FIELDS, where)
    name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
    if name is not None and not isinstance(name, str):
        raise RequestError(f"{where}.name must be a string, got {_short(name)}")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"{where}.strict must be true or false, got {_short(strict)}")
    return json_schema(schema, f"{where}.schema", name)


def json_schema(schema: Any, where: str, name: str | None = None) -> ResponseFormat:
    """A JSON schema (a dict) as a "json_schema" ResponseFormat; ValueError naming `where`."""
    if not isinstance(schema, dict):
        raise RequestError(f"{where} must be a JSON Schema object, got {_short(schema)}")
    try:
        text = json.dumps(schema, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise RequestError(f"{where} is not JSON: {err}") from None
    # the closer reads the schema in its own key order: the grammar writes properties in that order
    closer = partial(JsonCloser, json.loads(json.dumps(schema)))
    return ResponseFormat("json_schema", text, name, _compile(schema, where), closer=closer)


def guided(kind: str, spec: Any, where: str) -> ResponseFormat:
    """vLLM's constraints beyond JSON: text matching a regular expression ("regex"), one of a list of strings
    ("choice", as literals), or a Lark grammar as llguidance reads it ("grammar"); ValueError naming `where`."""
    matcher = llguidance_module().LLMatcher
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise RequestError(f"{where} must be a non-empty list of non-empty strings, got {_short(spec)}")
        text = json.dumps(spec, ensure_ascii=False)
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec)  # quoted literals
        grammar = matcher.grammar_from_lark(lark)
    else:
        if not isinstance(spec, str) or not spec:
            raise RequestError(f"{where} must be a non-empty string ({GUIDED[kind]}), got {_short(spec)}")
        text = spec
        build = matcher.grammar_from_regex if kind == "regex" else matcher.grammar_from_lark
        try:
            grammar = build(spec)
        except ValueError as err:
            raise RequestError(f"{where} is not a valid {GUIDED[kind]}: {err}") from None
    error = matcher.validate_grammar(grammar, None)
    if error:
        raise RequestError(f"{where} is not a valid {GUIDED[kind]}: {error.strip().splitlines()[0]}")
    closer = partial(ChoiceCloser, list(spec)) if kind == "choice" else None
    return ResponseFormat(kind, text, None, grammar, closer=closer)


def _compile(schema: dict, where: str = "response_format") -> str:
    """The llguidance grammar of a JSON schema; ValueError naming what llguidance cannot enforce."""
    matcher = llguidance_module().LLMatcher
    try:
        grammar = matcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    except ValueError as err:
        raise RequestError(f"{where} is not a valid JSON Schema: {err}") from None
    error = matcher.validate_grammar(grammar, None)
    if error:
        raise RequestError(f"{where} {_explain(error)}")
    return grammar


def _explain(error: str) -> str:
    keys = re.match(r"Unimplemented keys: \[(.*)\]$", error.strip())
    if keys:
        names = ", ".join(k.strip().strip('"') for k in keys.group(1).split(","))
        return f"uses JSON Schema keywords that structured output does not support: {names}"
    return f"cannot be enforced: {error.strip()}"


def _refuse_unknown(value: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise RequestError(
            f"{where} has an unknown field {unknown[0]!r}; its fields are {', '.join(map(repr, allowed))}"
        )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
