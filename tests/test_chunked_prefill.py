"""Chunked prefill: the same fp32 tokens as one whole-prompt forward, and a long prompt no longer stalls the
server's other requests (a short one is answered between two of its chunks)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import torch
from test_server import NAME, serve, tiny_dir  # noqa: F401 (tiny_dir is a fixture)

import tierlm
from tierlm.generation.config import GenerationConfig


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Left-padded batch rows whose lengths are not multiples of any chunk tried below.
PROMPTS = [random_ids(n, n) for n in (203, 77, 150)]
LONG = 4000  # tokens of the long prompt in the server tests (the served tiny model has a 4096 context)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_chunked_prefill_gives_the_unchunked_tokens(tiny_checkpoints, family, cache):
    model = tierlm.load(tiny_checkpoints[family], dtype="float32")
    config = GenerationConfig(max_new_tokens=24, cache_implementation=cache, eos_token_id=2)
    whole = model.generate(PROMPTS, config.replace(prefill_chunk=None)).token_ids
    assert whole == model.generate(PROMPTS, config.replace(prefill_chunk=0)).token_ids
    for chunk in (7, 64):
        assert model.generate(PROMPTS, config.replace(prefill_chunk=chunk)).token_ids == whole, chunk
        solo = [model.generate([p], config.replace(prefill_chunk=chunk)).token_ids[0] for p in PROMPTS]
        assert solo == whole, chunk


def test_prefill_is_one_unit_of_work_per_chunk(tiny_checkpoints):
    """advance() runs one chunk at a time: ceil(203 / 64) = 4 chunks, the last one with the first token."""
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    gen = model.start([PROMPTS[0]], GenerationConfig(max_new_tokens=2, prefill_chunk=64))
    with torch.inference_mode():
        units = list(gen.events())
    assert [len(u) for u in units] == [0, 0, 0, 1, 1]
    assert gen.prefilled


@pytest.mark.parametrize("value", [-1, 2.5, "256", True])
def test_bad_prefill_chunk_is_an_error(value):
    with pytest.raises(ValueError, match="prefill_chunk"):
        GenerationConfig(prefill_chunk=value)


@pytest.mark.slow
def test_default_model_chunked_prefill_gives_the_unchunked_tokens():
    model = tierlm.load(dtype="float32")
    text = "The history of the lighthouse keeper, told in many small chapters. " * 60
    ids = model.tokenizer.encode(text)[:700]
    config = GenerationConfig(max_new_tokens=16)
    whole = model.generate([ids], config.replace(prefill_chunk=0)).token_ids
    assert model.generate([ids], config.replace(prefill_chunk=256)).token_ids == whole


# --- the server: a short request is answered while a long prompt is prefilled -----------------------------


@contextmanager
def slow_prefill(model, seconds: float):
    """Every multi-token forward (a prefill chunk) takes `seconds` longer, so orderings are not races."""

    def pause(_module, args):
        if args[0].shape[1] > 1:
            time.sleep(seconds)

    handle = model.decoder.register_forward_pre_hook(pause)
    try:
        yield
    finally:
        handle.remove()


def stream_first_event_time(url: str, prompt: list[int], max_tokens: int, out: dict) -> None:
    """Stream a completion; record when its first event arrived and its whole text."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    texts = []
    with (
        httpx.Client(trust_env=False, timeout=120) as c,
        c.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.setdefault("first", time.monotonic())
                texts.append(json.loads(line.removeprefix("data: "))["choices"][0]["text"])
    out["text"] = "".join(texts)


def complete(url: str, prompt, max_tokens: int) -> str:
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, trust_env=False, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def served_model(tiny_dir):  # noqa: F811
    return tierlm.load(tiny_dir, dtype="float32")


def test_short_request_is_answered_before_a_long_prompts_first_token(served_model):
    long_prompt = random_ids(LONG, 1)
    with serve(served_model, max_batch_size=8) as live, slow_prefill(served_model, 0.2):
        long: dict = {}
        streamer = threading.Thread(target=stream_first_event_time, args=(live.url, long_prompt, 4, long))
        streamer.start()
        live.wait_for(lambda s: s["running"] == 1)
        short = complete(live.url, "Hello there", 1)
        answered = time.monotonic()
        streamer.join(120)
    assert "first" in long and answered < long["first"]  # ~16 chunks of 256 tokens, 0.2 s each
    expected = served_model.generate(
        [served_model.tokenizer.encode("Hello there")], GenerationConfig(max_new_tokens=1)
    ).texts[0]
    assert short == expected
    assert long["text"] == served_model.generate([long_prompt], GenerationConfig(max_new_tokens=4)).texts[0]


def test_batches_of_one_cache_shape_run_together_on_their_own_caches(served_model):
    """The static worker: two long prompts of the same length need static caches of the same shape: the
    second starts while the first still prefills, on a cache of its own, and both give their solo texts (one shared cache would
    mix their keys)."""
    prompts = [random_ids(LONG - 50, seed) for seed in (2, 3)]
    with serve(served_model, max_batch_size=1, batching="static") as live, slow_prefill(served_model, 0.1):
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(complete, live.url, prompts[0], 6)
            live.wait_for(lambda s: s["running"] == 1)
            second = pool.submit(complete, live.url, prompts[1], 6)
            live.wait_for(lambda s: s["running"] == 2)
            texts = [first.result(), second.result()]
    solo = served_model.generate(prompts, GenerationConfig(max_new_tokens=6)).texts
    assert texts == solo
