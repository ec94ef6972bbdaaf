"""Rotary scaling read as transformers reads it: YaRN (Qwen2.5's and Qwen3's long-context setting) from
config.json and from a GGUF's keys, and the defaults transformers gives a scaling's missing fields."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_tiny_checkpoint
from gguf import GGUFWriter, RopeScalingType
from test_gguf_llama import to_gguf

import tierlm
from tierlm.config import ModelConfig
from tierlm.models.rotary import rope_inv_freq
from tierlm.weights import gguf_cache

# A context stretched 4x from 16 positions: the prompts below run well past the original context, where
# YaRN's interpolated frequencies and its attention scale both matter.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def hf_rope(config_dict: dict) -> tuple[torch.Tensor, float]:
    """transformers' own inverse frequencies and attention scale for a config.json."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.for_model(**config_dict)
    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu")


def tiny_config(family: str, rope_parameters: dict, **extra) -> dict:
    base = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[family]
    return {
        "model_type": family,
        "architectures": [base.replace("Config", "ForCausalLM")],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_theta": 10000.0, **rope_parameters},
        **extra,
    }


@pytest.mark.parametrize(
    "params",
    [
        YARN,
        {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {**YARN, "attention_factor": 0.9},
        {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},  # DeepSeek's form
        {"rope_type": "yarn", "factor": 8.0},  # the original context defaults to max_position_embeddings
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 128},  # factor: 512 / 128
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        {"rope_type": "linear", "factor": 2.0},
    ],
)
def test_rotary_frequencies_and_scale_equal_transformers(params):
    """Bit for bit: the frequencies and the attention scale transformers computes for the same config."""
    raw = tiny_config("llama", params)
    cfg = ModelConfig.from_hf_dict(json.loads(json.dumps(raw)))
    expected, scale = hf_rope(raw)
    ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(ours, expected)
    assert cfg.rope_scaling.attention_factor == pytest.approx(scale, rel=1e-12)


def test_a_top_level_original_context_wins_as_in_transformers():
    raw = tiny_config("llama", {"rope_type": "yarn", "factor": 4.0}, original_max_position_embeddings=32)
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.rope_scaling.original_max_position_embeddings == 32
    assert torch.equal(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), hf_rope(raw)[0])


@pytest.fixture(scope="module")
def yarn_folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("yarn")
    over = {"rope_scaling": YARN, "max_position_embeddings": 512}
    return {fam: write_tiny_checkpoint(root / fam, fam, over) for fam in ("llama", "qwen2")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_yarn_logits_and_decode_match_transformers(yarn_folders, family):
    """A 40-token prompt (2.5x the original context) and 24 greedy tokens after it through the static
    cache's decode step: transformers' logits and tokens. Without YaRN the logits are far off."""
    from transformers import AutoModelForCausalLM

    path = yarn_folders[family]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = tierlm.load(path, dtype="float32")
    assert model.config.rope_scaling.rope_type == "yarn"
    ids = torch.randint(3, 320, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(ids).logits
        tokens = hf.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, 40:]
    torch.testing.assert_close(model(ids), expected, atol=1e-4, rtol=1e-4)
    assert model.generate(ids, max_new_tokens=24, min_new_tokens=24).token_ids[0] == tokens.tolist()
    plain = json.loads((path / "config.json").read_text())
    plain.pop("rope_scaling", None), plain.pop("rope_parameters", None)
    unscaled = ModelConfig.from_hf_dict(plain)
    assert unscaled.rope_scaling.rope_type == "default"
    model.decoder.config = unscaled
    model.decoder.rope_cos = None
    model.decoder.ensure_rope(64, "cpu")
    assert (model(ids) - expected).abs().max() > 1e-2  # the scaling matters on this model: the test can fail


def test_a_gguf_with_yarn_keys_gives_transformers_logits_for_its_folder(yarn_folders, tmp_path):
    """llama.cpp's converter writes YaRN as rope.scaling.{type, factor, original_context_length}; llama.cpp
    scales cos and sin as transformers does (1 + 0.1 ln factor)."""
    from transformers import AutoModelForCausalLM

    folder = yarn_folders["llama"]

    def keys(writer: GGUFWriter) -> None:
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(16)

    gguf = to_gguf(folder, tmp_path / "yarn.gguf", rope_freqs=False, metadata=keys)
    ids = torch.randint(3, 320, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
    model = tierlm.load(gguf, dtype="float32")
    assert model.config.rope_scaling == ModelConfig.from_hf_json(folder / "config.json").rope_scaling
    torch.testing.assert_close(model(ids), expected, atol=1e-4, rtol=1e-4)
    # A cached config of the format before YaRN keys were read (it dropped them) is written again.
    meta = gguf_cache.cache_dir(gguf) / "config.json"
    old = json.loads(meta.read_text())
    old.update(tierlm_config_format=2, rope_scaling={"rope_type": "default"})
    meta.write_text(json.dumps(old))
    assert gguf_cache.open_cached(gguf, torch.float32) is None
    assert tierlm.load(gguf, dtype="float32").config.rope_scaling.rope_type == "yarn"


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("rope.scaling.type", "longrope", "unsupported rope scaling type 'longrope'"),
        ("rope.scaling.yarn_log_multiplier", 0.1, "llama.rope.scaling.yarn_log_multiplier"),
    ],
)
def test_gguf_rope_scaling_tierlm_does_not_apply_is_an_error_naming_it(key, value, named):
    """It was ignored: a file with YaRN or another scaling decoded with plain rotary, silently wrong."""
    meta = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.feed_forward_length": 128,
        "llama.vocab_size": 320,
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 4.0,
        f"llama.{key}": value,
    }
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_gguf_metadata(meta)


def test_unsupported_rope_types_are_named():
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'"):
        ModelConfig.from_hf_dict(tiny_config("llama", {"rope_type": "dynamic", "factor": 2.0}))


def test_a_gguf_whose_rotary_covers_part_of_the_head_is_an_error():
    """It loaded with full rotary (rope.dimension_count was read only where attention.key_length was absent,
    and then as the head size: a misleading shape error). llama.cpp refuses such a Llama file too."""
    meta = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.embedding_length": 256,
        "llama.attention.head_count": 4,
        "llama.feed_forward_length": 128,
        "llama.vocab_size": 320,
        "llama.context_length": 256,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.dimension_count": 32,
    }
    with pytest.raises(ValueError, match="rope.dimension_count 32 rotates part of a 64-wide head"):
        ModelConfig.from_gguf_metadata(meta)
    with pytest.raises(ValueError, match="rope.dimension_count 32 rotates part of a 64-wide head"):
        ModelConfig.from_gguf_metadata({**meta, "llama.attention.key_length": 64})
    assert ModelConfig.from_gguf_metadata({**meta, "llama.rope.dimension_count": 64}).head_dim == 64
