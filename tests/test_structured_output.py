"""Structured output (response_format): the grammar mask, the library, and the server on loopback.

The grammar tests drive llguidance's matchers with the default model's tokenizer and random logits; the
model tests sample the default model (SmolLM2-135M) at temperature 1.0, where an unconstrained 135M model
seldom writes valid JSON, so every document that parses and validates is the mask's doing.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
from test_server import serve

import tierlm
from tierlm.generation.config import GenerationConfig
from tierlm.generation.grammar import GrammarMask
from tierlm.generation.response_format import ResponseFormat, parse_response_format
from tierlm.tokenizer.wrapper import Tokenizer

# Nested objects, arrays, enums, required and optional fields; strings and arrays are bounded so that a
# document always fits max_new_tokens, and numbers are bounded integers (a float may run on digit by digit).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "country": {"enum": ["FR", "DE", "JP"]},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 2},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
ASK = "Invent a person and describe them as JSON: name, age, role, address, tags."
MAX_TOKENS = 128  # the schema's documents take ~40-70 tokens


@pytest.fixture(scope="module")
def tokenizer(default_model_path) -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path)


@pytest.fixture(scope="module")
def model(default_model_path):
    """fp32: on a CPU without native bf16 its batched decode is the faster one."""
    return tierlm.load(default_model_path, dtype="float32")


def chat_prompt(model, text: str) -> str:
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}])


# --- response_format: what is accepted, and one clear error for what is not ---------------------------------


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("json", "response_format must be a dict"),
        (
            {"type": "xml"},
            "response_format.type must be one of 'text', 'json_object', 'json_schema', 'regex', 'choice', 'grammar', got 'xml'",
        ),
        ({}, "response_format.type must be one of"),
        ({"type": "json_object", "schema": {}}, "response_format has an unknown field 'schema'"),
        ({"type": "json_schema"}, "response_format.json_schema must be a dict with a 'schema'"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema must be"),
        (
            {"type": "json_schema", "json_schema": {"schema": [1]}},
            "response_format.json_schema.schema must be",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
            ".strict must be true or false",
        ),
        ({"type": "json_schema", "json_schema": {"schema": {}, "name": 3}}, ".name must be a string"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "mode": 1}}, "has an unknown field 'mode'"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}, "Invalid type: foo"),
        ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/x"}}}, "/$defs/x"),
    ],
)
def test_bad_response_format_is_one_clear_error(value, says):
    with pytest.raises(ValueError, match="^response_format") as err:
        GenerationConfig(response_format=value)
    assert says in str(err.value)


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {}}, "if, then"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ],
)
def test_unsupported_schema_feature_is_named(schema, feature):
    with pytest.raises(ValueError, match=f"does not support: {feature}$"):
        parse_response_format({"type": "json_schema", "json_schema": {"schema": schema}})


def test_response_format_forms():
    assert parse_response_format({"type": "text"}) is None
    fmt = GenerationConfig(response_format=JSON_SCHEMA).response_format
    assert isinstance(fmt, ResponseFormat) and fmt.type == "json_schema" and fmt.name == "person"
    assert fmt.as_dict()["json_schema"]["schema"] == SCHEMA
    assert GenerationConfig(response_format=fmt).response_format is fmt  # a parsed format passes through
    assert hash(GenerationConfig(response_format={"type": "json_object"}))  # the config stays hashable


# --- the mask -------------------------------------------------------------------------------------------------


def test_mask_is_llguidances_bitmask_unpacked(tokenizer):
    """At each step of a document, the tokens the mask lets through are exactly those llguidance allows
    (its bitmask unpacked by numpy, bit i of the little-endian words = token i)."""
    import llguidance

    fmt = parse_response_format(JSON_SCHEMA)
    vocab, eos = tokenizer.vocab_size, tokenizer.eos_token_ids
    mask = GrammarMask(tokenizer, 2, vocab, eos)
    mask.set_row(1, fmt)  # row 0 stays unconstrained
    oracle = llguidance.LLMatcher(mask.tokenizer, fmt.grammar)
    doc = '{"name": "Ada", "age": 36, "role": "admin", "address": {"city": "Paris", "country": "FR"}, "tags": ["x"]}'
    ids = tokenizer.encode(doc, add_special_tokens=False)
    for token in ids:
        logits = torch.zeros(2, vocab)
        allowed = torch.isfinite(mask.apply(logits, [0, 1]))
        expected = np.unpackbits(np.frombuffer(oracle.compute_bitmask(), np.uint8), bitorder="little")[:vocab]
        assert allowed[0].all()
        assert torch.equal(allowed[1], torch.from_numpy(expected.astype(bool)))
        assert allowed[1, token] and 0 < int(allowed[1].sum()) < vocab
        mask.advance([0, 1], [token, token])
        assert oracle.consume_token(token)
    assert mask.complete(1) and not mask.complete(0)


def test_random_logits_under_the_mask_give_valid_documents(tokenizer):
    """Any choice among the allowed tokens keeps to the grammar: 8 rows of random argmaxes all end in a
    document that validates (an adversarial stand-in for a model: it prefers no token)."""
    rows, vocab = 8, tokenizer.vocab_size
    mask = GrammarMask(tokenizer, rows, vocab, tokenizer.eos_token_ids)
    fmt = parse_response_format(JSON_SCHEMA)
    for row in range(rows):
        mask.set_row(row, fmt)
    generator = torch.Generator().manual_seed(0)
    out: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(400):
        live = [r for r in range(rows) if not mask.complete(r)]
        if not live:
            break
        tokens = mask.apply(torch.randn(len(live), vocab, generator=generator), live).argmax(-1).tolist()
        mask.advance(live, tokens)
        for row, token in zip(live, tokens):
            out[row].append(token)
    for row in range(rows):
        assert mask.complete(row), tokenizer.decode(out[row])
        jsonschema.validate(json.loads(tokenizer.decode(out[row])), SCHEMA)


# --- the library ----------------------------------------------------------------------------------------------


def test_fifty_sampled_completions_validate(model):
    """50 samples at temperature 1.0 (one batch of 50 rows, each its own matcher) all parse and validate."""
    torch.manual_seed(0)  # unseeded rows draw their seeds from torch's global RNG
    prompt = chat_prompt(model, ASK)
    result = model.generate(
        [prompt] * 50, max_new_tokens=MAX_TOKENS, do_sample=True, temperature=1.0, response_format=JSON_SCHEMA
    )
    assert result.finish_reasons == ["stop"] * 50
    documents = [json.loads(text) for text in result.texts]
    for document in documents:
        jsonschema.validate(document, SCHEMA)
    assert len({json.dumps(d, sort_keys=True) for d in documents}) > 10  # samples, not one answer 50 times


def test_json_object_mode_gives_json_objects(model):
    torch.manual_seed(1)
    prompt = chat_prompt(model, "Reply with a short JSON object with the keys city and country.")
    result = model.generate(
        [prompt] * 4,
        max_new_tokens=MAX_TOKENS,
        do_sample=True,
        temperature=0.7,
        response_format={"type": "json_object"},
    )
    assert result.finish_reasons == ["stop"] * 4
    assert all(isinstance(json.loads(text), dict) for text in result.texts)


# --- the server -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(model):
    with serve(model, max_batch_size=8) as s:
        yield s


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{live.url}/v1", api_key="none", max_retries=0, http_client=httpx.Client(trust_env=False)
    )


def test_chat_json_schema_through_the_server(client):
    """Four concurrent sampled chats (batched by the server, a matcher per row) all validate."""

    def ask(seed: int):
        return client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": ASK}],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
            response_format=JSON_SCHEMA,
        )

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    for answer in answers:
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


def test_streamed_chat_json_schema_through_the_server(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": ASK}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=7,
        response_format=JSON_SCHEMA,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json_object": True, "regex": None}},  # vLLM's form of it
    ],
)
def test_completions_take_response_format_as_an_extension(client, extra):
    answer = client.completions.create(
        model="tiny",
        prompt="A JSON object describing a city:",
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=3,
        extra_body=extra,
    )
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].text), dict)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    ("value", "says"),
    [
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}},
            "uniqueItems",
        ),
        ({"type": "xml"}, "response_format.type must be one of"),
        ({"type": "json_schema"}, "response_format.json_schema must be a dict"),
        ({"type": "json_object", "strict": True}, "unknown field 'strict'"),
        ("json", "response_format"),
    ],
)
def test_bad_response_format_is_a_400(live, endpoint, value, says):
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        path, body = "/v1/completions", {"prompt": "hi"}
    reply = httpx.post(
        live.url + path, json={"model": "tiny", **body, "response_format": value}, trust_env=False, timeout=60
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    assert says in error["message"]


def test_response_format_on_a_model_without_eos_is_a_400_before_it_is_queued(tmp_path):
    """A model that names no end-of-sequence token cannot end a constrained document: the server says so as
    a 400 naming response_format (it was a 500 from the worker), and still serves requests without one."""
    import json as _json

    from test_server import write_served_model

    folder = write_served_model(tmp_path / "no-eos")
    config = _json.loads((folder / "config.json").read_text())
    config.pop("eos_token_id", None)
    (folder / "config.json").write_text(_json.dumps(config))
    tok_config = _json.loads((folder / "tokenizer_config.json").read_text())
    tok_config.pop("eos_token")
    (folder / "tokenizer_config.json").write_text(_json.dumps(tok_config))
    (folder / "generation_config.json").unlink()
    model = tierlm.load(folder, dtype="float32")
    assert model.tokenizer.eos_token_ids == () and model.config.eos_token_ids == ()
    with serve(model) as live:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
        reply = httpx.post(
            live.url + "/v1/completions",
            json={**body, "response_format": {"type": "json_object"}},
            trust_env=False,
        )
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "response_format" and "end-of-sequence" in error["message"]
        plain = httpx.post(live.url + "/v1/completions", json=body, trust_env=False, timeout=60)
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 3


# --- vLLM's structured_outputs and guided_* fields: a regex, a choice, a Lark grammar, a schema ------------

CHOICES = ["positive", "negative", 'it is "neutral"\n']
GUIDED = [  # (fields, does the text satisfy them)
    ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
    (
        {"structured_outputs": {"regex": r"(yes|no), [A-Z]"}},
        lambda text: re.fullmatch(r"(yes|no), [A-Z]", text),
    ),
    ({"guided_grammar": 'start: D D "+" D\nD: /[0-9]/'}, lambda text: re.fullmatch(r"\d\d\+\d", text)),
    ({"guided_json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ({"guided_json": json.dumps(SCHEMA)}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
]


@pytest.mark.parametrize(
    "fields,holds", GUIDED, ids=[next(iter(f)) + str(i) for i, (f, _) in enumerate(GUIDED)]
)
def test_vllms_structured_output_fields_constrain_sampled_text(client, fields, holds):
    """Each field of vLLM's, sampled at temperature 1 with two seeds on completions and chat: every text
    satisfies it and ends with finish reason "stop" (the grammar is complete)."""
    for seed in (1, 2):
        text = client.completions.create(
            model="tiny",
            prompt="Answer:",
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
            extra_body=fields,
        )
        chat = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Answer."}],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
            extra_body=fields,
        )
        for choice, out in (
            (text.choices[0], text.choices[0].text),
            (chat.choices[0], chat.choices[0].message.content),
        ):
            assert choice.finish_reason == "stop" and holds(out), (fields, out)


def test_the_library_takes_the_same_constraints_as_response_format_types(model):
    prompt = chat_prompt(model, "Is this good?")
    r = model.generate(prompt, max_new_tokens=16, response_format={"type": "choice", "choice": CHOICES})
    assert r.texts[0] in CHOICES and r.finish_reasons == ["stop"]
    r = model.generate(prompt, max_new_tokens=16, response_format={"type": "regex", "regex": r"[a-c]{4}"})
    assert re.fullmatch(r"[a-c]{4}", r.texts[0])
    assert parse_response_format({"type": "choice", "choice": CHOICES}).as_dict() == {
        "type": "choice",
        "choice": CHOICES,
    }


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"guided_regex": "(x"}, "guided_regex", "guided_regex is not a valid regular expression"),
        (
            {"guided_choice": []},
            "guided_choice",
            "guided_choice must be a non-empty list of non-empty strings",
        ),
        (
            {"guided_grammar": "start: nothing"},
            "guided_grammar",
            "guided_grammar is not a valid Lark grammar",
        ),
        ({"guided_json": "{not json"}, "guided_json", "guided_json is not JSON"),
        ({"guided_json": [1]}, "guided_json", "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "exactly one of"),
        (
            {"structured_outputs": {"regex": "(x"}},
            "structured_outputs",
            "structured_outputs.regex is not a valid",
        ),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "give one"),
    ],
)
def test_bad_structured_output_fields_are_a_400_naming_them(live, fields, param, says):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}
    reply = httpx.post(live.url + "/v1/completions", json=body, trust_env=False, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"], error
