"""The server's continuous batching, log probabilities, n, penalties, logit_bias and several prompts, over HTTP."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from test_server import NAME, SPECIALS, check_error, serve, write_served_model

import tierlm
from tierlm.generation.config import GenerationConfig
from tierlm.tokenizer.pieces import piece_text

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_served_model(tmp_path_factory.mktemp("served") / "tiny")


@pytest.fixture(scope="module")
def live(tiny_dir):
    with serve(tierlm.load(tiny_dir, dtype="float32"), max_batch_size=16) as s:
        yield s


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.url, trust_env=False, timeout=120) as c:
        yield c


def complete(http, **fields) -> dict:
    response = http.post(COMPLETIONS, json={"model": NAME, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(url: str, body: dict, sink: list, tag: str) -> None:
    """Stream a completion, appending (tag, text) per chunk and (tag, None) at the end, in arrival order."""
    with httpx.Client(trust_env=False, timeout=300) as c:
        with c.stream("POST", f"{url}{COMPLETIONS}", json={"model": NAME, "stream": True, **body}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    sink.append((tag, json.loads(line[6:])["choices"][0]["text"]))
    sink.append((tag, None))


# --- continuous batching ---------------------------------------------------------------------------------------


def test_short_request_joins_a_running_long_one_and_finishes_first(live):
    events: list = []
    long_body = {"prompt": "Go on and on", "max_tokens": 256, "temperature": 0}
    long = threading.Thread(target=stream_events, args=(live.url, long_body, events, "long"))
    long.start()
    deadline = time.monotonic() + 60
    while sum(tag == "long" for tag, _ in events) < 3:  # the long one has streamed its first tokens
        assert time.monotonic() < deadline and long.is_alive()
        time.sleep(0.005)
    stream_events(live.url, {"prompt": "Hello", "max_tokens": 4, "temperature": 0}, events, "short")
    long.join()
    order = [tag for tag, text in events if text is not None or tag == "long"]
    first_short = order.index("short")
    long_end = len(order) - 1 - order[::-1].index("long")
    assert first_short < long_end, "the short request waited for the long one"
    assert sum(1 for tag, text in events if tag == "long" and text) > 100  # it did run long
    stats = live.stats()
    assert stats["batching"] == "continuous"
    assert stats["joined_running_batch"] >= 1 and stats["left_running_batch"] >= 1, stats
    sizes = {int(rows): steps for rows, steps in stats["batch_sizes"].items()}  # rows decoding -> steps
    assert sizes.get(2, 0) >= 1 and sum(sizes.values()) == stats["decode_steps"], stats


MIXED = [  # (sampling fields, compared with the library's solo run: greedy and seeded rows)
    {"temperature": 0},
    {"temperature": 0, "presence_penalty": 1.2},
    {"temperature": 0, "frequency_penalty": 0.8, "logit_bias": {"40": 4.0}},
    {"temperature": 0, "repetition_penalty": 1.4},
    {"temperature": 0.9, "seed": 11},
    {"temperature": 1.0, "seed": 12, "top_k": 20},
    {"temperature": 0.8, "seed": 13, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.2, "seed": 14, "presence_penalty": 0.5},
]
PROMPTS = ["The quick brown fox", "Hello, world!", "A tiny model", "Servers answer"]


def library_config(fields: dict, max_tokens: int) -> GenerationConfig:
    t = fields.get("temperature", 1.0)
    bias = {int(k): v for k, v in fields.get("logit_bias", {}).items()}
    plain = {k: v for k, v in fields.items() if k not in ("temperature", "logit_bias")}
    return GenerationConfig(
        max_new_tokens=max_tokens, do_sample=t > 0, temperature=t, logit_bias=bias, **plain
    )


def test_sixteen_concurrent_mixed_streams_each_equal_their_solo_runs(live, tiny_dir):
    reference = tierlm.load(tiny_dir, dtype="float32")
    jobs = [(PROMPTS[i % 4], MIXED[i % 8], 6 + 5 * (i % 5)) for i in range(14)]
    jobs += [(PROMPTS[0], {"temperature": 1.0}, 12), (PROMPTS[1], {"temperature": 0.7, "top_p": 0.8}, 9)]
    delays = random.Random(0).sample(range(16), 16)

    def run(i: int) -> str:
        time.sleep(delays[i] * 0.01)  # staggered: requests join while others decode
        prompt, fields, n = jobs[i]
        events: list = []
        stream_events(live.url, {"prompt": prompt, "max_tokens": n, **fields}, events, "x")
        return "".join(text for _, text in events if text)

    joined = live.stats()["joined_running_batch"]
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(run, range(16)))
    for (prompt, fields, n), text in zip(jobs[:14], texts):
        solo = reference.generate(prompt, library_config(fields, n)).texts[0]
        assert text == solo, fields
    stats = live.stats()
    assert stats["max_batch_size_seen"] > 1 and stats["joined_running_batch"] > joined
    assert stats["max_batch_size_seen"] <= stats["max_batch_size"]  # rows in use, not n of running requests


def test_int4_rows_of_a_continuous_batch_get_the_bits_of_their_solo_runs(tmp_path):
    """Where tierlm's kernels run every product and the decode attention (x86), a continuous batch's row is
    computed as it is alone: the int4/int8 products sum each activation row on its own (tests/test_kernels.py),
    and the attention kernel cuts a row's attended slots into chunks by rank, not by slot index (in a
    continuous step this step's key sits in a scratch column past the longest row). So each greedy request's
    log probabilities are exactly its solo run's. fp32 activations, so that a difference of one fp32 ulp in
    the attention reaches the logits (the kernel cutting chunks by slot index failed here; bf16's rounding
    hides most such differences, and the default model's bf16 greedy rows drifted only after dozens of
    tokens)."""
    from tierlm import kernels
    from tierlm.models import layers
    from tierlm.quant import Int4Linear, Int8Linear

    if kernels.int4_block() is None or not layers.attention_kernel():
        pytest.skip("tierlm's int4 and attention kernels do not run here")
    # K/V heads as wide as the query heads: every projection a multiple of 64 rows, all on the int4 kernel
    model = tierlm.load(
        write_served_model(tmp_path / "tiny", num_key_value_heads=4), dtype="float32", quantize="int4"
    )
    products = [m for m in model.decoder.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert len(products) == 15 and all(m.kernel for m in products)  # 7 per layer, the LM head int8
    assert all(layer.self_attn.kernel for layer in model.decoder.model.layers)
    rng = random.Random(3)
    jobs = [
        ([rng.randrange(3, 300) for _ in range(length)], 200 + 20 * (i % 4))
        for i, length in enumerate([3, 29, 9, 70, 17, 5, 41, 12])
    ]

    def run(url: str, i: int, started: threading.Event | None = None) -> tuple[list, list]:
        """Stream job i; its tokens and log probabilities. `started` is set at its first token."""
        ids, n = jobs[i]
        body = {
            "model": NAME,
            "prompt": ids,
            "max_tokens": n,
            "temperature": 0,
            "logprobs": 1,
            "stream": True,
        }
        tokens, values = [], []
        with httpx.Client(trust_env=False, timeout=120) as c:
            with c.stream("POST", f"{url}{COMPLETIONS}", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        lp = json.loads(line[6:])["choices"][0]["logprobs"]
                        tokens += lp["tokens"] if lp else []
                        values += lp["token_logprobs"] if lp else []
                        if started is not None and tokens:
                            started.set()
        return tokens, values

    with serve(model, max_batch_size=8) as live:
        solo = [run(live.url, i) for i in range(len(jobs))]
        joined = live.stats()["joined_running_batch"]
        # each request sent once the one before it has its first token: every prompt is prefilled alone (rows
        # prefilled together are padded to one length, which rounds them by batch), then joins the running rows
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = []
            for i in range(len(jobs)):
                started = threading.Event()
                futures.append(pool.submit(run, live.url, i, started))
                assert started.wait(60) or futures[-1].done()
            together = [f.result() for f in futures]
        stats = live.stats()
        assert stats["max_batch_size_seen"] > 1 and stats["joined_running_batch"] > joined
    for i, (alone, batched) in enumerate(zip(solo, together)):
        assert batched == alone, i


def test_compiled_continuous_batch_equals_eager(tiny_dir):
    """With --compile the batch keeps fixed shapes (3 rows padded to 4, steps at 1, 2 or 4 rows); texts do
    not change."""
    from tierlm import CompileConfig

    model = tierlm.load(tiny_dir, dtype="float32")
    config = GenerationConfig(compile_config=CompileConfig(scope="layer"))
    with serve(model, max_batch_size=3, generation_config=config) as s:
        with httpx.Client(base_url=s.url, trust_env=False, timeout=300) as c, ThreadPoolExecutor(3) as pool:
            bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0} for p in PROMPTS[:3]]
            texts = list(pool.map(lambda b: complete(c, **b)["choices"][0]["text"], bodies))
    assert sorted({key[1] for key in model._compiled}) and all(key[1] in (1, 2, 4) for key in model._compiled)
    assert texts == [
        tierlm.load(tiny_dir, dtype="float32").generate(p, max_new_tokens=8).texts[0] for p in PROMPTS[:3]
    ]


def test_a_batch_after_generate_over_its_cache_shape_decodes_with_its_tokens(tiny_dir, monkeypatch):
    """A continuous batch reuses the model's static cache of its shape, which a generate() run made under
    inference mode (joining wrote to it outside inference mode: an error). And where the model's compiled
    step for that shape is bound to another cache (a whole step compiled by generate(); stubbed here), the
    batch decodes eagerly instead, through layer programs over a scratch column, with the same tokens."""
    from types import SimpleNamespace

    from tierlm import CompileConfig
    from tierlm.generation.continuous import Sequence, SlotBatch

    model = tierlm.load(tiny_dir, dtype="float32")
    prompt = model.tokenizer.encode(PROMPTS[0])
    expected = model.generate(prompt, max_new_tokens=6, min_new_tokens=6)
    bound_elsewhere = SimpleNamespace(cache=model.static_cache(2, 64))
    monkeypatch.setattr(model, "compiled_step", lambda *args: bound_elsewhere)
    config = GenerationConfig(compile_config=CompileConfig(), max_new_tokens=6, min_new_tokens=6)
    batch = SlotBatch(model, 1, config)
    batch.join(Sequence(0, prompt, config))
    tokens = []
    while batch.busy:
        tokens += [u.token for u in batch.advance() if u.token is not None]
    assert batch.decision.compile and batch.steps[1].startswith("eager"), batch.steps
    assert hasattr(batch._views[1][0].views[0], "decode_slots")  # an eager view: programs, the fused kernel
    assert tokens == expected.token_ids[0]


# --- log probabilities -----------------------------------------------------------------------------------------


def test_echo_logprobs_equal_log_softmax_of_the_model_logits(http, tiny_dir):
    ids = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11]
    body = complete(http, prompt=ids, echo=True, logprobs=3, max_tokens=3, temperature=0)
    lp = body["choices"][0]["logprobs"]
    assert (
        len(lp["tokens"]) == len(ids) + 3
        and lp["token_logprobs"][0] is None
        and lp["top_logprobs"][0] is None
    )
    model = tierlm.load(tiny_dir, dtype="float32")
    generated = model.generate(torch.tensor([ids]), max_new_tokens=3).token_ids[0]
    full = torch.tensor([ids + generated])
    reference = model(full).float().log_softmax(-1)[0]
    expected = [reference[i, full[0, i + 1]].item() for i in range(full.shape[1] - 1)]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    tokens = [piece_text(model.tokenizer.token_bytes(t)) for t in full[0].tolist()]
    assert lp["tokens"] == tokens
    assert body["choices"][0]["text"].startswith(model.tokenizer.decode(ids, skip_special_tokens=False))
    for position in range(1, full.shape[1]):
        values = reference[position - 1].topk(3).values.tolist()
        top = lp["top_logprobs"][position]
        assert max(top.values()) == pytest.approx(values[0], abs=1e-4)
        for value in top.values():
            assert any(abs(value - v) <= 1e-4 for v in [*values, expected[position - 1]])


@pytest.mark.parametrize("echo", [False, True])
def test_text_offsets_index_the_text_sent_even_inside_characters(http, live, echo):
    """A byte-level token may hold part of a character (its text is "bytes:\\xNN", its decode alone U+FFFD):
    text_offset still points into the text the client reads, streamed or not, where each token's text
    starts."""
    body = dict(
        prompt="Emoji list: \U0001f600 \U0001f603 <|im_end|> ok", echo=echo, logprobs=1, max_tokens=12
    )
    whole = complete(http, temperature=0, **body)["choices"][0]
    text, lp = whole["text"], whole["logprobs"]
    assert "bytes:\\x" in "".join(lp["tokens"])  # the emoji's bytes are tokens of their own here
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)
    for token, start in zip(lp["tokens"], offsets):
        if not token.startswith("bytes:") and (echo or token not in SPECIALS):
            assert text[start : start + len(token)] == token, (token, start, text)
    with httpx.Client(trust_env=False, timeout=120) as c:
        streamed = c.post(
            f"{live.url}{COMPLETIONS}", json={"model": NAME, "stream": True, "temperature": 0, **body}
        )
    chunks = [
        json.loads(line[6:])["choices"] for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    parts = [choice[0] for choice in chunks if choice]
    assert "".join(p["text"] for p in parts) == text
    assert [o for p in parts if p["logprobs"] for o in p["logprobs"]["text_offset"]] == offsets


def test_chat_top_logprobs_list_the_true_top_tokens_in_order(http, tiny_dir):
    messages = [{"role": "user", "content": "Hello there"}]
    response = http.post(
        CHAT,
        json={
            "model": NAME,
            "messages": messages,
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 5,
            "temperature": 0,
        },
    )
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    model = tierlm.load(tiny_dir, dtype="float32")
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    library = model.generate(torch.tensor([ids]), max_new_tokens=4, logprobs=5).logprobs[0]
    assert len(content) == 4
    for entry, ref in zip(content, library):
        assert entry["logprob"] == pytest.approx(ref.logprob, abs=1e-4)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            [v for _, v in ref.top], abs=1e-4
        )
        names = [piece_text(model.tokenizer.token_bytes(t)) for t, _ in ref.top]
        assert [t["token"] for t in entry["top_logprobs"]] == names
        assert entry["top_logprobs"][0]["logprob"] == max(t["logprob"] for t in entry["top_logprobs"])


def test_logprobs_carry_each_tokens_own_bytes(http, tiny_dir):
    """The tiny byte-level vocabulary emits single bytes inside characters. Each used to be reported as
    U+FFFD's UTF-8 (chat `bytes`) and the text '\ufffd' (so completions' top_logprobs kept one key for five
    tokens); now `bytes` are the token's own, they rebuild the text, and a partial token reads
    "bytes:\\xNN" as OpenAI writes it."""
    model = tierlm.load(tiny_dir, dtype="float32")
    chat = http.post(
        CHAT,
        json={
            "model": NAME,
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 40,
            "logprobs": True,
            "top_logprobs": 5,
            "temperature": 0,
        },
    ).json()["choices"][0]
    entries = [e for e in chat["logprobs"]["content"] if e["token"] not in SPECIALS]
    raw = bytes(b for e in entries for b in e["bytes"])
    assert raw.decode("utf-8", errors="replace") == chat["message"]["content"]
    partial = [e for e in entries if e["token"].startswith("bytes:")]
    assert partial, "no token inside a character in this run: the test shows nothing"
    for e in partial:
        assert e["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in e["bytes"])
    for e in chat["logprobs"]["content"]:
        assert len({t["token"] for t in e["top_logprobs"]}) == 5
    completion = http.post(
        COMPLETIONS,
        json={"model": NAME, "prompt": "Hello there", "max_tokens": 20, "logprobs": 5, "temperature": 0},
    ).json()["choices"][0]
    assert all(len(top) >= 5 for top in completion["logprobs"]["top_logprobs"])
    assert any(t.startswith("bytes:") for t in completion["logprobs"]["tokens"])
    assert model.tokenizer.token_bytes(model.tokenizer.token_to_id("<|im_end|>")) == b"<|im_end|>"


# --- n, several prompts --------------------------------------------------------------------------------------


def test_n_seeded_samples_are_distinct_and_reproducible(http):
    fields = dict(prompt="The quick brown fox", max_tokens=10, temperature=1.0, seed=5, n=4)
    first = [c["text"] for c in sorted(complete(http, **fields)["choices"], key=lambda c: c["index"])]
    assert len(set(first)) == 4
    again = [c["text"] for c in sorted(complete(http, **fields)["choices"], key=lambda c: c["index"])]
    assert again == first
    assert complete(http, **{**fields, "n": 1})["choices"][0]["text"] == first[0]


def test_several_prompts_give_one_choice_each_in_order(http, tiny_dir):
    model = tierlm.load(tiny_dir, dtype="float32")
    for prompts in (["Hello", "The fox", "A tiny model writes"], [[5, 6, 7, 8], [9, 10], [11]]):
        body = complete(http, prompt=prompts, max_tokens=5, temperature=0, n=2)
        choices = body["choices"]
        assert [c["index"] for c in choices] == list(range(6))
        for i, prompt in enumerate(prompts):
            solo = model.generate(prompt if isinstance(prompt, str) else [prompt], max_new_tokens=5).texts[0]
            assert choices[2 * i]["text"] == choices[2 * i + 1]["text"] == solo
        assert body["usage"]["completion_tokens"] == 30


# --- bad values ------------------------------------------------------------------------------------------------

GOOD_CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GOOD_TEXT = {"model": NAME, "prompt": "hi", "max_tokens": 2}
BAD = [
    (CHAT, {"n": 0}, "n"),
    (CHAT, {"n": 17}, "n"),
    (COMPLETIONS, {"n": 1.5}, "n"),
    (CHAT, {"presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"frequency_penalty": -3}, "frequency_penalty"),
    (CHAT, {"frequency_penalty": "x"}, "frequency_penalty"),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETIONS, {"top_k": -2}, "top_k"),
    (COMPLETIONS, {"min_p": 1.0}, "min_p"),
    (CHAT, {"logit_bias": {"abc": 1}}, "logit_bias"),
    (CHAT, {"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # str.isdigit() takes it, int() does not: was a 500
    (CHAT, {"logit_bias": {"99999": 1}}, "logit_bias"),
    (CHAT, {"logit_bias": {"5": 101}}, "logit_bias.5"),
    (CHAT, {"logit_bias": [1, 2]}, "logit_bias"),
    (COMPLETIONS, {"logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"logprobs": -1}, "logprobs"),
    (COMPLETIONS, {"logprobs": True}, "logprobs"),
    (COMPLETIONS, {"echo": "yes"}, "echo"),
    (CHAT, {"logprobs": 1}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (COMPLETIONS, {"prompt": ["a", ""]}, "prompt[1]"),
    (COMPLETIONS, {"prompt": [[5, 6], [7, 99999]]}, "prompt[1]"),
    (COMPLETIONS, {"min_tokens": -1}, "min_tokens"),
    (CHAT, {"min_tokens": 3}, "min_tokens"),  # over max_tokens (2)
    (CHAT, {"ignore_eos": "yes"}, "ignore_eos"),
    (COMPLETIONS, {"stop_token_ids": [320]}, "stop_token_ids"),  # the vocabulary is 320 tokens
    (COMPLETIONS, {"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    (CHAT, {"stop_token_ids": 5}, "stop_token_ids"),
    (COMPLETIONS, {"allowed_token_ids": []}, "allowed_token_ids"),
    (COMPLETIONS, {"allowed_token_ids": [3, 320]}, "allowed_token_ids"),
    (CHAT, {"allowed_token_ids": [-1]}, "allowed_token_ids[0]"),
    (COMPLETIONS, {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    (CHAT, {"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
    (COMPLETIONS, {"bad_words": [" "]}, "bad_words"),
    (CHAT, {"bad_words": "word"}, "bad_words"),
]


@pytest.mark.parametrize("path,fields,param", BAD, ids=[f"{p}:{f}" for p, f, _ in BAD])
def test_bad_value_of_a_new_field_is_400_naming_it(http, path, fields, param):
    base = GOOD_CHAT if path == CHAT else GOOD_TEXT
    check_error(http.post(path, json={**base, **fields}), 400, param)


def test_static_batching_answers_the_new_fields_as_continuous_does(http, tiny_dir):
    """`--batching static` (the previous worker, kept for the benchmark) honours the same fields."""
    fields = dict(prompt=[[5, 6, 7, 8], [9, 10, 11]], echo=True, logprobs=2, max_tokens=4, n=2)
    fields.update(temperature=0.9, seed=3, presence_penalty=0.4, logit_bias={"7": 2.0}, top_k=30)
    continuous = complete(http, **fields)
    with serve(tierlm.load(tiny_dir, dtype="float32"), max_batch_size=8, batching="static") as s:
        with httpx.Client(base_url=s.url, trust_env=False, timeout=120) as c:
            static = complete(c, **fields)
            assert s.stats()["batching"] == "static"
    assert [ch["text"] for ch in static["choices"]] == [ch["text"] for ch in continuous["choices"]]
    for a, b in zip(static["choices"], continuous["choices"]):
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(
            b["logprobs"]["token_logprobs"][1:], abs=1e-4
        )


def test_sequences_that_join_together_prefill_together_with_their_solo_tokens(tiny_dir):
    """Sequences waiting together prefill in one forward (left-padded into a scratch cache, each row's K/V
    then moved to its own slots 0..n-1): one prefill unit for three prompts of different lengths, and every
    sample's greedy tokens are exactly its solo run's (fp32), the n=2 request's two samples included."""
    from agreement import greedy

    from tierlm.generation.continuous import Sequence, SlotBatch

    model = tierlm.load(tiny_dir, dtype="float32")
    config = GenerationConfig(do_sample=False)
    batch = SlotBatch(model, 4, config, prefill_together=True)
    texts = ("Hello there", "A much longer prompt than the first one", "Hi")
    prompts = [model.tokenizer.encode(p) for p in texts]
    n = 8
    for i, prompt in enumerate(prompts):
        batch.join(
            Sequence(i, prompt, config.replace(max_new_tokens=n, min_new_tokens=n, n=2 if i == 2 else 1))
        )
    tokens: dict[tuple, list[int]] = {}
    units = 0
    while batch.busy:
        for u in batch.advance():
            if u.token is not None:
                tokens.setdefault((u.key, u.choice), []).append(u.token)
        units += 1
        if units == 1:
            assert batch.stats["prefill_chunks"] == 1 and batch.stats["prefills_together"] == 3, batch.stats
            assert not batch.waiting
    assert set(tokens) == {(0, 0), (1, 0), (2, 0), (2, 1)}
    for (key, _choice), got in tokens.items():
        assert (
            got == greedy(model, torch.tensor([prompts[key]]), max_new_tokens=n, min_new_tokens=n).tokens[0]
        )


def test_an_eager_continuous_step_reads_only_the_slots_in_use(tiny_dir, attention_lengths):
    """The batch's cache is sized for the longest request it may hold; an eager decode step attends over
    the slots its rows have written (up to the furthest row), as generate's steps do, not the whole cache."""
    from tierlm.generation.continuous import Sequence, SlotBatch

    model = tierlm.load(tiny_dir, dtype="float32")
    lengths = attention_lengths
    config = GenerationConfig(do_sample=False)
    batch = SlotBatch(model, 4, config)
    prompts = [model.tokenizer.encode(p) for p in ("Hello there", "A much longer prompt than the first one")]
    for i, prompt in enumerate(prompts):
        batch.join(Sequence(i, prompt, config.replace(max_new_tokens=200, min_new_tokens=200)))
    while batch.waiting:
        batch.advance()
    lengths.clear()
    for _ in range(3):
        batch.advance()
    furthest = max(len(p) for p in prompts) + 3
    assert lengths and max(lengths) <= furthest + 1 < batch.length
