"""Tool calling as OpenAI's API has it: `tools`, `tool_choice`, `parallel_tool_calls` (no torch here).

A chat template's family decides how a call is written (recognised from the template's source):
- "hermes" (Qwen 2.5 / 3, Hermes, SmolLM3; the template holds `<tool_call>`): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, calls one per line;
- "mistral" (the template holds `[TOOL_CALLS]`): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- "llama3" (the template holds `<|python_tag|>`, or `ipython` beside `tools`): `{"name": ..., "parameters":
  {...}}`, calls separated by `; `;
- "generic", any other template: the hermes form, with the tools and that form described in the system
  message (a template that names no `tools` is handed none), past calls written into the assistant's text
  and tool results as `<tool_response>` user turns, as Hermes-style templates render them.

With `tool_choice` "required" or a named function the answer is a call, generated under an llguidance
grammar whose arguments follow the function's JSON schema (so they always parse and validate); with "auto"
the grammar allows either free text that does not start a call, or calls: a call the model starts is
completed under the same grammar. "none" renders no tools and parses no calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

from tierlm.errors import RequestError
from tierlm.generation.closing import continuation, cut_char, shortest_value, value_end
from tierlm.generation.response_format import ResponseFormat, guided

CHOICES = ("none", "auto", "required")
# compact JSON, as response_format writes it
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Form:
    """How one family writes calls: each call is `pre` + JSON + `post`, the calls `start` + (joined by `sep`)
    + `end`; `args` is the JSON key of the arguments."""

    start: str
    pre: str
    post: str
    sep: str
    end: str
    args: str = "arguments"

    def opener(self) -> str:
        """The first literal of every answer that calls (the grammar's first lexeme of a call)."""
        return self.start or self.pre + '{"name": "'


FORMS = {
    "hermes": Form("", "<tool_call>\n", "\n</tool_call>", "\n", ""),
    "generic": Form("", "<tool_call>\n", "\n</tool_call>", "\n", ""),
    "mistral": Form("[TOOL_CALLS][", "", "", ", ", "]"),
    "llama3": Form("", "", "", "; ", "", "parameters"),
}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict

    def as_dict(self) -> dict:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, its tool_choice ("auto", "required", or "function" with `name`), whether calls may
    be several, and the template's family."""

    tools: tuple[Tool, ...]
    choice: str
    name: str | None
    parallel: bool
    family: str
    renders_tools: bool  # the template reads `tools` itself
    renders_calls: bool  # the template reads an assistant message's `tool_calls`

    @property
    def form(self) -> Form:
        return FORMS[self.family]

    def response_format(self) -> ResponseFormat:
        """The grammar an answer is generated under (compiled by llguidance; a 400 naming what it refuses)."""
        tools = self.allowed()
        f = self.form
        # each call's name as a literal, its arguments under the function's schema: the literal text
        # before the arguments (`{"name": "f", "arguments": `) is what an "auto" answer commits to a call by
        calls = " | ".join(
            f"{_lit(f.pre + _head(t.name, f.args))} %json {json.dumps(_schema(t.parameters))} {_lit('}' + f.post)}"
            for t in tools
        )
        more = f"({_lit(f.sep)} call)*" if self.parallel else ""
        lines = [f"calls: {_lit(f.start)} call {more} {_lit(f.end)}", f"call: {calls}"]
        if self.choice == "auto":
            lines = ["start: calls | TEXT", *lines, f"TEXT: /{_not_starting(f.opener())}/"]
        else:
            lines = ["start: calls", *lines]
        fmt = guided("grammar", "\n".join(lines) + "\n", "tools")
        return dataclasses.replace(fmt, closer=partial(ToolCloser, self))

    def allowed(self) -> list[Tool]:
        return [t for t in self.tools if self.choice != "function" or t.name == self.name]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's text (None when it is only calls) and its calls; text that is not a whole call is
        text."""
        f = self.form
        body = text  # as the grammar writes calls: no space before them, none inside their openers
        if not body.startswith(f.opener()):
            return text, []
        decoder, calls, at, sep = json.JSONDecoder(), [], len(f.start), f.sep.strip()
        try:
            while True:
                if not body.startswith(f.pre, at):
                    return text, []
                value, at = decoder.raw_decode(body, at + len(f.pre))
                if not body.startswith(f.post, at):
                    return text, []
                calls.append(self._call(value))
                rest = _skip(body, at + len(f.post))
                if body.startswith(f.end, rest) and rest + len(f.end) == len(body):
                    return None, calls
                if sep and not body.startswith(sep, rest):
                    return text, []
                at = _skip(body, rest + len(sep))
        except (ValueError, TypeError, KeyError):
            return text, []

    def _call(self, value: Any) -> ToolCall:
        name, args = value["name"], value[self.form.args]
        if name not in {t.name for t in self.tools} or not isinstance(args, dict):
            raise ValueError(f"not a call of a tool: {value!r}")
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(args, ensure_ascii=False))

    def call_text(self, calls: list[dict]) -> str:
        """Past calls (OpenAI's `tool_calls` of an assistant message) in the family's form."""
        f = self.form
        parts = []
        for call in calls:
            function = call.get("function") or {}
            arguments = _arguments(function.get("arguments"))
            value = {"name": function.get("name"), f.args: arguments}
            parts.append(f.pre + json.dumps(value, ensure_ascii=False) + f.post)
        return f.start + f.sep.join(parts) + f.end

    def system_text(self) -> str:
        """The tools and the call form, for a template that renders no tools (Hermes' and Qwen's wording)."""
        listed = "\n".join(json.dumps(t.as_dict(), ensure_ascii=False) for t in self.tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """The chat as the template gets it: past calls and tool results in the form it knows, and the tools
        described in the system message where the template renders none."""
        out = []
        for m in messages:
            m = dict(m)
            calls = m.pop("tool_calls", None)
            if calls and self.renders_calls:
                m["tool_calls"] = [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": _arguments(c["function"].get("arguments")),
                        },
                    }
                    for c in calls
                ]
            elif calls:
                text = self.call_text(calls)
                m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
            if m["role"] == "tool" and not self.renders_tools:
                m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
            out.append(m)
        if self.tools and not self.renders_tools:
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{self.system_text()}"}
            else:
                out.insert(0, {"role": "system", "content": self.system_text()})
        return out


class ToolCloser:
    """The shortest closing of an answer under a ToolUse's grammar (`GrammarMask` closes it within its
    budget): the call being written is completed (its arguments by the JSON closer, under the function's
    schema), no further call is begun, and text ("auto") needs none."""

    def __init__(self, use: ToolUse, raw: bytes = b"") -> None:
        self.use, self.raw = use, raw

    def after(self, data: bytes) -> ToolCloser:
        return ToolCloser(self.use, self.raw + data)

    def closing(self) -> bytes | None:
        cut = cut_char(self.raw)
        fill = continuation(self.raw[len(self.raw) - cut :]) if cut else b""
        try:
            rest = self._closing((self.raw + fill).decode("utf-8"))
        except Exception:  # Unknown, or a schema keyword of an odd type: unforced, never a failed request
            return None
        return None if rest is None else fill + rest.encode("utf-8")

    def _closing(self, text: str) -> str | None:
        use, f = self.use, self.use.form
        tools = use.allowed()
        heads = {t.name: f.pre + _head(t.name, f.args) for t in tools}

        def shortest_call(prefix: str = "") -> str | None:
            options = [
                heads[t.name][len(prefix) :] + shortest_value(t.parameters, t.parameters) + "}" + f.post
                for t in tools
                if heads[t.name].startswith(prefix)
            ]
            return min(options, key=len) if options else None

        if use.choice == "auto" and not text.startswith(f.opener()):
            return ""  # text (or the start of the opener, which is text too): it may end here
        if not text.startswith(f.start):
            call = shortest_call()
            return (
                None if call is None or not f.start.startswith(text) else f.start[len(text) :] + call + f.end
            )
        at, first = len(f.start), True
        while True:
            rest = text[at:]
            if not first:
                if f.end.startswith(rest) and not (f.sep.startswith(rest) and rest):
                    return f.end[len(rest) :]
                if f.sep.startswith(rest):
                    call = shortest_call()
                    return None if call is None else f.sep[len(rest) :] + call + f.end
                if not rest.startswith(f.sep):
                    return None
                at += len(f.sep)
                rest = text[at:]
            tool = next((t for t in tools if rest.startswith(heads[t.name])), None)
            if tool is None:
                call = shortest_call(rest)
                return None if call is None else call + f.end
            at += len(heads[tool.name])
            end, closing = value_end(tool.parameters, text[at:])
            tail = "}" + f.post
            if end is None:
                return None if closing is None else closing + tail + f.end
            at += end
            rest = text[at:]
            if not rest.startswith(tail):
                return tail[len(rest) :] + f.end if tail.startswith(rest) else None
            at, first = at + len(tail), False


def history_use(template: str | None) -> ToolUse:
    """How a chat's past calls and tool results reach `template` in a request that offers no tools."""
    return _use((), "none", None, True, template)


def tool_use(tools: Any, tool_choice: Any, parallel: bool | None, template: str | None) -> ToolUse | None:
    """The request's tool use (None: no tools, or tool_choice "none"); RequestError naming a bad field."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise RequestError(f"tool_choice {_short(tool_choice)} needs tools")
        return None
    if not isinstance(tools, list):
        raise RequestError(f"tools must be a list of function tools, got {_short(tools)}")
    parsed = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) < len(names):
        raise RequestError(
            f"tools names a function twice: {sorted(n for n in names if names.count(n) > 1)[0]!r}"
        )
    choice, name = _choice(tool_choice, names)
    return None if choice == "none" else _use(parsed, choice, name, parallel is not False, template)


def _use(
    tools: tuple[Tool, ...], choice: str, name: str | None, parallel: bool, template: str | None
) -> ToolUse:
    source = template or ""
    family = (
        "hermes"
        if "<tool_call>" in source
        else "mistral"
        if "[TOOL_CALLS]" in source
        else "llama3"
        if "<|python_tag|>" in source or ("ipython" in source and re.search(r"\btools\b", source))
        else "generic"
    )
    renders = bool(re.search(r"\btools\b", source))
    return ToolUse(tools, choice, name, parallel, family, renders, "tool_calls" in source)


def _tool(value: Any, where: str) -> Tool:
    if not isinstance(value, dict) or value.get("type", "function") != "function":
        raise RequestError(
            f"{where} must be {{'type': 'function', 'function': {{...}}}}, got {_short(value)}"
        )
    function = value.get("function")
    if not isinstance(function, dict):
        raise RequestError(f"{where}.function must be an object with a name, got {_short(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise RequestError(
            f"{where}.function.name must be 1-64 letters, digits, _, . or -, got {_short(name)}"
        )
    params = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise RequestError(f"{where}.function.parameters must be a JSON Schema object, got {_short(params)}")
    if "type" not in params and not any(k in params for k in ("anyOf", "oneOf", "allOf", "$ref")):
        params = {"type": "object", **params}  # arguments are an object (`{}` would admit any value)
    description = function.get("description")
    return Tool(name, description if isinstance(description, str) else None, params)


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if value in CHOICES:
        return value, None
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
    ):
        name = value["function"].get("name")
        if name not in names:
            raise RequestError(f"tool_choice names function {name!r}, which tools does not list")
        return "function", name
    raise RequestError(
        f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, "
        f"got {_short(value)}"
    )


def _arguments(value: Any) -> Any:
    """A call's arguments as the template reads them: an object (OpenAI sends JSON text)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value if value is not None else {}


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _lit(text: str) -> str:
    return json.dumps(text) if text else ""


def _head(name: str, args: str) -> str:
    return f'{{"name": {json.dumps(name)}, {json.dumps(args)}: '


def _schema(parameters: dict) -> dict:
    return {**parameters, "x-guidance": _JSON_OPTIONS}


def _escape(text: str) -> str:
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _not_starting(prefix: str) -> str:
    """A regex for any text that does not start with `prefix` (its proper prefixes included)."""
    alternatives = ["()"]
    for i in range(len(prefix)):
        alternatives.append(f"({_escape(prefix[:i])}[^{_escape(prefix[i])}](?s:.*))")
        if i:
            alternatives.append(f"({_escape(prefix[:i])})")
    return "|".join(alternatives)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
