"""The shortest text that completes a partial structured answer (no torch here).

A constrained answer cut at its token budget is not JSON. `GrammarMask` (`tierlm.generation.grammar`)
keeps each row's remaining budget at or above the tokens of its shortest completion, which this module
writes: `json_closing(schema, text)` for JSON (a `json_schema`'s schema, or `{"type": "object"}` for
`json_object`) and `choice_closing(choices, text)` for a list of choices. The JSON closing follows the
partial text's open strings, numbers, literals, objects and arrays from the innermost out and gives each
what its schema needs to end: the shortest enum or const value, `minLength`, `minItems`, the required
properties not yet written (with the shortest value of each), then the closing quote or bracket. Its
separators are the compact ones the grammar is compiled with (`", "`, `": "`).

It knows the common keywords (type, properties, required, additionalProperties, items, prefixItems,
minItems, enum, const, minLength, minimum/maximum, anyOf/oneOf, $ref); a schema or state it cannot close
(a pattern or format, allOf, a recursion without end) gives None, and the answer runs unforced, as before.
The grammar's matcher checks every closing before it is forced, so a wrong one is never written.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

ITEM, KEY = ", ", ": "  # the grammar's separators (response_format._JSON_OPTIONS)
_DEPTH = 24  # nested schemas followed before giving up (a recursive $ref that is always required)


class Unknown(Exception):
    """A schema keyword or a partial text this module cannot close."""


def json_closing(schema: dict, text: str) -> str | None:
    """The shortest text that makes `text` + it a complete JSON value valid under `schema`, or None."""
    after = JsonCloser(schema).after(text.encode("utf-8"))
    closing = None if after is None else after.closing()
    return None if closing is None else closing.decode("utf-8")


def choice_closing(choices: list[str], text: str) -> str | None:
    """The rest of the shortest choice that starts with `text`, or None when none does."""
    rests = [c[len(text) :] for c in choices if c.startswith(text)]
    return min(rests, key=len) if rests else None


def value_end(schema: dict, text: str) -> tuple[int | None, str | None]:
    """Where a JSON value valid under `schema` that `text` starts with ends (index, None), or, if it does not
    end in `text`, the closing that ends it (None, closing); (None, None) where unknown."""
    partial = _Partial(schema)
    try:
        for i, char in enumerate(text):
            partial.feed(char)
            if len(partial.stack) == 1 and partial.stack[0].state == "done":
                return i + 1, None
        return None, partial.close()
    except Exception:  # Unknown, or a schema keyword of an odd type
        return None, None


class JsonCloser:
    """A JSON answer read a token's bytes at a time (each `after` a new closer, the old one unchanged), and the
    bytes of its shortest closing. Bytes that end inside a character wait for the rest of it; a closing from
    there first completes the character with continuation bytes."""

    def __init__(self, schema: dict) -> None:
        self.partial, self.pending = _Partial(schema), b""

    def after(self, data: bytes) -> JsonCloser | None:
        """The closer of the answer followed by `data`; None where this module cannot follow it."""
        raw = self.pending + data
        cut = len(raw) - cut_char(raw)
        new = JsonCloser.__new__(JsonCloser)
        new.partial, new.pending = self.partial.copy(), raw[cut:]
        try:
            for char in raw[:cut].decode("utf-8"):
                new.partial.feed(char)
        except Exception:  # Unknown, or a schema keyword of an odd type: unforced, never a failed request
            return None
        return new

    def closing(self) -> bytes | None:
        """The bytes of the shortest closing, or None where it is unknown."""
        fill = continuation(self.pending)
        partial = self.partial.copy()
        try:
            for char in (self.pending + fill).decode("utf-8"):
                partial.feed(char)
            return fill + partial.close().encode("utf-8")
        except Exception:  # Unknown, or a schema keyword of an odd type: unforced, never a failed request
            return None


class ChoiceCloser:
    """An answer that must be one of `choices`, and the rest of the shortest choice it can still become."""

    def __init__(self, choices: list[str], text: bytes = b"") -> None:
        self.choices, self.text = [c.encode("utf-8") for c in choices], text

    def after(self, data: bytes) -> ChoiceCloser | None:
        new = ChoiceCloser([], self.text + data)
        new.choices = [c for c in self.choices if c.startswith(new.text)]
        return new if new.choices else None

    def closing(self) -> bytes | None:
        return min((c[len(self.text) :] for c in self.choices), key=len) if self.choices else None


def cut_char(raw: bytes) -> int:
    """How many bytes at the end of `raw` are a UTF-8 character cut short (0 if none is)."""
    for back in range(1, min(4, len(raw)) + 1):
        lead = raw[-back]
        if lead & 0xC0 != 0x80:  # the last character's first byte
            size = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
            return back if back < size else 0
    return 0


def continuation(cut: bytes) -> bytes:
    """Continuation bytes that complete the cut character `cut` into a valid one (b"" for none)."""
    if not cut:
        return b""
    lead = cut[0]
    size = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
    second = 0xA0 if lead == 0xE0 else 0x90 if lead == 0xF0 else 0x80  # the smallest valid second byte
    return bytes(second if i == 1 else 0x80 for i in range(len(cut), size))


def shortest_value(root: dict, schema: Any, depth: int = 0) -> str:
    """The shortest JSON text valid under `schema` (resolving $ref against `root`); Unknown if none is known."""
    if depth > _DEPTH:
        raise Unknown("schema too deep")
    schema = _resolve(root, schema)
    if schema is True or schema == {}:
        return "0"
    if not isinstance(schema, dict):
        raise Unknown("schema false")
    if "const" in schema:
        return _dump(schema["const"])
    if "enum" in schema:
        values = schema["enum"]
        if not values:
            raise Unknown("empty enum")
        return min((_dump(v) for v in values), key=len)
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        options = []
        for branch in branches:
            try:
                options.append(shortest_value(root, branch, depth + 1))
            except Unknown:
                pass
        if not options:
            raise Unknown("no branch closes")
        return min(options, key=len)
    if "allOf" in schema or "not" in schema:
        raise Unknown("allOf / not")
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or ["object", "array", "string", "number"])
    options = [_shortest_of_type(root, schema, t, depth) for t in types]
    known = [o for o in options if o is not None]
    if not known:
        raise Unknown("no type closes")
    return min(known, key=len)


def _shortest_of_type(root: dict, schema: dict, kind: str, depth: int) -> str | None:
    if kind == "null":
        return "null"
    if kind == "boolean":
        return "true"
    if kind in ("integer", "number"):
        return _number(schema, kind)
    if kind == "string":
        if "pattern" in schema or "format" in schema:
            return None
        return '"' + "a" * int(schema.get("minLength", 0)) + '"'
    if kind == "array":
        prefix = schema.get("prefixItems") or []
        count = max(int(schema.get("minItems", 0)), 0)
        items = [
            shortest_value(root, prefix[i] if i < len(prefix) else schema.get("items", {}), depth + 1)
            for i in range(count)
        ]
        return "[" + ITEM.join(items) + "]"
    if kind == "object":
        props = schema.get("properties") or {}
        order = {n: i for i, n in enumerate(props)}  # the grammar writes properties in this order
        required = sorted(dict.fromkeys(schema.get("required") or []), key=lambda n: order.get(n, len(order)))
        parts = [
            _dump(name) + KEY + shortest_value(root, props.get(name, _extra(schema)), depth + 1)
            for name in required
        ]
        return "{" + ITEM.join(parts) + "}"
    return None


def _number(schema: dict, kind: str) -> str | None:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    if "multipleOf" in schema:
        return None
    value = 0
    if isinstance(low, (int, float)) and (value < low or (value == low and "exclusiveMinimum" in schema)):
        value = math.floor(low) + 1 if "exclusiveMinimum" in schema else math.ceil(low)
    if isinstance(high, (int, float)) and (value > high or (value == high and "exclusiveMaximum" in schema)):
        value = math.ceil(high) - 1 if "exclusiveMaximum" in schema else math.floor(high)
        if isinstance(low, (int, float)) and value < low:
            return None  # a range with no integer in it: not closed here
    return str(value)


def _extra(schema: dict) -> Any:
    extra = schema.get("additionalProperties", True)
    return {} if extra is True else extra


def _resolve(root: dict, schema: Any) -> Any:
    seen = 0
    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#") or seen > _DEPTH:
            raise Unknown(f"$ref {ref!r}")
        target: Any = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise Unknown(f"$ref {ref!r}")
            target = target[part]
        extra = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **extra} if extra and isinstance(target, dict) else target
        seen += 1
    return schema


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(ITEM, KEY))


def _kinds(root: dict, schemas: list, kind: str) -> list:
    """The candidate schemas (anyOf / oneOf branches) that admit a value of JSON type `kind`."""
    out = []
    for schema in schemas:
        schema = _resolve(root, schema)
        if schema is True or schema == {}:
            out.append({})
            continue
        if not isinstance(schema, dict):
            continue
        branches = schema.get("anyOf") or schema.get("oneOf")
        if branches:
            out += _kinds(root, branches, kind)
            continue
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        allowed = types is None or kind in types or (kind == "number" and "integer" in types)
        if "enum" in schema or "const" in schema:
            values = schema.get("enum", [schema.get("const")])
            allowed = any(_json_kind(v) == kind for v in values)
        if allowed:
            out.append(schema)
    if not out:
        raise Unknown(f"no schema admits a {kind}")
    return out


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


class _Frame:
    def __init__(self, kind: str, schemas: list, state: str = "") -> None:
        self.kind, self.schemas, self.state = kind, schemas, state
        self.buf, self.key, self.count, self.seen = "", "", 0, []
        self.is_key, self.escape = False, ""
        self.space = False  # a separator's comma or colon is written, its space not yet

    def copy(self) -> _Frame:
        new = copy.copy(self)
        new.seen = list(self.seen)
        return new


class _Partial:
    """A JSON value read one character at a time: the stack of what is open."""

    def __init__(self, schema: dict) -> None:
        self.root = schema
        self.stack = [_Frame("root", [schema], "value")]

    def copy(self) -> _Partial:
        new = _Partial.__new__(_Partial)
        new.root, new.stack = self.root, [frame.copy() for frame in self.stack]
        return new

    # reading

    def feed(self, c: str) -> None:
        top = self.stack[-1]
        if top.kind == "string":
            return self._string(top, c)
        if top.kind == "number":
            if c in "0123456789+-.eE":
                top.buf += c
                return None
            self._pop()
            return self.feed(c)
        if top.kind == "literal":
            top.buf += c
            if not top.key.startswith(top.buf):
                raise Unknown("bad literal")
            if top.buf == top.key:
                self._pop()
            return None
        if c in " \t\n\r":
            top.space = False
            return None
        if top.kind == "object":
            return self._object(top, c)
        if top.kind == "array":
            return self._array(top, c)
        if top.state != "value":  # root, done
            raise Unknown("text after the value")
        return self._start(c, top.schemas)

    def _string(self, top: _Frame, c: str) -> None:
        if top.escape:
            top.escape += c
            if top.escape == "\\u" or (top.escape.startswith("\\u") and len(top.escape) < 6):
                return
            top.buf += top.escape
            top.escape = ""
        elif c == "\\":
            top.escape = c
        elif c == '"':
            self._pop()
        else:
            top.buf += c

    def _object(self, top: _Frame, c: str) -> None:
        if c == "}" and top.state in ("open", "next"):
            self._pop()
        elif c == '"' and top.state in ("open", "key"):
            frame = _Frame("string", [])
            frame.is_key = True
            self.stack.append(frame)
        elif c == ":" and top.state == "colon":
            top.state, top.space = "value", True
        elif c == "," and top.state == "next":
            top.state, top.space = "key", True
        elif top.state == "value":
            self._start(c, self._property(top, top.key))
        else:
            raise Unknown(f"{c!r} in an object")

    def _array(self, top: _Frame, c: str) -> None:
        if c == "]" and top.state in ("open", "next"):
            self._pop()
        elif c == "," and top.state == "next":
            top.state, top.space = "value", True
        elif top.state in ("open", "value"):
            self._start(c, self._item(top, top.count))
        else:
            raise Unknown(f"{c!r} in an array")

    def _start(self, c: str, schemas: list) -> None:
        if c == "{":
            self.stack.append(_Frame("object", _kinds(self.root, schemas, "object"), "open"))
        elif c == "[":
            self.stack.append(_Frame("array", _kinds(self.root, schemas, "array"), "open"))
        elif c == '"':
            self.stack.append(_Frame("string", _kinds(self.root, schemas, "string")))
        elif c == "-" or c.isdigit():
            frame = _Frame("number", _kinds(self.root, schemas, "number"))
            frame.buf = c
            self.stack.append(frame)
        elif c in "tfn":
            kind = "null" if c == "n" else "boolean"
            frame = _Frame("literal", _kinds(self.root, schemas, kind))
            frame.key, frame.buf = {"t": "true", "f": "false", "n": "null"}[c], c
            self.stack.append(frame)
        else:
            raise Unknown(f"{c!r} starts no value")

    def _pop(self) -> None:
        """The top is complete: its parent takes it (a key, a property's value, an item, the document)."""
        done = self.stack.pop()
        parent = self.stack[-1]
        if done.is_key:
            parent.key, parent.state = json.loads('"' + done.buf + '"'), "colon"
        elif parent.kind == "object":
            parent.seen.append(parent.key)
            parent.state = "next"
        elif parent.kind == "array":
            parent.count += 1
            parent.state = "next"
        else:
            parent.state = "done"

    def _property(self, frame: _Frame, name: str) -> list:
        out = []
        for schema in frame.schemas:
            props = schema.get("properties") or {}
            if name in props:
                out.append(props[name])
            elif _extra(schema) is not False:
                out.append(_extra(schema))
        if not out:
            raise Unknown(f"property {name!r}")
        return out

    def _item(self, frame: _Frame, index: int) -> list:
        out = []
        for schema in frame.schemas:
            prefix = schema.get("prefixItems") or []
            out.append(prefix[index] if index < len(prefix) else schema.get("items", {}))
        return out

    # closing

    def close(self) -> str:
        """The shortest text from here to the end of the document."""
        out = ""
        for _ in range(10_000):
            if len(self.stack) == 1 and self.stack[0].state == "done":
                return out
            top = self.stack[-1]
            rest = self._finish(top)
            if top.kind in ("object", "array") and top.space and top.state in ("key", "value"):
                rest = " " + rest  # the separator's space
            out += rest
            for c in rest:  # read it back: the frames below see a complete value
                self.feed(c)
            if top.kind == "number" and self.stack[-1] is top:
                self._pop()
        raise Unknown("no end")

    def _finish(self, top: _Frame) -> str:
        """Text that completes the top frame (possibly only part of it: close() loops until it pops)."""
        if top.kind == "root":
            return self._shortest(top.schemas)
        if top.kind == "number":
            return "0" if top.buf[-1] in "-+.eE" else ""  # then popped: the number is complete
        if top.kind == "literal":
            return top.key[len(top.buf) :]
        if top.kind == "string":
            return ("" if not top.escape else _escape_rest(top.escape)) + self._string_rest(top) + '"'
        if top.kind == "array":
            return self._finish_array(top)
        return self._finish_object(top)

    def _string_rest(self, top: _Frame) -> str:
        if top.is_key:
            parent = self.stack[-2]
            names = [n for n in self._after(parent) if _raw(n).startswith(top.buf)]
            required = [n for n in self._required(parent) if n in names]
            if required:  # the first in the grammar's order: the others must follow it
                return _raw(required[0])[len(top.buf) :]
            if names:
                return min((_raw(n)[len(top.buf) :] for n in names), key=len)
            if any(_extra(s) is not False for s in parent.schemas):
                return ""
            raise Unknown("no property name fits")
        options = []
        for schema in top.schemas:
            if "const" in schema or "enum" in schema:
                values = schema.get("enum", [schema.get("const")])
                options += [
                    _raw(v)[len(top.buf) :]
                    for v in values
                    if isinstance(v, str) and _raw(v).startswith(top.buf)
                ]
            elif "pattern" not in schema and "format" not in schema:
                length = len(json.loads('"' + top.buf + '"'))
                options.append("a" * max(int(schema.get("minLength", 0)) - length, 0))
        if not options:
            raise Unknown("string")
        return min(options, key=len)

    def _finish_array(self, top: _Frame) -> str:
        need = max(int(s.get("minItems", 0)) for s in top.schemas)
        if top.state == "value":  # after a comma: one more item
            return self._shortest(self._item(top, top.count))
        if top.count < need:
            lead = "" if top.state == "open" else ITEM
            return lead + self._shortest(self._item(top, top.count))
        return "]"

    def _finish_object(self, top: _Frame) -> str:
        if top.state == "colon":
            return KEY
        if top.state == "value":
            return self._shortest(self._property(top, top.key))
        missing = [n for n in self._required(top) if n not in top.seen]
        if top.state == "key" and not missing:  # after a comma: some property must follow
            names = self._after(top)
            options = [_dump(n) + KEY + self._shortest(self._property(top, n)) for n in names]
            if not options and any(_extra(s) is not False for s in top.schemas):
                options = ['""' + KEY + self._shortest(self._property(top, ""))]
            if not options:
                raise Unknown("a comma with nothing left to write")
            return min(options, key=len)
        if missing:
            lead = "" if top.state in ("open", "key") else ITEM
            name = missing[0]
            return lead + _dump(name) + KEY + self._shortest(self._property(top, name))
        return "}"

    def _after(self, frame: _Frame) -> list[str]:
        """The properties that may still be written: those after the last one written, in the grammar's order."""
        names = self._names(frame)
        last = max((names.index(n) for n in frame.seen if n in names), default=-1)
        return [n for n in names[last + 1 :] if n not in frame.seen]

    def _names(self, frame: _Frame) -> list[str]:
        return list(dict.fromkeys(n for s in frame.schemas for n in (s.get("properties") or {})))

    def _required(self, frame: _Frame) -> list[str]:
        """The required properties in the order the grammar writes properties (the schema's `properties`)."""
        order = {n: i for i, n in enumerate(self._names(frame))}
        names = dict.fromkeys(n for s in frame.schemas[:1] for n in (s.get("required") or []))
        return sorted(names, key=lambda n: order.get(n, len(order)))

    def _shortest(self, schemas: list) -> str:
        options = []
        for schema in schemas:
            try:
                options.append(shortest_value(self.root, schema))
            except Unknown:
                pass
        if not options:
            raise Unknown("no value closes")
        return min(options, key=len)


def _raw(value: str) -> str:
    """A string's characters as they appear between its quotes in the grammar's JSON."""
    return json.dumps(value, ensure_ascii=False)[1:-1]


def _escape_rest(escape: str) -> str:
    if escape == "\\":
        return "\\"  # an escaped backslash
    return "0" * (6 - len(escape))  # a \\u escape's missing hex digits
