"""Structured output: OpenAI's `response_format` enforced token by token with llguidance.

A `ResponseFormat` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}) is
compiled once, when the GenerationConfig is built, into an llguidance grammar; a schema feature llguidance
cannot enforce is a ValueError naming it. `GrammarMask` holds one matcher per row: before each sample it
writes the rows' allowed tokens as a bitmask and turns it into a [batch, vocab] boolean mask with tensor
ops (no Python loop over the vocabulary), and after it advances each matcher with the row's token. A row
whose grammar is complete ends (finish reason "stop"). Rows without a format are left unconstrained.

Why llguidance. Compared on SmolLM2's tokenizer (49152 tokens) and a schema with nested objects, arrays,
enums, a pattern and required fields, on a contended 2-core CPU (so relative, not absolute numbers):
llguidance 1.9 compiles the schema in ~2-4 ms (its Earley parser computes masks lazily) and computes a mask
in ~0.06 ms median (~0.4 ms p90, a few ms for the first tokens); xgrammar 0.2 compiles in ~25-30 ms and
masks in ~0.01 ms, but imports transformers at module load and pulls triton, which tierlm keeps out of
its runtime; outlines-core 0.2 turns the schema into a regex and builds a vocabulary-wide DFA index, ~5 s
per schema, and cannot express a free-form JSON object. llguidance is one ~8 MB wheel with no Python
dependencies, reads the `tokenizers` JSON tierlm already has, and refuses unimplemented keywords by name.
Either of the first two costs far less than one decode step of the default model.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch

FORMAT_TYPES = ("text", "json_object", "json_schema")
_SCHEMA_FIELDS = ("name", "description", "schema", "strict")
# Compact JSON with OpenAI's separators; pinned (overrides) so a schema's "x-guidance" cannot allow
# unbounded whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NEG_INF = float("-inf")


def _llguidance():
    try:
        import llguidance
    except ImportError as err:  # a declared dependency; only a broken install lacks it
        raise ImportError("structured output needs llguidance: pip install llguidance") from err
    return llguidance


@dataclass(frozen=True)
class ResponseFormat:
    """A validated response_format: "json_object" or "json_schema" with its schema, and its compiled grammar."""

    type: str
    schema: str | None = None  # the schema as canonical JSON text (json_schema only)
    name: str | None = None
    grammar: str = ""  # llguidance's grammar, compiled from the schema

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI form this was parsed from."""
        if self.type == "json_object":
            return {"type": "json_object"}
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
        raise ValueError(f"response_format must be a dict such as {example}, got {_short(value)}")
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        choices = ", ".join(map(repr, FORMAT_TYPES))
        raise ValueError(f"response_format.type must be one of {choices}, got {_short(kind)}")
    allowed = ("type", "json_schema") if kind == "json_schema" else ("type",)
    _refuse_unknown(value, allowed, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", grammar=_compile({"type": "object"}))
    return _parse_json_schema(value.get("json_schema"))


def _parse_json_schema(spec: Any) -> ResponseFormat:
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be a dict with a 'schema' (a JSON Schema object), got {_short(spec)}")
    _refuse_unknown(spec, _SCHEMA_FIELDS, where)
    name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{where}.name must be a string, got {_short(name)}")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.strict must be true or false, got {_short(strict)}")
    if not isinstance(schema, dict):
        raise ValueError(f"{where}.schema must be a JSON Schema object, got {_short(schema)}")
    try:
        text = json.dumps(schema, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}.schema is not JSON: {err}") from None
    return ResponseFormat("json_schema", text, name, _compile(schema, f"{where}.schema"))


def _compile(schema: dict, where: str = "response_format") -> str:
    """The llguidance grammar of a JSON schema; ValueError naming what llguidance cannot enforce."""
    matcher = _llguidance().LLMatcher
    try:
        grammar = matcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    except ValueError as err:
        raise ValueError(f"{where} is not a valid JSON Schema: {err}") from None
    error = matcher.validate_grammar(grammar, None)
    if error:
        raise ValueError(f"{where} {_explain(error)}")
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
        raise ValueError(
            f"{where} has an unknown field {unknown[0]!r}; its fields are {', '.join(map(repr, allowed))}"
        )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Building llguidance's view of a tokenizer takes about a second: once per tokenizer, vocabulary and EOS set.
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_tokenizer(tokenizer, vocab: int, eos_ids: tuple[int, ...]):
    """llguidance's tokenizer for a tierlm Tokenizer whose logits have `vocab` columns (cached)."""
    per_tokenizer = _TOKENIZERS.setdefault(tokenizer, {})
    key = (vocab, tuple(eos_ids))
    if key not in per_tokenizer:
        if not eos_ids:
            raise ValueError("structured output needs an end-of-sequence token; this model names none")
        backend = tokenizer.backend.to_str()  # the tokenizers JSON, as llguidance reads it
        per_tokenizer[key] = _llguidance().LLTokenizer(backend, n_vocab=vocab, eos_token=list(eos_ids))
    return per_tokenizer[key]


class GrammarMask:
    """One llguidance matcher per row of a batch (None: unconstrained); masks logits, follows sampled tokens.

    Rows are a batch's slots: `set_row` gives a slot to a new sequence, and `apply` / `advance` take the
    rows the logits and tokens belong to (all rows, or a subset in that order).
    """

    def __init__(self, tokenizer, rows: int, vocab: int, eos_ids) -> None:
        if tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model has none")
        self.vocab, self.tokenizer = vocab, grammar_tokenizer(tokenizer, vocab, tuple(eos_ids))
        self.bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)  # -1: all allowed
        # byte value -> its 8 bits, lowest first: the bitmask read as bytes gives token order (little endian)
        self.bits = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()
        self.matchers: list = [None] * rows
        self.executor = _llguidance().LLExecutor(2)

    def set_row(self, row: int, fmt: ResponseFormat | None) -> None:
        """Give `row` a fresh matcher for `fmt` (None: unconstrained), e.g. when a new sequence takes it."""
        self.matchers[row] = None
        if fmt is not None:
            matcher = _llguidance().LLMatcher(self.tokenizer, fmt.grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"response_format cannot be enforced: {matcher.get_error()}")
            self.matchers[row] = matcher

    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits [len(rows), vocab] with the tokens each row's grammar forbids set to -inf (float32)."""
        live = [(self.matchers[r], i) for i, r in enumerate(rows) if self._live(r)]
        if not live:
            return logits
        bitmask = self.bitmask[: len(rows)]
        bitmask.fill_(-1)  # rows without a live grammar stay unconstrained
        self.executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), bitmask.shape[1] * 4, len(rows))
        # bit j of word w allows token 32w + j: a table lookup per byte, no loop over the vocabulary
        allowed = self.bits[bitmask.view(torch.uint8).long()].view(len(rows), -1)[:, : logits.shape[-1]]
        return torch.where(allowed.to(logits.device, non_blocking=True), logits.float(), _NEG_INF)

    def advance(self, rows: list[int], tokens: list[int]) -> None:
        """Feed each constrained row its sampled token; a row whose grammar is complete takes no more."""
        for row, token in zip(rows, tokens):
            if self._live(row) and not self.matchers[row].consume_token(token):
                error = self.matchers[row].get_error()
                raise RuntimeError(f"structured output: row {row} left its grammar: {error}")

    def complete(self, row: int) -> bool:
        """True once `row`'s grammar has matched a whole document and allows nothing more."""
        matcher = self.matchers[row]
        return matcher is not None and matcher.is_stopped()

    def _live(self, row: int) -> bool:
        matcher = self.matchers[row]
        return matcher is not None and not matcher.is_stopped()
