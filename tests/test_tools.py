"""Tool calling (issue 58 item 1): tools, tool_choice and parallel_tool_calls as OpenAI answers them.

The grammar and parser tests drive llguidance's matchers with the default model's tokenizer; the server
tests run the openai SDK's tool loop against `tierlm serve` on loopback with the default model (SmolLM2,
whose template knows no tools: the "generic" family, tools described in the system message).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import llguidance
import openai
import pydantic
import pytest
from test_server import serve

import tierlm
from tierlm.generation.grammar import grammar_tokenizer
from tierlm.generation.tools import tool_use
from tierlm.tokenizer.wrapper import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
BOOKING = {  # nested objects, enums, arrays
    "type": "function",
    "function": {
        "name": "book_trip",
        "parameters": {
            "type": "object",
            "properties": {
                "traveller": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
                    "required": ["name", "age"],
                    "additionalProperties": False,
                },
                "cabin": {"enum": ["economy", "business", "first"]},
                "stops": {"type": "array", "items": {"enum": ["LON", "PAR", "NYC"]}, "maxItems": 3},
            },
            "required": ["traveller", "cabin", "stops"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, BOOKING]
TEMPLATES = {  # a template's source decides the family
    "generic": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "hermes": "{{ tools }}<tool_call>{% for m in messages %}{{ m.tool_calls }}{% endfor %}",
    "mistral": "[TOOL_CALLS]{{ tools }}",
    "llama3": "<|python_tag|>{{ tools }}",
}
CALLS = [
    {
        "id": "a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
    },
    {
        "id": "b",
        "type": "function",
        "function": {
            "name": "book_trip",
            "arguments": json.dumps(
                {"traveller": {"name": 'Ana "A"', "age": 30}, "cabin": "first", "stops": ["PAR"]}
            ),
        },
    },
]


@pytest.fixture(scope="module")
def tokenizer(default_model_path) -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path)


def matcher(tokenizer, fmt):
    lltok = grammar_tokenizer(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    return llguidance.LLMatcher(lltok, fmt.grammar, log_level=0)


def accepts(tokenizer, fmt, text: str) -> bool:
    m = matcher(tokenizer, fmt)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_each_family_writes_parses_and_enforces_calls(tokenizer, family):
    """The family's call text (two calls) is what its grammar accepts and its parser reads back; "required"
    refuses text, a named choice refuses the other function, "auto" takes text or calls, and arguments
    outside a function's schema are refused."""
    use = tool_use(TOOLS, "auto", None, TEMPLATES[family])
    assert use.family == family
    text = use.call_text(CALLS)
    content, calls = use.parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in CALLS
    ]
    assert use.parse("It is sunny.") == ("It is sunny.", [])
    required = tool_use(TOOLS, "required", None, TEMPLATES[family]).response_format()
    auto = use.response_format()
    named = tool_use(TOOLS, {"type": "function", "function": {"name": "book_trip"}}, None, TEMPLATES[family])
    single = tool_use(TOOLS, "required", False, TEMPLATES[family]).response_format()
    assert accepts(tokenizer, required, text) and accepts(tokenizer, auto, text)
    assert accepts(tokenizer, auto, "It is sunny.") and not accepts(tokenizer, required, "It is sunny.")
    assert not accepts(tokenizer, named.response_format(), text)  # its first call is get_weather
    assert accepts(tokenizer, named.response_format(), named.call_text(CALLS[1:]))
    assert not accepts(tokenizer, single, text) and accepts(tokenizer, single, use.call_text(CALLS[:1]))
    bad = use.call_text(
        [{"function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "kelvin"}'}}]
    )
    assert not accepts(tokenizer, required, bad)


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_a_call_cut_anywhere_closes_to_valid_calls(tokenizer, family):
    """The closer (what GrammarMask forces when the budget runs out) completes every prefix of a call text
    into calls the grammar accepts and whose arguments validate."""
    use = tool_use(TOOLS, "required", None, TEMPLATES[family])
    fmt, text = use.response_format(), use.call_text(CALLS)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for cut in range(0, len(text), 3):
        closing = fmt.closer().after(text[:cut].encode()).closing()
        assert closing is not None, text[:cut]
        whole = text[:cut] + closing.decode()
        content, calls = use.parse(whole)
        assert content is None and calls, whole
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert accepts(tokenizer, fmt, whole), whole


@pytest.mark.parametrize("budget", [40, 55, 80])
def test_random_tokens_under_a_tool_grammar_end_as_calls_within_the_budget(tokenizer, budget):
    """Random logits under the "required" grammar (parallel calls allowed, so it never has to end): every
    row ends within its budget, as calls that parse and validate; a forced closing ends the answer."""
    from test_structured_budget import random_tokens_under_budget

    rows = 4
    use = tool_use(TOOLS, "required", None, TEMPLATES["generic"])
    mask, out = random_tokens_under_budget(tokenizer, use.response_format(), rows, budget)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for row in range(rows):
        assert mask.complete(row) and len(out[row]) <= budget
        content, calls = use.parse(tokenizer.decode(out[row]))
        assert content is None and calls, tokenizer.decode(out[row])
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_a_tool_without_parameters_is_called_with_an_object():
    use = tool_use(
        [{"type": "function", "function": {"name": "ping", "parameters": {}}}], "required", None, ""
    )
    shortest = use.response_format().closer().closing().decode()
    assert use.parse(shortest)[1][0].arguments == "{}"


def test_past_calls_and_results_reach_the_template_in_its_form():
    generic = tool_use(TOOLS, "auto", None, TEMPLATES["generic"])
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
        {"role": "tool", "content": "18C", "tool_call_id": "a"},
    ]
    out = generic.template_messages(chat)
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"] and "book_trip" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": generic.call_text(CALLS[:1])}
    assert out[3] == {"role": "user", "content": "<tool_response>\n18C\n</tool_response>"}
    hermes = tool_use(TOOLS, "auto", None, TEMPLATES["hermes"])
    out = hermes.template_messages(chat)
    assert out[0] == chat[0]  # the template renders the tools itself
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Oslo",
        "unit": "celsius",
    }  # an object
    assert out[2]["role"] == "tool"


@pytest.mark.parametrize(
    ("tools", "choice", "says"),
    [
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
        ([WEATHER, WEATHER], None, "names a function twice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice names function 'nope'"),
        ([WEATHER], "sometimes", "tool_choice must be"),
        (None, "required", "tool_choice 'required' needs tools"),
    ],
)
def test_bad_tools_are_one_clear_error(tools, choice, says):
    with pytest.raises(tierlm.RequestError, match=None) as err:
        tool_use(tools, choice, None, "")
    assert says in str(err.value)


# --- the server, with the openai SDK -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(default_model_path):
    return tierlm.load(default_model_path)


@pytest.fixture(scope="module")
def live(model):
    with serve(model, max_batch_size=8) as s:
        yield s


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{live.url}/v1", api_key="none", max_retries=0, http_client=httpx.Client(trust_env=False)
    )


def streamed(stream) -> tuple[str, list[dict], str]:
    """A stream's text, its calls (fragments joined by index, as the SDK's users do) and finish reason."""
    text, calls, reason = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = call.id or slot["id"]
            slot["name"] += call.function.name or ""
            slot["arguments"] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return text, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_two_turn_tool_loop_with_the_openai_sdk(client, stream, choice):
    """Turn 1 calls get_weather (a named or required choice, one call), the tool's result goes back as a
    `tool` message, turn 2 ("auto") answers in text: the loop agent frameworks run."""
    tool_choice = (
        {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    )
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = dict(model="tiny", messages=messages, tools=TOOLS, max_tokens=80, temperature=0.7, seed=1)
    if stream:
        text, calls, reason = streamed(
            client.chat.completions.create(
                **ask, tool_choice=tool_choice, parallel_tool_calls=False, stream=True
            )
        )
        assert text == "" and len(calls) == 1 and reason == "tool_calls"
        call = {
            "id": calls[0]["id"],
            "type": "function",
            "function": {k: calls[0][k] for k in ("name", "arguments")},
        }
    else:
        answer = client.chat.completions.create(**ask, tool_choice=tool_choice, parallel_tool_calls=False)
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls" and message.content is None
        assert len(message.tool_calls) == 1 and message.tool_calls[0].id.startswith("call_")
        call = message.tool_calls[0].model_dump()
    assert call["function"]["name"] == "get_weather" or choice == "required"
    arguments = json.loads(call["function"]["arguments"])
    name = call["function"]["name"]
    jsonschema.validate(
        arguments, next(t for t in TOOLS if t["function"]["name"] == name)["function"]["parameters"]
    )
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": json.dumps({"temperature": 18, "sky": "clear"}),
        },
    ]
    final = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=24, temperature=0
    )
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.choices[0].message.content or final.choices[0].message.tool_calls


def test_a_nested_tool_schema_is_honoured_20_of_20_times_at_temperature_1(client):
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Book me a trip to New York via Paris."}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "book_trip"}},
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=1.0,
        n=4,
    )
    calls = [c.message.tool_calls for c in answer.choices]
    for _ in range(4):
        more = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Book me a trip to New York via Paris."}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
            temperature=1.0,
            n=4,
        )
        calls += [c.message.tool_calls for c in more.choices]
    assert len(calls) == 20
    for call in calls:
        assert call is not None and len(call) == 1
        schema = next(t for t in TOOLS if t["function"]["name"] == call[0].function.name)["function"][
            "parameters"
        ]
        jsonschema.validate(json.loads(call[0].function.arguments), schema)


def test_the_sdks_parse_returns_a_pydantic_object(client):
    class City(pydantic.BaseModel):
        name: str
        country: str
        population: int

    answer = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City,
        max_tokens=60,
        temperature=0.7,
        seed=3,
    )
    assert isinstance(answer.choices[0].message.parsed, City)


def test_bad_tool_fields_are_a_400_naming_them(live):
    def post(**fields):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
        return httpx.post(f"{live.url}/v1/chat/completions", json=body, trust_env=False, timeout=60)

    for fields, param in [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": "required", "max_tokens": 3}, "max_tokens"),  # below one call
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "u", "parameters": {"type": "array", "uniqueItems": True}},
                    }
                ]
            },
            "tools",
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[0].tool_calls",
        ),
    ]:
        reply = post(**fields)
        assert reply.status_code == 400, (fields, reply.text)
        assert reply.json()["error"]["param"] == param, reply.text
    assert post(tools=[WEATHER], tool_choice="none").status_code == 200
