"""Generation: token parity with transformers, caches, batching, sampling, stopping, streaming, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES

import tierlm


def hf_greedy(hf, ids, mask, new_tokens, eos):
    """transformers' greedy tokens per row, cut after the first EOS (it pads after that)."""
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=eos,
        )
    rows = []
    for row in out[:, ids.shape[1] :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t == eos), len(row))
        rows.append(row[:cut])
    return rows


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


PROMPTS = [[5, 17, 99, 230, 41, 7, 8], [300, 12, 45], [77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87]]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(tiny_checkpoints, family, cache):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints[family]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = tierlm.load(path, dtype="float32")
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = hf_greedy(hf, ids, torch.ones_like(ids), 32, eos=2)
        ours = model.generate(ids, max_new_tokens=32, cache_implementation=cache, eos_token_id=2)
        assert ours.token_ids == ref, (family, cache, prompt)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_batched_matches_one_by_one_and_transformers(tiny_checkpoints, family):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints[family]
    model = tierlm.load(path, dtype="float32")
    alone = [model.generate(torch.tensor([p]), max_new_tokens=20).token_ids[0] for p in PROMPTS]
    for cache in ("static", "dynamic"):
        batched = model.generate([list(p) for p in PROMPTS], max_new_tokens=20, cache_implementation=cache)
        assert batched.token_ids == alone, cache
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask = left_padded(PROMPTS)
    assert hf_greedy(hf, ids, mask, 20, eos=2) == alone


@pytest.fixture(scope="module")
def default_model():
    return tierlm.load(dtype="float32")


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_default_model_greedy_matches_transformers(default_model, hf_default_model):
    prompt = default_model.tokenizer.apply_chat_template(CHAT)
    ids = torch.tensor([default_model.tokenizer.encode(prompt)])
    ref = hf_greedy(hf_default_model, ids, torch.ones_like(ids), 32, eos=2)
    for cache in ("static", "dynamic"):
        assert default_model.generate(ids, max_new_tokens=32, cache_implementation=cache).token_ids == ref


def test_default_model_batch_matches_one_by_one(default_model):
    prompts = ["The capital of France is", "Once upon a time, in a land far away, there lived", "2 + 2 ="]
    batched = default_model.generate(prompts, max_new_tokens=16)
    for i, p in enumerate(prompts):
        single = default_model.generate(p, max_new_tokens=16)
        assert batched.token_ids[i] == single.token_ids[0]
        assert batched.texts[i] == single.texts[0]


def test_sampling_with_seed_is_reproducible(default_model):
    kw = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    a = default_model.generate("Tell me a story about", **kw)
    b = default_model.generate("Tell me a story about", **kw)
    c = default_model.generate("Tell me a story about", **{**kw, "seed": 99})
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_equals_greedy(default_model):
    greedy = default_model.generate("The best thing about summer is", max_new_tokens=20)
    sampled = default_model.generate(
        "The best thing about summer is", max_new_tokens=20, do_sample=True, top_k=1, temperature=1.5, seed=3
    )
    assert sampled.token_ids == greedy.token_ids


def test_eos_stops_at_the_eos_token(default_model):
    prompt = default_model.tokenizer.apply_chat_template(CHAT)
    full = default_model.generate(prompt, max_new_tokens=64)
    assert full.finish_reasons == ["stop"] and full.token_ids[0][-1] == 2
    assert 2 not in full.token_ids[0][:-1]
    # A chosen EOS id ends generation right at its first occurrence.
    tokens = full.token_ids[0]
    chosen = tokens[3]
    cut = default_model.generate(prompt, max_new_tokens=64, eos_token_id=chosen)
    assert cut.token_ids[0] == tokens[: tokens.index(chosen) + 1]
    assert cut.finish_reasons == ["stop"]


def test_min_new_tokens_suppresses_eos(default_model):
    prompt = default_model.tokenizer.apply_chat_template(CHAT)
    natural = len(default_model.generate(prompt, max_new_tokens=64).token_ids[0])
    forced = default_model.generate(prompt, max_new_tokens=natural + 5, min_new_tokens=natural + 5)
    assert len(forced.token_ids[0]) == natural + 5
    assert 2 not in forced.token_ids[0]


def test_stop_string_stops_at_the_right_token(default_model):
    full = default_model.generate("The capital of France is", max_new_tokens=24)
    text = full.texts[0]
    stop = text.strip().split()[2]  # a word from the middle of the greedy continuation
    cut = default_model.generate("The capital of France is", max_new_tokens=24, stop=stop)
    assert cut.finish_reasons == ["stop"]
    assert cut.texts[0] == text[: text.index(stop)]
    ids = cut.token_ids[0]
    assert ids == full.token_ids[0][: len(ids)]
    assert stop in default_model.tokenizer.decode(ids)  # the last token completed the stop string
    assert stop not in default_model.tokenizer.decode(ids[:-1])


@pytest.mark.parametrize(
    "prompt", ["Emoji story: 🐱🐶🐭", "東京は日本の首都です。大阪は", "Write a haiku about the sea."]
)
def test_stream_deltas_concatenate_to_final_text(default_model, prompt):
    deltas = list(default_model.stream(prompt, max_new_tokens=24))
    result = default_model.generate(prompt, max_new_tokens=24)
    assert "".join(deltas) == result.texts[0]
    assert all("\ufffd" not in d for d in deltas[:-1])  # only a cut-off final character may be incomplete


def test_stream_holds_back_stop_string_prefixes(default_model):
    full = default_model.generate("The capital of France is", max_new_tokens=24).texts[0]
    stop = full.strip().split()[3]
    deltas = list(default_model.stream("The capital of France is", max_new_tokens=24, stop=[stop, "zzzz"]))
    assert "".join(deltas) == full[: full.index(stop)]


def test_stats_report_tokens_and_speed(default_model):
    r = default_model.generate(["Hello", "Hello there, friend"], max_new_tokens=8, min_new_tokens=8)
    s = r.stats
    assert s.new_tokens == 16 and s.batch_size == 2
    assert s.prompt_tokens == sum(
        len(default_model.tokenizer.encode(p)) for p in ["Hello", "Hello there, friend"]
    )
    assert s.prefill_seconds > 0 and s.decode_tokens_per_s > 0 and s.cache == "static"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_generation_values(default_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        default_model.generate("hi", **kwargs)


def test_empty_prompt_is_an_error(default_model):
    with pytest.raises(ValueError, match="empty prompt"):
        default_model.generate("")
    with pytest.raises(ValueError, match="empty prompt"):
        default_model.generate(["ok", ""])


@pytest.mark.parametrize(
    "prompt, says",
    [
        ([[1, 2.5]], "prompt 0 has 2.5 (float) where a token id (an int) goes"),
        ([["1", "2"]], "prompt 0 has '1' (str)"),
        ([[1], [True]], "prompt 1 has True (bool)"),
        ([1, 2, None], "prompt 0 has None (NoneType)"),
        (torch.empty(1, 0, dtype=torch.long), "empty prompt"),
        (torch.empty(0, dtype=torch.long), "empty prompt"),
    ],
)
def test_token_ids_that_are_not_ints_are_one_error(default_model, prompt, says):
    """int() would have truncated 2.5 or parsed "1" into some other prompt; an empty tensor was a reshape
    error from inside torch."""
    with pytest.raises(ValueError) as err:
        default_model.generate(prompt, max_new_tokens=2)
    assert says in str(err.value)


def test_a_flat_list_of_ids_is_one_prompt(default_model):
    ids = default_model.tokenizer.encode("The sea is")
    assert (
        default_model.generate(ids, max_new_tokens=4).token_ids
        == default_model.generate([ids], max_new_tokens=4).token_ids
    )


def test_a_static_cache_too_big_to_allocate_is_one_error_and_the_model_goes_on(default_model):
    """prompt + max_new_tokens may pass the context (as in transformers), but a cache that cannot be
    allocated is a ValueError naming max_new_tokens, not an OverflowError or an allocator's RuntimeError."""
    for huge in (10**30, 2**44):
        with pytest.raises(ValueError, match=f"max_new_tokens={huge}\\) cannot be allocated"):
            default_model.generate("Hi", max_new_tokens=huge)
    assert default_model.generate("Hi", max_new_tokens=2).token_ids[0]


def test_a_dynamic_cache_grows_the_rotary_tables_past_their_first_size(tiny_checkpoints):
    """A dynamic cache sizes nothing up front (max_new_tokens=10**30 runs until EOS, as in transformers): the
    eager step grows the rotary tables as the cache grows, so tokens past the first 4096-position table equal
    the static cache's (which sizes its tables once)."""
    m = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    prompt = [[1, 2, 3]]
    dynamic = m.generate(prompt, max_new_tokens=4400, min_new_tokens=4400, cache_implementation="dynamic")
    static = m.generate(prompt, max_new_tokens=4400, min_new_tokens=4400)
    assert len(dynamic.token_ids[0]) == 4400 and dynamic.token_ids == static.token_ids
    assert m.generate(
        prompt, max_new_tokens=10**30, cache_implementation="dynamic", eos_token_id=[0, 1, 2, 3]
    )


def test_prompt_longer_than_static_cache(default_model):
    with pytest.raises(ValueError, match="longer than the static cache"):
        default_model.generate("word " * 300, max_cache_len=64, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_cache_len"):
        default_model.generate("word " * 60, max_cache_len=64, max_new_tokens=10)


def test_a_generation_whose_cache_a_later_one_took_fails_clearly_and_the_later_one_is_right(default_model):
    """Generations of one shape share the model's reusable static cache. A stream resumed after a later
    generation took it is one ValueError (it went on from the other prompt's keys and values, silently),
    the later one gives its solo text, and a stream left unfinished does not stop the next generation."""
    m = default_model
    solo = {p: m.generate(p, max_new_tokens=10).texts[0] for p in ("The sea is", "Tell me a story")}
    first, second = m.stream("The sea is", max_new_tokens=10), m.stream("Tell me a story", max_new_tokens=10)
    next(second)
    first_head = next(first)  # takes the cache from `second`
    with pytest.raises(ValueError, match="taken by a later generation"):
        next(second)
    assert first_head + "".join(first) == solo["The sea is"]  # the later one is right to its end
    paused = m.start(["Tell me a story"], tierlm.GenerationConfig(max_new_tokens=10)).stream()
    next(paused)
    assert m.generate("The sea is", max_new_tokens=10).texts[0] == solo["The sea is"]
    with pytest.raises(ValueError, match="taken by a later generation"):
        list(paused)
    for i, _ in enumerate(m.stream("Tell me a story", max_new_tokens=10)):
        if i == 1:
            break  # left unfinished, never resumed
    assert m.generate("Tell me a story", max_new_tokens=10).texts[0] == solo["Tell me a story"]


@pytest.mark.parametrize(
    "prompt, settings, says",
    [
        ([[1, 49152]], {}, "prompt 0 has token id 49152; this model's ids are in [0, 49152)"),
        ([[1, -3]], {}, "prompt 0 has token id -3"),
        ("Hi", {"logprobs": 10**9}, "logprobs must be <= the vocabulary size 49152"),
        ("Hi", {"prompt_logprobs": 49153}, "prompt_logprobs must be <= the vocabulary size 49152"),
        ("Hi", {"logit_bias": {49152: 5.0}}, "logit_bias names token id 49152"),
    ],
)
def test_token_ids_and_counts_past_the_vocabulary_are_one_error(default_model, prompt, settings, says):
    """Checked before any work, not an IndexError from the embedding or a top-k out of range."""
    with pytest.raises(ValueError) as err:
        default_model.generate(prompt, max_new_tokens=2, **settings)
    assert says in str(err.value)
    assert default_model.generate("Hi", max_new_tokens=2).token_ids[0]  # still usable


def test_a_temperature_too_small_to_divide_by_decodes_greedily(default_model):
    """Logits / 1e-45 overflow to inf; the draw then picked token 0 every step. Below SAMPLING_EPS (as
    vLLM's) sampling is the argmax."""
    greedy = default_model.generate("The sea is", max_new_tokens=6).token_ids
    for t in (1e-45, 1e-300, 1e-6):
        tiny = default_model.generate("The sea is", max_new_tokens=6, do_sample=True, temperature=t, seed=0)
        assert tiny.token_ids == greedy


def test_stream_and_start_say_what_they_take(default_model):
    import torch

    m = default_model
    with pytest.raises(ValueError, match="for n > 1 use stream_batch"):
        list(m.stream("Once", max_new_tokens=3, n=2, do_sample=True, seed=1))
    with pytest.raises(ValueError, match="generation_config must be a GenerationConfig or None"):
        m.generate("Hi", {"max_new_tokens": 3})
    with pytest.raises(ValueError, match="generation_config must be a GenerationConfig or None"):
        m.start(["Hi"], {"max_new_tokens": 3})
    ids = m.tokenizer.encode("The sea is")
    text = m.generate("The sea is", max_new_tokens=4).texts[0]
    assert "".join(m.stream(torch.tensor(ids), max_new_tokens=4)) == text  # a 1-d id tensor is one prompt
