"""Beam search against transformers' generate(num_beams=k): the same sequences, in the same order, with the
same scores, over static and dynamic caches, left-padded batches, several ending tokens, min_new_tokens,
every early_stopping mode and length penalties of both signs; then Gemma 3's ring caches, offload, a
compiled layer body, the default model, the CLI and the errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import write_tiny_checkpoint
from test_gemma3 import write_gemma3
from test_generate import left_padded

import tierlm
from tierlm import CompileConfig
from tierlm.generation.config import GenerationConfig

PROMPTS = [[5, 17, 99, 230, 41, 7, 8], [300, 12, 45], [77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87]]
NEW = 12
# (num_beams, length_penalty, early_stopping, n returned, ending tokens, min_new_tokens)
SETTINGS = [
    (4, 1.0, False, 2, 2, 0),
    (2, 1.0, True, 2, 4, 0),
    (3, 0.0, False, 2, 8, 0),
    (2, 1.0, False, 2, 8, 0),  # the heuristic ends this search before a better late beam (on both families)
    (3, 0.5, True, 3, 3, 0),
    (2, 2.0, "never", 1, 2, 0),
    (4, -1.0, False, 4, 4, 3),
    (3, 1.0, "never", 3, 6, 0),
]


def hf_beams(hf, prompts, k, lp, early, n, ends, min_new, new=NEW):
    """transformers' n best beams per prompt (new tokens cut after the first ending token) and scores."""
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=min_new,
            do_sample=False,
            num_beams=k,
            length_penalty=lp,
            early_stopping=early,
            num_return_sequences=n,
            pad_token_id=0,
            eos_token_id=list(ends),
            output_scores=True,
            return_dict_in_generate=True,
        )
    rows = []
    for row in out.sequences[:, ids.shape[1] :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
        rows.append(row[:cut])
    return rows, out.sequences_scores.tolist()


def ending_tokens(model, count: int) -> list[int]:
    """Tokens the model's beams write early (so beams end mid-search, not only at max_new_tokens)."""
    free = model.generate([list(p) for p in PROMPTS], max_new_tokens=NEW, num_beams=4, n=4, ignore_eos=True)
    return sorted({t for row in free.token_ids for t in row[1:6]})[:count]


def assert_scores_close(ours, ref):
    """fp32 sums of 12 log probabilities by two implementations: 1e-5 of a score's size (a length
    penalty of -1 multiplies the sum by the length, so the bound scales with the score)."""
    for a, b in zip(ours, ref, strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)) * NEW, (ours, ref)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = {}
    for family in ("llama", "qwen3"):
        path = write_tiny_checkpoint(tmp_path_factory.mktemp("beam") / family, family)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[family] = (path, tierlm.load(path, dtype="float32"), hf)
    return out


@pytest.mark.parametrize("setting", SETTINGS, ids=[f"k{s[0]}-lp{s[1]}-es{s[2]}-n{s[3]}" for s in SETTINGS])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_beams_equal_transformers(tiny, family, setting):
    _path, model, hf = tiny[family]
    k, lp, early, n, count, min_new = setting
    ends = ending_tokens(model, count)
    ref, ref_scores = hf_beams(hf, PROMPTS, k, lp, early, n, ends, min_new)
    for cache in ("static", "dynamic"):
        got = model.generate(
            [list(p) for p in PROMPTS],
            max_new_tokens=NEW,
            min_new_tokens=min_new,
            num_beams=k,
            length_penalty=lp,
            early_stopping=early,
            n=n,
            eos_token_id=ends,
            cache_implementation=cache,
        )
        assert got.token_ids == ref, (cache, got.token_ids, ref)
        assert_scores_close(got.scores, ref_scores)
        assert got.finish_reasons == ["stop" if r[-1] in ends else "length" for r in ref]
        assert all(len(r) >= min_new for r in got.token_ids)


def test_the_settings_reach_every_way_a_search_ends(tiny):
    """The table above is not vacuous: beams end on ending tokens and at max_new_tokens, and some search
    stops before max_new_tokens, by the heuristic (early_stopping=False) and with early_stopping=True."""
    _path, model, hf = tiny["llama"]
    reasons, short = set(), set()
    for k, lp, early, n, count, min_new in SETTINGS:
        ends = ending_tokens(model, count)
        got = model.generate(
            [list(p) for p in PROMPTS], max_new_tokens=NEW, num_beams=k, length_penalty=lp,
            early_stopping=early, n=n, eos_token_id=ends, min_new_tokens=min_new,
        )  # fmt: skip
        reasons |= set(got.finish_reasons)
        if max(len(r) for r in got.token_ids) < NEW:
            short.add(early)
    assert reasons == {"stop", "length"} and short == {True, False}


def test_one_prompt_alone_equals_its_row_of_a_batch(tiny):
    """A prompt's beams do not depend on the prompts batched beside it (left padding, shared steps)."""
    _path, model, _hf = tiny["qwen3"]
    ends = ending_tokens(model, 3)
    kw = dict(max_new_tokens=NEW, num_beams=3, n=2, eos_token_id=ends)
    batch = model.generate([list(p) for p in PROMPTS], **kw)
    for i, p in enumerate(PROMPTS):
        alone = model.generate([list(p)], **kw)
        assert alone.token_ids == batch.token_ids[2 * i : 2 * i + 2]
        assert alone.scores == pytest.approx(batch.scores[2 * i : 2 * i + 2], abs=1e-5)


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_gemma3_ring_caches_reorder_with_their_beams(tmp_path, name):
    """Sliding-window layers keep a ring buffer per row; beams past 3x the window equal transformers'."""
    from transformers import AutoModelForCausalLM

    path = write_gemma3(tmp_path / name, name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = tierlm.load(path, dtype="float32")
    new = 3 * model.config.sliding_window
    ref, scores = hf_beams(hf, PROMPTS, 3, 1.0, False, 2, [2], 0, new=new)
    for cache in ("static", "dynamic"):
        got = model.generate(
            [list(p) for p in PROMPTS], max_new_tokens=new, num_beams=3, n=2, eos_token_id=2,
            cache_implementation=cache,
        )  # fmt: skip
        assert got.token_ids == ref, cache
        assert got.scores == pytest.approx(scores, abs=1e-4)


def test_offloaded_and_layer_compiled_beams_equal_resident(tiny, tmp_path, layer_bodies):
    """Layers on disk (streamed), then a compiled layer body: the resident model's beams, bit for bit in
    fp32, and the body compiles once."""
    path, model, _hf = tiny["llama"]
    ends = ending_tokens(model, 3)
    kw = dict(max_new_tokens=NEW, num_beams=4, n=3, eos_token_id=ends)
    resident = model.generate([list(p) for p in PROMPTS], **kw)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
    device_map |= {"model.norm": "cpu", "lm_head": "cpu"}
    offloaded = tierlm.load(path, dtype="float32", device_map=device_map, offload_folder=tmp_path)
    assert offloaded.generate([list(p) for p in PROMPTS], **kw).token_ids == resident.token_ids
    layer = model.generate([list(p) for p in PROMPTS], compile_config=CompileConfig(scope="layer"), **kw)
    assert layer.stats.compile.compile and len(layer_bodies) == 1
    assert layer.token_ids == resident.token_ids


@pytest.fixture(scope="module")
def default_fp32():
    return tierlm.load(dtype="float32")


def test_default_model_beams_equal_transformers(default_fp32, hf_default_model):
    """The real model (fp32, its dequantized GGUF weights) with its own EOS, a chat prompt."""
    model = default_fp32
    text = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True
    )
    prompt = model.tokenizer.encode(text, add_special_tokens=False)
    eos = list(model.tokenizer.eos_token_ids)
    ref, scores = hf_beams(hf_default_model, [prompt], 4, 1.0, False, 2, eos, 0, new=24)
    got = model.generate([prompt], max_new_tokens=24, num_beams=4, n=2)
    assert got.token_ids == ref
    assert got.scores == pytest.approx(scores, abs=1e-4)
    assert got.texts[0] == model.tokenizer.decode(ref[0][:-1] if ref[0][-1] in eos else ref[0])


def test_cli_prints_the_best_beam(default_fp32):
    prompt = "The capital of France is"
    best = default_fp32.generate(prompt, max_new_tokens=10, num_beams=3)
    greedy = default_fp32.generate(prompt, max_new_tokens=10)
    assert best.token_ids[0] != greedy.token_ids[0]  # the search is not greedy decoding here
    out = subprocess.run(
        [sys.executable, "-m", "tierlm.cli", "generate", "--dtype", "float32", "--num-beams", "3",
         "--max-new-tokens", "10", "--json", prompt],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert (answer["token_ids"], answer["text"]) == (best.token_ids[0], best.texts[0])
    plain = subprocess.run(
        [sys.executable, "-m", "tierlm.cli", "generate", "--dtype", "float32", "--num-beams", "3",
         "--max-new-tokens", "10", prompt],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plain.stdout == best.texts[0] + "\n"


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(n=4), "n (the beams returned) must be <= num_beams (3)"),
        (dict(do_sample=True), "num_beams > 1 (beam search) does not combine with do_sample: "),
        (dict(stop=["x"], logprobs=2), "num_beams > 1 (beam search) does not combine with logprobs, stop: "),
        (dict(early_stopping="sometimes"), "early_stopping must be True, False or 'never'"),
        (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
    ],
)
def test_settings_beam_search_refuses(overrides, words):
    with pytest.raises(ValueError, match="^" + re.escape(words)):
        GenerationConfig(num_beams=3, **overrides)


def test_a_streamed_beam_search_sends_its_beams_when_it_ends(default_fp32):
    prompt = "The capital of France is"
    best = default_fp32.generate(prompt, max_new_tokens=10, num_beams=3, n=2)
    updates = list(default_fp32.stream_batch(prompt, max_new_tokens=10, num_beams=3, n=2))
    assert updates == [(i, t, True, r) for i, (t, r) in enumerate(zip(best.texts, best.finish_reasons))]
    assert "".join(default_fp32.stream(prompt, max_new_tokens=10, num_beams=3)) == best.texts[0]


def test_beam_search_takes_one_config(tiny):
    _path, model, _hf = tiny["llama"]
    with pytest.raises(ValueError, match="no row_configs"):
        model.start([[5, 17]], GenerationConfig(num_beams=2), row_configs=[GenerationConfig()])
