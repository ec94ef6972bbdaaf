"""Llama GGUFs as llama.cpp's converter writes them, from a tiny HF folder: a Llama 3.x model's rotary
scaling as a `rope_freqs` tensor (one factor per frequency, no scaling key; it was dropped, so such a file
gave silently wrong tokens), and GGUF files named otherwise than *.gguf."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

import tierlm
from tierlm.weights import gguf_cache

LLAMA_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (its converter permutes HF's rotate-half halves into pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_factors(cfg: dict, head_dim: int) -> np.ndarray:
    """One factor per rotary frequency, from config.json's llama3 scaling: 1 for short wavelengths, the
    factor for long ones, a smooth blend between (what llama.cpp's converter computes)."""
    rope = cfg.get("rope_parameters") or cfg["rope_scaling"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < old / high:
            out.append(1.0)
        elif wavelength > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


RANDOM_BLOCKS = ("IQ4_NL", "MXFP4")  # 32-wide blocks, which the tiny model's rows hold
RANDOM_K_BLOCKS = ("Q4_K", "Q6_K")  # 256-wide: for models whose rows are multiples of 256


def _halves(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(shape: tuple[int, int], kind: str, seed: int | None = None) -> np.ndarray:
    """Random bytes as blocks of `kind`, their fp16 scales set so the weights are finite with std ~0.05
    (random ones would be inf or NaN): IQ4_NL's d leads each block, MXFP4's e8m0 exponent byte does
    (2 ** (e - 128)); Q4_0's d, Q4_1's and Q4_K's d and m / dmin lead theirs; Q6_K's d ends its."""
    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(abs(hash(shape)) % 2**32 if seed is None else seed)
    raw = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    n = len(blocks)
    if kind == "MXFP4":
        blocks[:, 0] = 122  # 2 ** -6 times e2m1 values up to 6
    elif kind == "Q4_K":  # d * sc (6 bits) * q (4 bits) - dmin * m (6 bits)
        blocks[:, 0:2] = _halves(rng.uniform(2e-4, 6e-4, n))
        blocks[:, 2:4] = _halves(rng.uniform(5e-4, 2e-3, n))
    elif kind == "Q6_K":  # d * scale (int8) * (q - 32)
        blocks[:, size - 2 :] = _halves(rng.uniform(1e-5, 3e-5, n))
    elif kind in ("Q4_1", "Q5_1"):  # d * q + m
        blocks[:, 0:2] = _halves(rng.uniform(0.005, 0.02, n))
        blocks[:, 2:4] = _halves(rng.uniform(-0.15, -0.05, n))
    else:
        blocks[:, :2] = np.full(n, 0.005, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def to_gguf(
    folder,
    path,
    rope_freqs: bool = True,
    metadata=None,
    projections: str | None = None,
    tokenizer: bool = True,
    kinds: dict[str, str] | None = None,
):
    """The folder as llama.cpp's converter writes it; `metadata(writer)` adds keys of a test's own;
    `projections`: a GGML type name (e.g. "Q4_0") the projection weights are quantized to, as llama-quantize
    does (by gguf-py's reference quantizer); `kinds`: {module suffix (e.g. "mlp.down_proj"): type name} for
    those projections instead (a mix, as llama.cpp's Q4_K_M is)."""
    cfg = json.loads((folder / "config.json").read_text())
    heads, kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = hidden // heads
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(head_dim)
    vocab = cfg["vocab_size"]
    writer.add_vocab_size(vocab)
    if tokenizer:
        writer.add_tokenizer_model("llama")  # a stand-in vocabulary: these tests feed token ids
        writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab)])
        writer.add_token_scores([0.0] * vocab)
        writer.add_token_types([2, 3, 3] + [1] * (vocab - 3))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    if metadata is not None:
        metadata(writer)
    for name, w in load_file(folder / "model.safetensors").items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            parts = name.split(".")
            module = ".".join(parts[3:-1])
            gguf_name = f"blk.{parts[2]}.{LLAMA_NAMES[module]}.{parts[-1]}"
            if module == "self_attn.q_proj":
                w = interleave(w, heads)
            elif module == "self_attn.k_proj":
                w = interleave(w, kv)
        chosen = next((k for m, k in (kinds or {}).items() if name.endswith(f"{m}.weight")), projections)
        if chosen in RANDOM_BLOCKS + RANDOM_K_BLOCKS and "proj" in name:  # no reference quantizer used
            kind = GGMLQuantizationType[chosen]
            writer.add_tensor(gguf_name, random_blocks(tuple(w.shape), chosen), raw_dtype=kind)
        elif chosen is not None and "proj" in name:
            kind = GGMLQuantizationType[chosen]
            writer.add_tensor(gguf_name, quantize(w.float().numpy(), kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, w.float().numpy())
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", llama3_factors(cfg, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def llama3(tiny_checkpoints, tmp_path_factory):
    """The tiny Llama (llama3 rotary scaling, factor 8) as an HF folder and as a GGUF with rope_freqs."""
    folder = tiny_checkpoints["llama"]
    assert json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    return folder, to_gguf(folder, tmp_path_factory.mktemp("gguf") / "llama3.gguf")


def test_a_gguf_with_rope_freqs_gives_transformers_logits_for_its_folder(llama3, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, gguf = llama3
    ids = torch.randint(3, 320, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
    model = tierlm.load(gguf, dtype="float32")
    assert model.config.rope_scaling.rope_type == "freq_factors"
    torch.testing.assert_close(model(ids), expected, atol=1e-4, rtol=1e-4)
    without = tierlm.load(to_gguf(folder, tmp_path / "plain.gguf", rope_freqs=False), dtype="float32")
    assert (without(ids) - expected).abs().max() > 1e-2  # the factors matter on this model: the test can fail
    again = tierlm.load(gguf, dtype="float32")  # from the GGUF cache, whose config keeps the factors
    assert again.config.rope_scaling == model.config.rope_scaling


def test_a_gguf_cache_written_before_rope_freqs_were_read_is_rebuilt(llama3):
    _, gguf = llama3
    gguf_cache.ensure(gguf, torch.float32)
    meta = gguf_cache.cache_dir(gguf) / "config.json"
    old = json.loads(meta.read_text())
    old.pop("tierlm_config_format")
    old["rope_scaling"] = {**old["rope_scaling"], "rope_type": "default", "freq_factors": []}
    meta.write_text(json.dumps(old))  # as format 1 wrote it: no factors
    assert gguf_cache.open_cached(gguf, torch.float32) is None
    weights = gguf_cache.cache_dir(gguf) / "weights-float32.safetensors"
    written = weights.stat().st_mtime_ns
    assert gguf_cache.ensure(gguf, torch.float32).config.rope_scaling.rope_type == "freq_factors"
    assert weights.stat().st_mtime_ns == written  # only the config is written again, not the weights


@pytest.mark.parametrize("name", ["LLAMA3.GGUF", "llama3.bin"])
def test_a_gguf_named_otherwise_loads_as_a_gguf(llama3, tmp_path, name):
    """Recognised by its magic, it was read as GGUF weights but not as a GGUF model: no tokenizer, float32
    instead of the GGUF default, no disk offload ("cache not writable?")."""
    _, gguf = llama3
    other = tmp_path / name
    other.write_bytes(gguf.read_bytes())
    model = tierlm.load(
        other, device_map={"": "cpu", "model.layers.1": "disk"}, offload_folder=tmp_path / "off"
    )
    reference = tierlm.load(
        gguf, device_map={"": "cpu", "model.layers.1": "disk"}, offload_folder=tmp_path / "o"
    )
    assert model.tokenizer is not None and model.dtype == reference.dtype == torch.bfloat16
    assert (
        model.generate([[1, 5, 9]], max_new_tokens=6).token_ids
        == reference.generate([[1, 5, 9]], max_new_tokens=6).token_ids
    )


def test_a_folder_named_like_a_gguf_is_not_called_missing(tmp_path):
    folder = tmp_path / "model.gguf"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        tierlm.load(folder)


def test_a_gguf_without_a_tokenizer_fails_before_its_weights_are_dequantized(tiny_checkpoints, tmp_path):
    """llama.cpp refuses such a file too; the error comes first, not after dequantizing the whole file."""
    path = to_gguf(tiny_checkpoints["llama"], tmp_path / "bare.gguf", tokenizer=False)
    with pytest.raises(ValueError, match="has no tokenizer metadata"):
        tierlm.load(path)
    assert not list(gguf_cache.cache_dir(path).glob("weights-*"))


@pytest.mark.parametrize("kind", RANDOM_BLOCKS)
def test_i_quant_and_fp4_projections_load_as_their_dequantized_values(tiny_checkpoints, tmp_path, kind):
    """i-quants and MXFP4 are dequantized by gguf-py's reference code, which gives libggml's own
    dequantize_row_* bit for bit (checked for all 12 such types through llama-cpp-python 0.3.36; logits
    there equal llama.cpp's on an F32 copy to 6e-6): the loaded weights are those values."""
    from gguf.quants import dequantize

    path = to_gguf(tiny_checkpoints["llama"], tmp_path / f"{kind}.gguf", projections=kind)
    model = tierlm.load(path, dtype="float32", quantize=None)
    stored = {t.name: t for t in GGUFReader(path).tensors}["blk.1.ffn_down.weight"]
    want = torch.from_numpy(dequantize(stored.data, stored.tensor_type))
    got = model.decoder.get_submodule("model.layers.1.mlp.down_proj").weight
    assert 0.01 < want.std() < 1 and torch.equal(got, want.reshape(got.shape))
    assert torch.isfinite(model(torch.tensor([[1, 5, 17, 99]]))).all()
