"""Gemma 3 (text) against transformers on tiny random checkpoints: logits, greedy tokens, the sliding cache.

Two configs saved by transformers' save_pretrained: 6 layers with explicit `layer_types` mixing sliding and
full layers, a window of 4, linear rope scaling on the full layers, query_pre_attn_scalar unlike head_dim,
final-logit softcapping and an untied head; and 7 layers with the default every-sixth-layer rule, a
window of 6 and a tied head. Prompts run shorter and longer than the window.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import COMMON
from torch._dynamo.utils import counters

import tierlm
from tierlm import CompileConfig
from tierlm.cache import RingLayerView, StaticCache
from tierlm.config import FULL, SLIDING
from tierlm.placement.placer import kv_bytes_per_token

GEMMA3 = {**COMMON, "head_dim": 16}  # the other families' tiny shape; each config sets its layer count
CONFIGS = {
    "untied": dict(
        num_hidden_layers=6,
        sliding_window=4,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL, SLIDING],
        tie_word_embeddings=False,
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        rope_parameters={
            FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "tied": dict(num_hidden_layers=7, sliding_window=6, tie_word_embeddings=True, query_pre_attn_scalar=16),
}


def write_gemma3(folder, name: str, **shape):
    import transformers

    config = transformers.Gemma3TextConfig(**{**GEMMA3, **CONFIGS[name], **shape})
    torch.manual_seed(len(name))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # Gemma's norms start at zero (a scale of 1); make them matter
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    return {name: write_gemma3(root / name, name) for name in CONFIGS}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in checkpoints.items()
    }


@pytest.fixture(scope="module")
def models(checkpoints):
    return {name: tierlm.load(path, dtype="float32") for name, path in checkpoints.items()}


def _prompts(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of `lengths`, left-padded with 0 into one batch, and their mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, 320, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


def test_config_reads_layer_kinds(models):
    cfg = models["untied"].config
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.sliding_layers == (0, 1, 3, 5)
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (4, 100000.0, 10000.0)
    assert cfg.rope_scaling.rope_type == "linear" and cfg.final_logit_softcapping == 30.0
    tied = models["tied"].config
    assert tied.sliding_layers == (0, 1, 2, 3, 4, 6) and tied.tie_word_embeddings  # every sixth is full


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("lengths", [[3], [3, 2], [13], [13, 5, 9]], ids=str)
def test_logits_match_transformers(models, hf_models, name, lengths):
    """Shorter and longer than the window, batched with left padding: every real position within 1e-4."""
    ids, mask = _prompts(lengths)
    with torch.no_grad():
        ref = hf_models[name](ids, attention_mask=mask).logits
    got = models[name](ids, mask)
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_greedy_tokens_match_transformers(models, hf_models, name, cache):
    """Left-padded batch, prompts around the window, decoding to 3x the window past it."""
    ids, mask = _prompts([5, 11, 2], seed=1)
    window = models[name].config.sliding_window
    new = 3 * window
    with torch.no_grad():
        out = hf_models[name].generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, min_new_tokens=new
        )
    expected = out[:, ids.shape[1] :].tolist()
    rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
    got = models[name].generate(rows, max_new_tokens=new, do_sample=False, cache_implementation=cache)
    assert got.token_ids == [e[: len(g)] for e, g in zip(expected, got.token_ids)]
    assert all(len(g) == new or g[-1] == 2 for g in got.token_ids)


def test_chunked_prefill_across_the_window(models):
    """Chunks shorter than, equal to and longer than the window give the tokens of a single prefill."""
    model = models["untied"]
    rows = [r[m.bool()].tolist() for r, m in zip(*_prompts([17, 9], seed=2))]
    whole = model.generate(rows, max_new_tokens=8, do_sample=False).token_ids
    for chunk in (1, 3, 4, 6):
        assert model.generate(rows, max_new_tokens=8, do_sample=False, prefill_chunk=chunk).token_ids == whole


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_n_samples_of_a_prompt_longer_than_the_window(models, cache):
    """n > 1 shares one prefill per prompt on a static cache, copied slot by slot, which a sliding layer's
    ring cannot take (an AttributeError before): every row is prefilled there. Greedy samples equal the
    prompt's solo tokens; seeded samples equal those of the other cache."""
    model = models["untied"]
    rows = [r[m.bool()].tolist() for r, m in zip(*_prompts([13, 3], seed=4))]
    new = 2 * model.config.sliding_window
    solo = model.generate(rows, max_new_tokens=new, cache_implementation=cache).token_ids
    greedy = model.generate(rows, max_new_tokens=new, n=2, cache_implementation=cache).token_ids
    assert greedy == [solo[0], solo[0], solo[1], solo[1]]
    sampled = {
        kind: model.generate(
            rows, max_new_tokens=new, n=3, do_sample=True, seed=7, cache_implementation=kind
        ).token_ids
        for kind in ("static", "dynamic")
    }
    assert sampled["static"] == sampled["dynamic"]


def test_sliding_cache_holds_only_the_window(models):
    """Sliding layers get a ring of `window` slots, full layers the whole length; shapes never change, and
    decoding 3x the window past a longer prompt gives the tokens of the non-sliding (dynamic) cache."""
    model = models["untied"]
    cfg = model.config
    cache = StaticCache(cfg, 2, 64, torch.float32, "cpu")
    shapes = [tuple(k.shape) for k in cache.keys]
    for i in range(cfg.num_layers):
        length = cfg.sliding_window if cfg.is_sliding(i) else 64
        assert shapes[i] == (2, cfg.num_kv_heads, length, cfg.head_dim)
        assert isinstance(cache.views[i], RingLayerView) == cfg.is_sliding(i)
    rows = [r[m.bool()].tolist() for r, m in zip(*_prompts([10, 7], seed=3))]
    new = 3 * cfg.sliding_window
    static = model.generate(rows, max_new_tokens=new, do_sample=False, max_cache_len=64)
    (used,) = [c for c in model._static_caches.values() if c.batch == 2 and c.max_len == 64]
    assert [tuple(k.shape) for k in used.keys] == shapes  # the generation never grew them
    assert [tuple(v.shape) for v in used.values] == shapes
    dynamic = model.generate(rows, max_new_tokens=new, do_sample=False, cache_implementation="dynamic")
    assert static.token_ids == dynamic.token_ids


def test_kv_bytes_reflect_the_window(models):
    """Per token over a long cache, sliding layers cost their window only; over a short one, everything."""
    cfg = models["untied"].config
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert cfg.kv_slots(4096) == 2 * 4096 + 4 * 4  # 2 full layers, 4 sliding ones of window 4
    assert kv_bytes_per_token(cfg, torch.float32, 4096) * 4096 == per_layer * cfg.kv_slots(4096)
    assert kv_bytes_per_token(cfg, torch.float32, 2) == per_layer * cfg.num_layers


HALF_ON_DISK = {"": "cpu", **{f"model.layers.{i}": "disk" for i in (3, 4, 5)}, "model.norm": "disk"}


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_half_the_layers_on_disk_give_the_same_tokens(checkpoints, models, cache, tmp_path):
    """Half the layers (sliding and full ones) on disk: the resident model's tokens; the compile decision
    explains what streams and does not compile the whole step."""
    rows = [r[m.bool()].tolist() for r, m in zip(*_prompts([9, 4], seed=4))]
    new = 12
    resident = models["untied"].generate(
        rows, max_new_tokens=new, do_sample=False, cache_implementation=cache
    )
    model = tierlm.load(
        checkpoints["untied"], dtype="float32", device_map=HALF_ON_DISK, offload_folder=tmp_path
    )
    assert model.placement.offloaded["disk"] == [
        "model.layers.3",
        "model.layers.4",
        "model.layers.5",
        "model.norm",
    ]
    got = model.generate(
        rows, max_new_tokens=new, do_sample=False, cache_implementation=cache, compile_config=CompileConfig()
    )
    assert got.token_ids == resident.token_ids
    explained = got.stats.compile.explain()  # the whole step never compiles while weights stream
    assert "compile: yes" not in explained
    assert (
        "model.layers.3-5, model.norm" if cache == "static" else "'dynamic' is not compilable"
    ) in explained


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["model", "layer"])
def test_resident_model_compiles_with_the_ring_cache(models, scope, layer_bodies):
    """The compile decision compiles the resident model (a ring buffer is a static cache), and the compiled
    step decodes 3x the window with the eager tokens; layer scope runs two bodies (ring and full views),
    each called directly once compiled (tierlm.steps.LayerBody)."""
    model = models["tied"]
    rows = [r[m.bool()].tolist() for r, m in zip(*_prompts([8, 3], seed=5))]
    new = 3 * model.config.sliding_window
    eager = model.generate(rows, max_new_tokens=new, do_sample=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = model.generate(
        rows, max_new_tokens=new, do_sample=False, compile_config=CompileConfig(scope=scope)
    )
    assert compiled.stats.compile.compile
    assert compiled.token_ids == eager.token_ids
    assert counters["stats"]["unique_graphs"] == (2 if scope == "layer" else 1)
    if scope == "layer":  # sliding and full layers: a graph each, every layer calling its own directly
        (body,) = [ref() for ref in layer_bodies]
        assert len(body.graphs) == 2 and all(body.graphs) and all(body.direct.values())


def test_plan_shows_the_window_in_kv_bytes(checkpoints):
    from tierlm.plan import describe_plan

    text = describe_plan(checkpoints["untied"], dtype="float32")
    # 6 layers x 2 x 2 kv heads x 16 x 4 bytes = 1536 B a token; over 4096 tokens the 2 full layers hold
    # them all, the 4 sliding ones 4 each: 512 B x (2 x 4096 + 4 x 4) = 2.1 MB
    assert "kv cache per sequence: 1.5 KB per token, 2.1 MB per 4k tokens" in text
    assert "(sliding layers keep 4 tokens)" in text


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_gemma_equals_float_with_dequantized_weights(checkpoints, mode):
    """int8/int4 weights (bf16 activations) against the fp32 model holding the same dequantized weights,
    over prompts longer than the window: only bf16 activation rounding differs."""
    import torch.nn.functional as F

    from tierlm.quant import Int4Linear, Int8Linear

    quantized = tierlm.load(
        checkpoints["untied"], dtype="bfloat16", quantize=mode, group_size=32 if mode == "int4" else None
    )
    reference = tierlm.load(checkpoints["untied"], dtype="float32")
    names = [n for n, m in quantized.decoder.named_modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert len(names) == 7 * 6 + 1  # q, k, v, o, gate, up, down per layer and the LM head
    with torch.no_grad():
        for name in names:
            reference.decoder.get_submodule(name).weight.copy_(
                quantized.decoder.get_submodule(name).dequantize()
            )
    ids, mask = _prompts([13, 9], seed=6)
    real = mask.bool()
    cosine = F.cosine_similarity(quantized(ids, mask).float()[real], reference(ids, mask)[real], dim=-1)
    assert cosine.min().item() > 0.999, cosine


def test_a_tokenizer_cached_by_an_older_tierlm_is_rebuilt(default_model_path):
    """Tokenizers cached before Gemma's vocabulary and template existed must not be trusted."""
    import json

    from tierlm.tokenizer import Tokenizer
    from tierlm.weights import gguf_cache

    gguf_cache.store_tokenizer(default_model_path, Tokenizer.from_gguf(default_model_path))
    assert gguf_cache.open_cached_tokenizer(default_model_path) is not None
    meta_file = gguf_cache.cache_dir(default_model_path) / "tokenizer-meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["format"]  # what an older tierlm wrote
    meta_file.write_text(json.dumps(meta))
    assert gguf_cache.open_cached_tokenizer(default_model_path) is None


def run_continuous(model, joins, new: int, rows: int = 4, chunk: int | None = 256, compile_config=None):
    """Greedy (token, log probability) pairs per (key, choice) from an eager continuous batch (SlotBatch) that the sequences of
    `joins` enter in groups: a group joins once the batch has no prefill waiting, so groups prefill together
    (left-padded into a scratch cache) and decode beside rows already past the window."""
    from tierlm.generation.config import GenerationConfig
    from tierlm.generation.continuous import Sequence, SlotBatch

    config = GenerationConfig(
        max_new_tokens=new, min_new_tokens=new, prefill_chunk=chunk, logprobs=0, compile_config=compile_config
    )
    batch = SlotBatch(model, rows, config, prefill_together=True)  # the padded prefill is under test too
    tokens: dict[tuple, list[tuple[int, float]]] = {}
    pending = list(joins)
    while pending or batch.busy:
        if pending and not batch.waiting:
            for key, prompt, n in pending.pop(0):
                batch.join(Sequence(key, prompt, config.replace(n=n)))
        for u in batch.advance():
            if u.token is not None:
                tokens.setdefault((u.key, u.choice), []).append((u.token, u.logprob.logprob))
    assert batch.decision.compile == (compile_config is not None)
    assert not batch.cache.rings  # sliding layers as long as the full ones
    return tokens, batch.stats


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny checkpoints with the served tokenizer (a 320-token BPE): what a continuous batch needs."""
    from test_server import write_tokenizer

    root = tmp_path_factory.mktemp("gemma3-served")
    out = {}
    for name in CONFIGS:
        write_tokenizer(write_gemma3(root / name, name))
        out[name] = tierlm.load(root / name, dtype="float32")
    return out


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("chunk", [256, 3])
def test_continuous_rows_get_their_solo_tokens_across_the_window(served, name, chunk):
    """Continuous batching of a sliding-window model: rows at positions of their own keep every layer's keys
    (no ring) and cut a sliding layer's window by each row's own position. Each row's greedy tokens equal its
    solo run's (ring caches) and their log probabilities within fp32 rounding, for prompts shorter and longer than the window, prefilled alone, together,
    or in chunks, an n=2 request, rows joining mid-run, and 3x the window of new tokens."""
    model = served[name]
    w = model.config.sliding_window
    lengths = [2 * w + 3, 2, w, w + 1, 3 * w]
    prompts = [r[m.bool()].tolist() for r, m in zip(*_prompts(lengths, seed=5))]
    joins = [[(0, prompts[0], 1)], [(1, prompts[1], 2), (2, prompts[2], 1)], [(3, prompts[3], 1)]]
    joins += [[(4, prompts[4], 1)]]
    new = 3 * w
    got, stats = run_continuous(model, joins, new, rows=6, chunk=chunk)
    for key, prompt in enumerate(prompts):
        solo = model.generate(
            [prompt], max_new_tokens=new, min_new_tokens=new, prefill_chunk=chunk, logprobs=0
        )
        for choice in range(2 if key == 1 else 1):
            tokens, logprobs = zip(*got[(key, choice)])
            assert list(tokens) == solo.token_ids[0], (key, choice)
            # the same keys summed in another order (column order, not the ring's): fp32 rounding only
            assert logprobs == pytest.approx([t.logprob for t in solo.logprobs[0]], abs=1e-5)
    assert stats["joined_running_batch"] >= 2 and stats["decode_steps"] > new
    if chunk == 256:
        assert stats["prefills_together"] >= 2


@pytest.mark.parametrize(("name", "scope"), [("untied", "layer"), ("tied", "model")])
def test_compiled_continuous_rows_get_their_solo_tokens(served, name, scope):
    """The same through compiled steps: a layer body, and a frozen whole step, whose sliding windows read
    the rows' slots as an input (marked static, a frozen step folded the first step's windows into a
    constant: every row but the first went wrong)."""
    model = served[name]
    w = model.config.sliding_window
    prompts = [r[m.bool()].tolist() for r, m in zip(*_prompts([2 * w + 3, 2, w + 1], seed=5))]
    joins = [[(0, prompts[0], 1)], [(1, prompts[1], 2)], [(2, prompts[2], 1)]]
    got, _ = run_continuous(model, joins, 3 * w, rows=4, compile_config=CompileConfig(scope=scope))
    for key, prompt in enumerate(prompts):
        solo = model.generate([prompt], max_new_tokens=3 * w, min_new_tokens=3 * w, logprobs=0)
        for choice in range(2 if key == 1 else 1):
            tokens, logprobs = zip(*got[(key, choice)])
            assert list(tokens) == solo.token_ids[0], (key, choice)
            assert logprobs == pytest.approx([t.logprob for t in solo.logprobs[0]], abs=1e-4)


def test_a_sliding_window_model_is_served_with_continuous_batching(served):
    """`tierlm serve` batches a Gemma 3 model continuously (it served it statically before): concurrent greedy
    requests each get their solo run's text, through eager steps and through compiled ones."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_server import NAME, serve

    model = served["untied"]
    w = model.config.sliding_window
    prompts = [r[m.bool()].tolist() for r, m in zip(*_prompts([3 * w, 2, w + 1], seed=9))]
    solo = [model.generate([p], max_new_tokens=3 * w, min_new_tokens=3 * w).texts[0] for p in prompts]
    with serve(model, max_batch_size=4) as live:
        body = {"model": NAME, "max_tokens": 3 * w, "min_tokens": 3 * w, "temperature": 0}

        def complete(prompt):
            with httpx.Client(base_url=live.url, trust_env=False, timeout=120) as c:
                return c.post("/v1/completions", json={**body, "prompt": prompt}).json()["choices"][0]["text"]

        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(complete, prompts)) == solo
        assert live.stats()["batching"] == "continuous"
    config = tierlm.GenerationConfig(compile_config=CompileConfig(scope="layer"))
    with serve(model, max_batch_size=4, generation_config=config) as live:
        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(complete, prompts)) == solo
        assert live.stats()["batching"] == "continuous"
