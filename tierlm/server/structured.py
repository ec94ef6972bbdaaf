"""vLLM's structured-output fields (`structured_outputs` and the older `guided_*`) beside OpenAI's
`response_format`: each becomes a `ResponseFormat`, whose grammar llguidance enforces while decoding."""

from __future__ import annotations

import json
from typing import Any

from tierlm.errors import RequestError
from tierlm.generation.response_format import ResponseFormat, guided, json_schema, parse_response_format
from tierlm.server.errors import short_repr

# the fields that constrain the output, one per request
STRUCTURED = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
_OUTPUTS = ("json", "json_object", "regex", "choice", "grammar")  # vLLM's structured_outputs keys served


def constraint(name: str, value: Any) -> ResponseFormat | None:
    """A structured-output field as a ResponseFormat (tierlm's regex, choice and grammar types beside
    OpenAI's); ValueError naming the field (and key) that is wrong."""
    if name == "response_format":
        return parse_response_format(value)
    if name == "structured_outputs":
        given = [k for k, v in value.items() if v is not None and v is not False]
        if len(given) != 1 or given[0] not in _OUTPUTS:
            served = ", ".join(_OUTPUTS)
            raise RequestError(f"structured_outputs takes exactly one of {served}, got {short_repr(value)}")
        kind, value, name = given[0], value[given[0]], f"structured_outputs.{given[0]}"
    else:
        kind = name.removeprefix("guided_")
    if kind == "json_object":
        return parse_response_format({"type": "json_object"})
    if kind != "json":
        return guided(kind, value, name)
    if isinstance(value, str):  # vLLM takes a schema's JSON text too
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise RequestError(f"{name} is not JSON: {err}") from None
    return json_schema(value, name)
