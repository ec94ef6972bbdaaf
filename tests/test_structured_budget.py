"""A structured answer always parses: closed within its token budget (issue 58 item 2).

The schemas here are unbounded (strings, arrays and numbers of any length), so a sampled or random answer
runs past any budget unless the closing is forced: every document that parses below is the budget's doing.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch
from test_server import serve

import tierlm
from tierlm.generation.closing import ITEM, KEY, choice_closing, json_closing
from tierlm.generation.grammar import GrammarMask, shortest_answer
from tierlm.generation.response_format import parse_response_format
from tierlm.tokenizer.wrapper import Tokenizer

UNBOUNDED = {
    "type": "object",
    "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "light yellow"]}},
        "note": {"type": "string"},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array"}},
            "required": ["name", "age"],
        },
        "count": {"type": "number"},
    },
    "required": ["colors", "note", "owner"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "palette", "schema": UNBOUNDED}}
ASK = "Describe a palette of colours as JSON, with a long note."


@pytest.fixture(scope="module")
def tokenizer(default_model_path) -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path)


@pytest.fixture(scope="module")
def model(default_model_path):
    return tierlm.load(default_model_path, dtype="float32")


def dump(value) -> str:
    return json.dumps(value, separators=(ITEM, KEY), ensure_ascii=False)


DOCUMENTS = [
    (
        UNBOUNDED,
        {
            "colors": ["red", "light yellow"],
            "note": 'a "quoted"\\ note',
            "owner": {"name": "Ana", "age": -12},
        },
    ),
    (
        UNBOUNDED,
        {
            "colors": [],
            "note": "é",
            "owner": {"name": "", "age": 7, "tags": [1, {"a": [None, True]}]},
            "count": -1.5e3,
        },
    ),
    ({"type": "object"}, {"k": [1, {"z": True, "y": None}], "s": "x"}),
    (
        {
            "type": "array",
            "items": {"$ref": "#/$defs/p"},
            "minItems": 2,
            "$defs": {
                "p": {
                    "anyOf": [
                        {"type": "null"},
                        {"type": "object", "properties": {"q": {"const": "v"}}, "required": ["q"]},
                    ]
                }
            },
        },
        [{"q": "v"}, None, {"q": "v"}],
    ),
    (
        {"type": "object", "properties": {"s": {"type": "string", "minLength": 3}}, "required": ["s"]},
        {"s": "abcd"},
    ),
]


@pytest.mark.parametrize(("schema", "document"), DOCUMENTS)
def test_every_prefix_of_a_document_closes_to_a_valid_one(schema, document):
    """Cut anywhere (inside a key, a string, an escape, a number, a literal, between separators), the
    closing makes a document that parses and validates, and a complete document needs none."""
    text = dump(document)
    for cut in range(len(text)):
        closing = json_closing(schema, text[:cut])
        assert closing is not None, text[:cut]
        jsonschema.validate(json.loads(text[:cut] + closing), schema)
    assert json_closing(schema, text) == ""
    assert choice_closing(["positive", "negative", "neutral"], "ne") == "utral"
    assert choice_closing(["positive"], "x") is None


def test_closings_write_properties_in_the_grammars_order(model, tokenizer):
    """llguidance writes an object's properties in the order of `properties`, whatever the order of
    `required`: the shortest answer, and a closing after an optional property, keep to it."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}, "d": {}},
        "required": ["d", "b", "a"],
    }
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    shortest = shortest_answer(tokenizer, model.config.vocab_size, tokenizer.eos_token_ids, fmt)
    assert shortest is not None and tokenizer.decode(shortest) == '{"a": "", "b": 0, "d": 0}'
    assert json_closing(schema, '{"a": "x", "b": 1, "c": true, "') == 'd": 0}'


def test_a_pattern_or_an_unknown_state_is_not_closed():
    assert json_closing({"type": "string", "pattern": "^a+$"}, '"a') is None
    assert json_closing({"type": "object"}, "{]") is None


def random_tokens_under_budget(tokenizer, fmt, rows: int, budget: int) -> tuple[GrammarMask, list[list[int]]]:
    """`rows` rows of `fmt` under `budget`, each token the argmax of random logits under the mask, kept
    within the budget as the sampler keeps it: the mask and each row's tokens."""
    vocab = tokenizer.vocab_size
    mask = GrammarMask(tokenizer, rows, vocab, tokenizer.eos_token_ids)
    for row in range(rows):
        mask.set_row(row, fmt, budget)
    generator = torch.Generator().manual_seed(budget)
    out: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(budget):
        live = [r for r in range(rows) if not mask.complete(r)]
        if not live:
            break
        tokens = mask.apply(torch.randn(len(live), vocab, generator=generator), live).argmax(-1).tolist()
        tokens = mask.within_budget(live, tokens, [len(out[r]) for r in live]) or tokens
        mask.advance(live, tokens)
        for row, token in zip(live, tokens):
            out[row].append(token)
    return mask, out


@pytest.mark.parametrize("budget", [24, 31, 47, 80, 120])
def test_random_tokens_under_the_mask_always_close_within_the_budget(tokenizer, budget):
    """An adversarial stand-in for a model (random logits, which never close an unbounded array or string on
    their own): under a budget, every row ends complete within it, with a document that validates."""
    rows = 6
    mask, out = random_tokens_under_budget(tokenizer, parse_response_format(FORMAT), rows, budget)
    for row in range(rows):
        assert mask.complete(row) and len(out[row]) <= budget
        jsonschema.validate(json.loads(tokenizer.decode(out[row])), UNBOUNDED)
    assert any(mask.closed_by_budget(row) for row in range(rows))


def test_fifty_sampled_answers_parse_and_validate_within_budgets_from_24_to_120(model):
    """Temperature 1, nested objects, an array of enum strings, unbounded strings: 50 of 50 parse and
    validate; an answer the budget closed says "length", one that closed itself "stop"."""
    torch.manual_seed(0)
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": ASK}])
    reasons = []
    for budget in (24, 40, 64, 96, 120):
        r = model.generate(
            [prompt] * 10, max_new_tokens=budget, do_sample=True, temperature=1.0, response_format=FORMAT
        )
        for text, ids, reason in zip(r.texts, r.token_ids, r.finish_reasons):
            assert len(ids) <= budget
            jsonschema.validate(json.loads(text), UNBOUNDED)
            reasons.append(reason)
    assert len(reasons) == 50 and "length" in reasons


def test_a_budget_below_the_shortest_answer_is_refused(model, tokenizer):
    shortest = shortest_answer(
        tokenizer, model.config.vocab_size, tokenizer.eos_token_ids, parse_response_format(FORMAT)
    )
    assert json.loads(tokenizer.decode(shortest)) == {
        "colors": [],
        "note": "",
        "owner": {"name": "", "age": 0},
    }
    with pytest.raises(
        tierlm.RequestError, match=f"max_new_tokens {len(shortest) - 1} is below the {len(shortest)} tokens"
    ):
        model.generate("hi", max_new_tokens=len(shortest) - 1, response_format=FORMAT)
    r = model.generate("hi", max_new_tokens=len(shortest), response_format=FORMAT)
    assert r.token_ids[0] == shortest and r.finish_reasons == ["length"]


def test_the_server_closes_answers_and_refuses_a_budget_too_small(model):
    """The openai SDK: json_object and json_schema answers with a small max_tokens are JSON ("length" where
    cut), streamed too; a max_tokens below the shortest answer is a 400 naming max_tokens."""
    with serve(model, max_batch_size=4) as live:
        client = openai.OpenAI(
            base_url=f"{live.url}/v1",
            api_key="none",
            max_retries=0,
            http_client=httpx.Client(trust_env=False),
        )
        messages = [{"role": "user", "content": ASK}]
        for seed in range(3):
            answer = client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=12,
                temperature=1.0,
                seed=seed,
                response_format={"type": "json_object"},
            )
            assert isinstance(json.loads(answer.choices[0].message.content), dict)
        stream = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=30,
            temperature=1.0,
            seed=5,
            response_format=FORMAT,
            stream=True,
        )
        chunks = [c for c in stream if c.choices]
        jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), UNBOUNDED)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        body = {"model": "tiny", "messages": messages, "max_completion_tokens": 5, "response_format": FORMAT}
        reply = httpx.post(f"{live.url}/v1/chat/completions", json=body, trust_env=False, timeout=60)
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "max_completion_tokens" and "shortest answer" in error["message"]
