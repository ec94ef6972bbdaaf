"""vLLM's extensions to OpenAI's API over HTTP, on both batching modes, with the library's generate() (the same
settings as GenerationConfig fields) as reference: what ends a choice (`min_tokens`, `ignore_eos`,
`stop_token_ids`, `include_stop_str_in_output`), `allowed_token_ids`, `truncate_prompt_tokens` and
`return_tokens_as_token_ids`.

The served tiny model's EOS logit is 0, so a greedy run never ends by itself: a logit_bias of +100 on EOS (or on
another token) makes the model want it at every step, which is what these settings must hold back or ignore."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import NAME, serve, write_served_model

import tierlm
from tierlm.generation.config import GenerationConfig
from tierlm.tokenizer.pieces import piece_text

COMPLETIONS = "/v1/completions"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tierlm.load(write_served_model(tmp_path_factory.mktemp("ending") / "tiny"), dtype="float32")


@pytest.fixture(scope="module", params=["continuous", "static"])
def http(request, model):
    with serve(model, max_batch_size=4, batching=request.param) as live:
        with httpx.Client(base_url=live.url, trust_env=False, timeout=120) as client:
            yield client


def complete(http, **fields) -> dict:
    """The one choice of a greedy completion, with its token strings and completion_tokens."""
    body = {"model": NAME, "prompt": PROMPT, "temperature": 0, "logprobs": 0, **fields}
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    choice = reply["choices"][0]
    return {**choice, "tokens": choice["logprobs"]["tokens"], "count": reply["usage"]["completion_tokens"]}


def streamed_text(http, **fields) -> str:
    body = {"model": NAME, "prompt": PROMPT, "temperature": 0, "stream": True, **fields}
    parts = []
    with http.stream("POST", COMPLETIONS, json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(parts)


def library(model, **settings):
    """(token ids, text, finish reason) of the library's greedy run with the same settings."""
    r = model.generate(PROMPT, GenerationConfig(**settings))
    return r.token_ids[0], r.texts[0], r.finish_reasons[0]


def eos(model) -> int:
    return model.tokenizer.eos_token_ids[0]


def piece(model, token: int) -> str:
    """A token's text as the server's logprobs name it."""
    return piece_text(model.tokenizer.token_bytes(token))


def test_ignore_eos_decodes_past_an_eos_the_model_wants_to_max_tokens(http, model):
    bias = {str(eos(model)): 100}
    ended = complete(http, max_tokens=5, logit_bias=bias)
    assert (ended["count"], ended["finish_reason"], ended["text"], ended["stop_reason"]) == (
        1,
        "stop",
        "",
        None,
    )
    ignored = complete(http, max_tokens=5, logit_bias=bias, ignore_eos=True)
    assert (ignored["count"], ignored["finish_reason"], ignored["stop_reason"]) == (5, "length", None)
    assert ignored["tokens"] == [piece(model, eos(model))] * 5  # EOS sampled five times, no text
    assert ignored["text"] == ""
    ids, text, reason = library(model, max_new_tokens=5, logit_bias={eos(model): 100}, ignore_eos=True)
    assert (ids, text, reason) == ([eos(model)] * 5, "", "length")


def test_min_tokens_holds_eos_back_for_that_many_tokens(http, model):
    bias = {str(eos(model)): 100}
    got = complete(http, max_tokens=8, min_tokens=3, logit_bias=bias)
    assert (got["count"], got["finish_reason"]) == (4, "stop")
    ids, text, reason = library(model, max_new_tokens=8, min_new_tokens=3, logit_bias={eos(model): 100})
    assert eos(model) not in ids[:3] and ids[3] == eos(model) and len(ids) == 4
    assert (got["text"], got["tokens"]) == (text, [piece(model, t) for t in ids])
    assert streamed_text(http, max_tokens=8, min_tokens=3, logit_bias=bias) == text


def test_a_stop_token_id_ends_the_choice_and_adds_no_text(http, model):
    plain, _, _ = library(model, max_new_tokens=8)
    stop = plain[3]
    k = plain.index(stop)  # the first time the greedy run samples it
    got = complete(http, max_tokens=8, stop_token_ids=[stop])
    assert (got["count"], got["finish_reason"], got["stop_reason"]) == (k + 1, "stop", stop)  # vLLM's
    assert got["tokens"] == [piece(model, t) for t in plain[: k + 1]]
    assert got["text"] == model.tokenizer.decode(plain[:k]) != model.tokenizer.decode(plain[: k + 1])
    assert library(model, max_new_tokens=8, stop_token_ids=(stop,))[1:] == (got["text"], "stop")


def test_min_tokens_holds_stop_token_ids_back_too(http, model):
    """A forced stop token is masked for min_tokens tokens, then it ends the choice (vLLM masks every token
    that ends a sequence, EOS included, before min_tokens)."""
    forced = 100
    assert forced != eos(model)
    got = complete(http, max_tokens=8, min_tokens=2, logit_bias={str(forced): 100}, stop_token_ids=[forced])
    assert (got["count"], got["finish_reason"]) == (3, "stop")
    ids, text, _ = library(
        model, max_new_tokens=8, min_new_tokens=2, logit_bias={forced: 100}, stop_token_ids=(forced,)
    )
    assert forced not in ids[:2] and ids[2] == forced
    assert got["text"] == text == model.tokenizer.decode(ids[:2])


def test_min_tokens_defers_stop_strings_as_vllm_does(http, model):
    """Stop strings are looked for only in the text of tokens after the first min_tokens (as vLLM's
    detokenizer does): a token that writes "a" every step stops at once without min_tokens, and after four
    tokens with min_tokens=3."""
    forced = model.tokenizer.encode("a", add_special_tokens=False)
    assert len(forced) == 1 and model.tokenizer.decode(forced) == "a"
    bias = {str(forced[0]): 100}
    at_once = complete(http, max_tokens=8, logit_bias=bias, stop="a")
    assert (at_once["count"], at_once["text"], at_once["finish_reason"]) == (1, "", "stop")
    later = complete(http, max_tokens=8, logit_bias=bias, stop="a", min_tokens=3)
    assert (later["count"], later["text"], later["finish_reason"], later["stop_reason"]) == (
        4,
        "aaa",
        "stop",
        "a",
    )
    assert streamed_text(http, max_tokens=8, logit_bias=bias, stop="a", min_tokens=3) == "aaa"
    _, text, reason = library(
        model, max_new_tokens=8, min_new_tokens=3, logit_bias={forced[0]: 100}, stop=("a",)
    )
    assert (text, reason) == ("aaa", "stop")


def test_the_settings_are_validated_as_generation_config_fields(model):
    with pytest.raises(ValueError, match="stop_token_ids must be a list of token ids >= 0"):
        GenerationConfig(stop_token_ids=[-1])
    with pytest.raises(ValueError, match="ignore_eos must be True or False"):
        GenerationConfig(ignore_eos=1)
    with pytest.raises(ValueError, match="bad_words must be a list of words"):
        GenerationConfig(bad_words="word")
    with pytest.raises(ValueError, match="allowed_token_ids must name at least one token"):
        GenerationConfig(allowed_token_ids=[])
    with pytest.raises(
        ValueError, match=r"stop_token_ids names token id 320; this model's ids are in \[0, 320\)"
    ):
        model.generate(PROMPT, max_new_tokens=2, stop_token_ids=(320,))


def test_include_stop_str_in_output_keeps_what_ended_the_choice(http, model):
    """vLLM's include_stop_str_in_output: the text keeps the stop string (and nothing the token wrote after
    it), or the text of the stop token, that ended the choice."""
    forced = model.tokenizer.encode("a", add_special_tokens=False)[0]
    bias = {str(forced): 100}
    kept = complete(http, max_tokens=8, logit_bias=bias, stop="a", include_stop_str_in_output=True)
    assert (kept["count"], kept["text"], kept["finish_reason"]) == (1, "a", "stop")
    later = dict(
        max_tokens=8, logit_bias=bias, stop=["aa", "a"], min_tokens=3, include_stop_str_in_output=True
    )
    assert (complete(http, **later)["text"], streamed_text(http, **later)) == ("aaaa", "aaaa")  # "aa" at 2
    plain, _, _ = library(model, max_new_tokens=8)
    stop = plain[3]
    k = plain.index(stop)
    got = complete(http, max_tokens=8, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert (got["count"], got["text"]) == (k + 1, model.tokenizer.decode(plain[: k + 1]))
    settings = dict(max_new_tokens=8, stop_token_ids=(stop,), include_stop_str_in_output=True)
    assert library(model, **settings)[1] == got["text"]


def test_a_stop_string_inside_a_token_cuts_the_text_there():
    """TextTracker alone: the earliest stop string wins (at one place, the first listed), with or without
    itself in the text, and text a token wrote past it is cut."""
    from tierlm.generation.text import TextTracker

    class Pieces:  # a stream decoder whose tokens are their own text
        def push(self, token):
            return token

        def flush(self):
            return ""

    for include, want in ((False, "xy"), (True, "xyzzq")):  # "zzq" and "zz" both start at 2; "q" at 4
        t = TextTracker(Pieces(), ("zzq", "zz", "q"), include=include)
        for piece in ("xy", "zzq!"):
            t.push(piece)
        assert t.final == want, (include, t.final)


def test_allowed_token_ids_are_all_a_sampled_choice_may_take(http, model):
    """Sampled at temperature 1: every token is one of the allowed (EOS is not, so it runs to max_tokens), and
    the tokens are the seeded library run's; logprobs name them "token_id:<id>" when asked."""
    allowed = [7, 40, 41, 200]
    fields = dict(max_tokens=12, temperature=1.0, seed=5, allowed_token_ids=allowed)
    got = complete(http, **fields, return_tokens_as_token_ids=True)
    ids = [int(t.removeprefix("token_id:")) for t in got["tokens"]]
    assert set(ids) <= set(allowed) and len(set(ids)) > 1 and got["finish_reason"] == "length"
    r = model.generate(PROMPT, max_new_tokens=12, do_sample=True, seed=5, allowed_token_ids=tuple(allowed))
    assert ids == r.token_ids[0] and got["text"] == r.texts[0]


def test_return_tokens_as_token_ids_names_tokens_by_id_and_changes_nothing_else(http, model):
    fields = dict(max_tokens=6, logprobs=2)
    named, by_id = complete(http, **fields), complete(http, **fields, return_tokens_as_token_ids=True)
    ids, _, _ = library(model, max_new_tokens=6)
    assert by_id["tokens"] == [f"token_id:{t}" for t in ids] and named["tokens"] == [
        piece(model, t) for t in ids
    ]
    assert by_id["logprobs"]["text_offset"] == named["logprobs"]["text_offset"]
    assert all(key.startswith("token_id:") for top in by_id["logprobs"]["top_logprobs"] for key in top)
    assert by_id["text"] == named["text"]
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert all(
        e["token"].startswith("token_id:") and e["top_logprobs"][0]["token"].startswith("token_id:")
        for e in content
    )


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http, model):
    ids = model.tokenizer.encode("Once upon a time there was a small town by the sea")
    assert len(ids) > 6
    cut = complete(http, prompt=ids, max_tokens=4, truncate_prompt_tokens=5, echo=True)
    short = complete(http, prompt=ids[-5:], max_tokens=4, echo=True)
    assert cut["text"] == short["text"] and cut["text"].startswith(model.tokenizer.decode(ids[-5:]))
    usage = http.post(
        COMPLETIONS, json={"model": NAME, "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 5}
    )
    assert usage.json()["usage"]["prompt_tokens"] == 5
    whole = http.post(
        COMPLETIONS, json={"model": NAME, "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": -1}
    )
    assert whole.json()["usage"]["prompt_tokens"] == len(ids)  # -1: up to the context, which it fits
    zero = http.post(
        COMPLETIONS, json={"model": NAME, "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 0}
    )
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "truncate_prompt_tokens"


def test_skip_special_tokens_false_keeps_special_tokens_text(http, model):
    """A special token the model is pushed to write (ChatML's <|im_start|>, not EOS) has no text by default,
    and its own with skip_special_tokens false, as vLLM writes it; the offsets follow the text."""
    special = model.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert len(special) == 1 and special[0] not in model.tokenizer.eos_token_ids
    fields = dict(max_tokens=3, logit_bias={str(special[0]): 100})
    assert complete(http, **fields)["text"] == ""
    kept = complete(http, **fields, skip_special_tokens=False)
    assert kept["text"] == "<|im_start|>" * 3 and kept["logprobs"]["text_offset"] == [0, 12, 24]
    _, text, _ = library(model, max_new_tokens=3, logit_bias={special[0]: 100}, skip_special_tokens=False)
    assert text == kept["text"]


THINKING = (  # Qwen3's switch, in the served ChatML template
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(tmp_path):
    """vLLM's chat_template_kwargs are the template's variables (Qwen3's enable_thinking): /tokenize and a chat
    completion read them; the template's own names are a 400, and so is the field on a completion."""
    folder = write_served_model(tmp_path / "thinking")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING}))
    messages = [{"role": "user", "content": "hi"}]
    off = {"enable_thinking": False}
    with serve(tierlm.load(folder, dtype="float32")) as live:
        with httpx.Client(base_url=live.url, trust_env=False, timeout=120) as http:
            plain = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
            thinking = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": off}).json()
            assert (
                http.post("/detokenize", json={"tokens": thinking["tokens"]})
                .json()["prompt"]
                .endswith("assistant\n<think>\n\n</think>\n\n")
            )
            assert thinking["tokens"][: len(plain)] == plain and thinking["count"] > len(plain)
            body = {"model": NAME, "messages": messages, "max_tokens": 1, "chat_template_kwargs": off}
            assert (
                http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
                == thinking["count"]
            )
            bad = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"messages": []}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
            refused = http.post(
                COMPLETIONS, json={"model": NAME, "prompt": "hi", "chat_template_kwargs": off}
            )
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


RAG = (  # a template that reads vLLM's documents, as Command-R's and Granite's do
    "{% for d in documents or [] %}{{ '<doc ' + d['title'] + '>' + d['text'] + '</doc>\\n' }}{% endfor %}"
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def test_a_request_brings_its_chat_template_and_documents(model):
    """vLLM's chat_template (where the server trusts requests' templates, --trust-request-chat-template)
    and documents: /tokenize and a chat render them as the library does; untrusted, the template is a 400,
    and neither is a completion's field."""
    messages, docs = [{"role": "user", "content": "hi"}], [{"title": "T", "text": "tea is hot"}]
    tok = model.tokenizer
    text = tok.apply_chat_template(messages, chat_template=RAG, documents=docs)
    assert text == "<doc T>tea is hot</doc>\nuser: hi\nassistant: "
    expected = tok.encode(text, add_special_tokens=False)
    fields = {"messages": messages, "chat_template": RAG, "documents": docs}
    body = {"model": NAME, "max_tokens": 1, **fields}
    with serve(model, trust_request_chat_template=True) as live:
        with httpx.Client(base_url=live.url, trust_env=False, timeout=120) as http:
            assert http.post("/tokenize", json=fields).json()["tokens"] == expected
            reply = http.post("/v1/chat/completions", json=body).json()
            assert reply["usage"]["prompt_tokens"] == len(expected)
            plain = http.post("/tokenize", json={**fields, "documents": None}).json()["tokens"]
            assert plain == tok.encode("user: hi\nassistant: ", add_special_tokens=False)
    with serve(model) as live:
        with httpx.Client(base_url=live.url, trust_env=False, timeout=120) as http:
            refused = http.post("/v1/chat/completions", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
            assert "--trust-request-chat-template" in refused.json()["error"]["message"]
            own = {"model": NAME, "max_tokens": 1, "messages": messages, "documents": docs}
            served = http.post("/v1/chat/completions", json=own)  # the model's template ignores documents
            assert served.status_code == 200, served.text
            plain = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
            assert served.json()["usage"]["prompt_tokens"] == len(plain)
            completion = http.post(COMPLETIONS, json={"model": NAME, "prompt": "hi", "documents": docs})
            assert completion.status_code == 400 and completion.json()["error"]["param"] == "documents"


NAMED = "{% for m in messages %}{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}: {{ m.content }}\n{% endfor %}"


def test_a_message_name_reaches_the_chat_template_as_in_vllm(model):
    """A message's `name` (AutoGen, multi-agent chats) is handed to the chat template, which may render it (a
    template of the request's) or not (the model's own, which ignores it): never a 400."""
    messages = [{"role": "user", "content": "hi", "name": "bob"}, {"role": "assistant", "content": "yo"}]
    with serve(model, trust_request_chat_template=True) as live:
        with httpx.Client(base_url=live.url, trust_env=False, timeout=120) as http:
            tokens = http.post("/tokenize", json={"messages": messages, "chat_template": NAMED}).json()[
                "tokens"
            ]
            text = "user (bob): hi\nassistant: yo\n"
            assert tokens == model.tokenizer.encode(text, add_special_tokens=False)
            body = {"model": NAME, "max_tokens": 1, "messages": messages}
            served = http.post("/v1/chat/completions", json=body)
            assert served.status_code == 200, served.text
            unnamed = [{k: v for k, v in m.items() if k != "name"} for m in messages]
            plain = model.tokenizer.encode(
                model.tokenizer.apply_chat_template(unnamed), add_special_tokens=False
            )
            assert served.json()["usage"]["prompt_tokens"] == len(plain)


def test_bad_words_are_never_written(http, model):
    """vLLM's bad_words: a two-token word the greedy run writes is cut off at its second token, the same as
    the library's run, and a one-token word the model is pushed to write never comes."""
    from tierlm.generation.bad_words import word_sequences

    plain, _, _ = library(model, max_new_tokens=16)
    pairs = [(i, model.tokenizer.decode(plain[i : i + 2]).strip()) for i in range(len(plain) - 1)]
    i, word = next(
        (i, w) for i, w in pairs if w and tuple(plain[i : i + 2]) in word_sequences(model.tokenizer, (w,))
    )
    banned = word_sequences(model.tokenizer, (word,))
    got = complete(http, max_tokens=16, bad_words=[word], return_tokens_as_token_ids=True)
    ids = [int(t.removeprefix("token_id:")) for t in got["tokens"]]
    assert ids[: i + 1] == plain[: i + 1] and ids[i + 1] != plain[i + 1]
    assert not any(tuple(ids[j : j + len(s)]) == s for s in banned for j in range(len(ids)))
    assert library(model, max_new_tokens=16, bad_words=(word,))[0] == ids
    forced = model.tokenizer.encode("a", add_special_tokens=False)[0]
    fields = dict(max_tokens=6, logit_bias={str(forced): 100}, return_tokens_as_token_ids=True)
    assert complete(http, **fields)["tokens"] == [f"token_id:{forced}"] * 6
    assert f"token_id:{forced}" not in complete(http, **fields, bad_words=["a"])["tokens"]


def test_stop_reason_names_the_stop_string_or_token_in_every_answer_form(http, model):
    """vLLM's stop_reason: the stop string or stop token id a "stop" finish ended on (None for EOS and for
    "length"), in a chat answer and in the chunk that ends a streamed choice."""
    forced = model.tokenizer.encode("a", add_special_tokens=False)[0]
    fields = {"max_tokens": 8, "logit_bias": {str(forced): 100}, "temperature": 0}
    with http.stream(
        "POST",
        COMPLETIONS,
        json={"model": NAME, "prompt": PROMPT, "stream": True, "stop": ["q", "a"], **fields},
    ) as response:
        chunks = [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    last = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in last] == [("stop", "a")]
    chat = {
        "model": NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "stop_token_ids": [forced],
        **fields,
    }
    choice = http.post("/v1/chat/completions", json=chat).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["message"]["content"]) == (
        "stop",
        forced,
        "",
    )


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(http, model):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries the usage so far
    (the choice's tokens), the last usage chunk the total; without it, chunks carry "usage": null."""

    def chunks(options: dict) -> list[dict]:
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 6, "stream": True, "stream_options": options}
        body["temperature"] = 0  # both streams the same text, so the same chunks (sampled, they differed)
        with http.stream("POST", COMPLETIONS, json=body) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        return [json.loads(line) for line in lines if line != "[DONE]"]

    prompt_tokens = len(model.tokenizer.encode(PROMPT))
    counted = chunks({"include_usage": True, "continuous_usage_stats": True})
    usage = [c["usage"] for c in counted]
    assert all(u["prompt_tokens"] == prompt_tokens for u in usage)
    tokens = [u["completion_tokens"] for u in usage]
    assert tokens == sorted(tokens) and tokens[-1] == 6 and tokens[0] >= 1
    assert [c["usage"] for c in chunks({"include_usage": True})][:-1] == [None] * (len(counted) - 1)


def beams_reference(model, n: int, **settings):
    """The library's n best beams of PROMPT."""
    return model.generate(PROMPT, GenerationConfig(num_beams=n, n=n, **settings))


def test_use_beam_search_answers_the_librarys_n_best_beams(http, model):
    """vLLM's use_beam_search: n beams, the n best back in order, with length_penalty, a stop token that
    ends some of them (its stop_reason), and the sampling settings not applied (beams are greedy)."""
    stop = beams_reference(model, 3, max_new_tokens=8).token_ids[0][2]  # ends some beams
    ref = beams_reference(model, 3, max_new_tokens=8, length_penalty=0.5, stop_token_ids=(stop,))
    texts, reasons, last = ref.texts, ref.finish_reasons, [t[-1] for t in ref.token_ids]
    assert "stop" in reasons
    body = dict(model=NAME, prompt=PROMPT, max_tokens=8, n=3, use_beam_search=True, length_penalty=0.5)
    body |= dict(stop_token_ids=[stop], temperature=1.0, top_p=0.5, prompt_logprobs=1)
    reply = http.post(COMPLETIONS, json=body).json()
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    for c in choices:  # the prompt's log probabilities come with each beam
        assert (
            c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]
        )
    assert [c["text"] for c in choices] == texts
    assert [c["finish_reason"] for c in choices] == reasons
    assert [c["stop_reason"] for c in choices] == [t if w == "stop" else None for t, w in zip(last, reasons)]
    assert reply["usage"]["completion_tokens"] == sum(len(t) for t in ref.token_ids)


def test_a_streamed_beam_search_chat_sends_each_beam_when_it_ends(http, model):
    messages = [{"role": "user", "content": "Say something."}]
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    ref = model.generate([ids], num_beams=2, n=2, max_new_tokens=6)
    body = dict(model=NAME, messages=messages, max_tokens=6, n=2, use_beam_search=True, stream=True)
    parts: dict[int, str] = {}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    parts[choice["index"]] = parts.get(choice["index"], "") + (
                        choice["delta"].get("content") or ""
                    )
    assert [parts[0], parts[1]] == ref.texts


def test_a_beam_search_runs_beside_other_requests(http, model):
    """A beam search and a sampled request in flight together each get their solo answers."""
    from concurrent.futures import ThreadPoolExecutor

    texts = beams_reference(model, 4, max_new_tokens=24).texts
    _, solo, _ = library(model, max_new_tokens=24, do_sample=True, seed=5)
    beam_body = dict(model=NAME, prompt=PROMPT, max_tokens=24, n=4, use_beam_search=True)
    sample_body = dict(model=NAME, prompt=PROMPT, max_tokens=24, seed=5)
    with ThreadPoolExecutor(2) as pool:
        beams = pool.submit(http.post, COMPLETIONS, json=beam_body)
        sampled = pool.submit(http.post, COMPLETIONS, json=sample_body)
        beams, sampled = beams.result().json(), sampled.result().json()
    assert [c["text"] for c in sorted(beams["choices"], key=lambda c: c["index"])] == texts
    assert sampled["choices"][0]["text"] == solo


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(use_beam_search=True, n=2, stop=["x"]), "stop"),
        (dict(use_beam_search=True, n=2, logprobs=1), None),
        (dict(use_beam_search=True, n=2, presence_penalty=1.0), None),
        (dict(length_penalty=2.0), "length_penalty"),
    ],
)
def test_what_a_beam_search_does_not_take_is_a_400(http, fields, name):
    response = http.post(COMPLETIONS, json=dict(model=NAME, prompt=PROMPT, max_tokens=4, **fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name
    assert ("beam" in error["message"]) or name == "length_penalty"


def test_prompt_logprobs_in_vllms_shape(http, model):
    """vLLM's prompt_logprobs: per prompt token (the first None) its id -> logprob, rank and decoded_token,
    and the k most likely tokens there ranked 1..k, each checked against the model's own logits; a chat
    answers it beside the choices; a stream or k > 20 is a 400."""
    import torch

    ids = model.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logprobs = model(torch.tensor([ids]))[0].float().log_softmax(-1)
    body = dict(model=NAME, prompt=PROMPT, max_tokens=2, prompt_logprobs=3, n=2)
    choices = http.post(COMPLETIONS, json=body).json()["choices"]
    got = choices[0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids) and choices[1]["prompt_logprobs"] == got
    for i in range(1, len(ids)):
        row, token = logprobs[i - 1], ids[i]
        top = row.topk(3).indices.tolist()
        assert set(got[i]) == {str(t) for t in [token, *top]}
        own = got[i][str(token)]
        assert own["rank"] == int((row > row[token]).sum()) + 1
        assert own["logprob"] == pytest.approx(row[token].item(), abs=1e-5)
        assert own["decoded_token"] == piece(model, token)
        assert [got[i][str(t)]["rank"] for t in top if t != token] == [
            r + 1 for r, t in enumerate(top) if t != token
        ]
    messages = [{"role": "user", "content": "hi"}]
    reply = http.post(
        "/v1/chat/completions", json=dict(model=NAME, messages=messages, max_tokens=1, prompt_logprobs=0)
    )
    chat = reply.json()
    assert (
        chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    )
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # k = 0: the prompt token alone
    for bad in (dict(stream=True), dict(prompt_logprobs=21)):
        refused = http.post(COMPLETIONS, json={**body, **bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
