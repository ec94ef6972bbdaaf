"""Logits parity with transformers, on tiny random checkpoints of every family and on the default model."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, write_tiny_checkpoint

import tierlm


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    ids = torch.randint(3, 320, (2, 17), generator=torch.Generator().manual_seed(0))
    ours = tierlm.load(path, dtype="float32")(ids)
    with torch.no_grad():
        ref = hf_model(path)(ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_left_padded_batch_matches_transformers(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    gen = torch.Generator().manual_seed(1)
    long, short = torch.randint(3, 320, (12,), generator=gen), torch.randint(3, 320, (5,), generator=gen)
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    ids[0], mask[0] = long, 1
    ids[1, 7:], mask[1, 7:] = short, 1
    ours = tierlm.load(path, dtype="float32")(ids, attention_mask=mask)
    with torch.no_grad():
        ref = hf_model(path)(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], atol=1e-4, rtol=1e-4)
    # The short prompt alone, unpadded, gives the same logits as its padded row.
    alone = tierlm.load(path, dtype="float32")(short[None])
    torch.testing.assert_close(ours[1, 7:], alone[0], atol=1e-4, rtol=1e-4)


def test_config_reads_family_traits(tiny_checkpoints):
    from tierlm.config import ModelConfig

    llama = ModelConfig.from_hf_json(tiny_checkpoints["llama"] / "config.json")
    assert llama.rope_scaling.rope_type == "llama3" and llama.rope_scaling.factor == 8.0
    assert llama.rope_theta == 500000.0 and not llama.tie_word_embeddings
    assert ModelConfig.from_hf_json(tiny_checkpoints["qwen2"] / "config.json").qkv_bias
    qwen3 = ModelConfig.from_hf_json(tiny_checkpoints["qwen3"] / "config.json")
    assert qwen3.family.qk_norm and qwen3.head_dim == 32 and qwen3.tie_word_embeddings


def test_sharded_checkpoint_loads_to_same_logits(tiny_checkpoints, tmp_path):
    sharded = write_tiny_checkpoint(tmp_path / "sharded", "llama", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    ids = torch.randint(3, 320, (1, 9))
    single = tierlm.load(tiny_checkpoints["llama"], dtype="float32")(ids)
    torch.testing.assert_close(tierlm.load(sharded, dtype="float32")(ids), single, atol=0, rtol=0)


def test_default_model_logits_match_transformers(default_model_path, hf_default_model):
    ids = torch.randint(0, 49152, (1, 30), generator=torch.Generator().manual_seed(2))
    ours = tierlm.load(default_model_path, dtype="float32")(ids)
    with torch.no_grad():
        ref = hf_default_model(ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_default_model_is_the_embedded_gguf(default_model_path):
    model = tierlm.load(dtype="float32")
    assert model.path == default_model_path
    assert model.config.num_layers == 30 and model.config.tie_word_embeddings
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 49152)


def test_gguf_cache_gives_identical_weights(default_model_path):
    first = tierlm.load(default_model_path, dtype="float32")  # fills or reads the cache
    second = tierlm.load(default_model_path, dtype="float32")
    for (name, a), (_, b) in zip(first.decoder.named_parameters(), second.decoder.named_parameters()):
        assert torch.equal(a, b), name


WINDOWED = {  # sliding-window attention outside Gemma 3, as transformers' configs spell it
    "mistral": {"sliding_window": 6},
    "qwen2": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},  # layer 1 slides
    "qwen3": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0},
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("windowed")
    return {fam: write_tiny_checkpoint(root / fam, fam, over) for fam, over in WINDOWED.items()}


@pytest.mark.parametrize("family", list(WINDOWED))
def test_sliding_window_of_mistral_and_qwen_matches_transformers(windowed, family):
    """Their window was dropped when config.json was read: every position past it was wrong (logits off by
    up to 10 on these models, the first greedy token different). Left-padded prompts around the window,
    chunked prefill, both caches, decoding 3x the window past it, n = 2: transformers' tokens."""
    path = windowed[family]
    model, hf = tierlm.load(path, dtype="float32"), hf_model(path)
    slides = [model.config.is_sliding(i) for i in range(model.config.num_layers)]
    assert model.config.sliding_window == 6 and slides == (
        [False, True] if family == "qwen2" else [True, True]
    )
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 320, (2, 15), generator=gen)
    mask = torch.ones(2, 15, dtype=torch.long)
    mask[1, :9] = 0
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
        expected = hf.generate(
            ids, attention_mask=mask, max_new_tokens=18, min_new_tokens=18, do_sample=False
        )
    real = mask.bool()
    torch.testing.assert_close(model(ids, attention_mask=mask)[real], ref[real], atol=1e-4, rtol=1e-4)
    rows = [r[m].tolist() for r, m in zip(ids, real)]
    want = expected[:, 15:].tolist()
    for settings in ({}, {"cache_implementation": "dynamic"}, {"prefill_chunk": 4}):
        got = model.generate(rows, max_new_tokens=18, min_new_tokens=18, **settings).token_ids
        assert got == want, settings
    paired = model.generate(rows, max_new_tokens=18, min_new_tokens=18, n=2).token_ids
    assert paired == [want[0], want[0], want[1], want[1]]


def test_window_keys_as_transformers_defaults_them(tmp_path):
    """MistralConfig's window is 4096 when config.json has no key and none when it is null; Qwen's applies
    only with use_sliding_window; Llama has none."""
    import json

    from tierlm.config import ModelConfig

    raw = json.loads((write_tiny_checkpoint(tmp_path / "m", "mistral") / "config.json").read_text())
    raw = {**raw, "max_position_embeddings": 32768}
    raw.pop("sliding_window")
    assert ModelConfig.from_hf_dict(raw).sliding_window == 4096
    assert ModelConfig.from_hf_dict({**raw, "sliding_window": None}).layer_types == ()
    qwen = json.loads((write_tiny_checkpoint(tmp_path / "q", "qwen2") / "config.json").read_text())
    assert (
        ModelConfig.from_hf_dict({**qwen, "sliding_window": 6, "use_sliding_window": False}).layer_types == ()
    )
    with pytest.raises(ValueError, match='"sliding_window" must be a positive integer'):
        ModelConfig.from_hf_dict({**raw, "sliding_window": 0})
    whole = {**raw, "sliding_window": 512, "max_position_embeddings": 512}  # as Ministral's 32768 of 32768
    assert ModelConfig.from_hf_dict(whole).layer_types == ()  # masks nothing in the context: full layers
