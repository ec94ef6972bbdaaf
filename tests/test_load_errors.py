"""Bad checkpoints give one clear error naming the problem."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file, save_file

import tierlm


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        tierlm.load(tmp_path / "nope")
    assert "does not exist" in one_line(err) and "nope" in one_line(err)


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        tierlm.load(tmp_path / "m")
    assert "no config.json" in one_line(err)


def test_folder_without_weights(tiny_checkpoints, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(tiny_checkpoints["llama"] / "config.json", folder)
    with pytest.raises(FileNotFoundError) as err:
        tierlm.load(folder)
    assert "model.safetensors" in one_line(err)


def test_unsupported_architecture_is_named_with_supported_list(tiny_checkpoints, tmp_path):
    folder = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        tierlm.load(folder)
    msg = one_line(err)
    assert "GPTNeoXForCausalLM" in msg and "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg


def test_truncated_safetensors(tiny_checkpoints, tmp_path):
    folder = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError) as err:
        tierlm.load(folder)
    assert "truncated" in one_line(err) and "model.safetensors" in one_line(err)


def test_missing_tensor_is_named(tiny_checkpoints, tmp_path):
    folder = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError) as err:
        tierlm.load(folder)
    assert "missing" in one_line(err) and "model.layers.1.mlp.up_proj.weight" in one_line(err)


def test_unexpected_tensor_is_named(tiny_checkpoints, tmp_path):
    folder = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError) as err:
        tierlm.load(folder)
    assert "unexpected" in one_line(err) and "model.layers.0.mlp.extra_proj.weight" in one_line(err)


def test_truncated_gguf(default_model_path, tmp_path):
    truncated = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        truncated.write_bytes(f.read(50_000_000))
    with pytest.raises(ValueError) as err:
        tierlm.load(truncated)
    assert "cut.gguf" in one_line(err) and "GGUF" in one_line(err)


def write_gguf(path, arch="llama", tensor_type=GGMLQuantizationType.F32):
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(16)
    raw = np.zeros((16, 8), dtype=np.float32)
    if tensor_type == GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", raw)
    else:  # any bytes; the type check must fire before the data is read
        writer.add_tensor("token_embd.weight", np.zeros((16, 66), dtype=np.uint8), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_of_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError) as err:
        tierlm.load(write_gguf(tmp_path / "m.gguf", arch="gptneox"))
    assert "gptneox" in one_line(err) and "llama" in one_line(err)


def test_gguf_with_unsupported_tensor_type(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tensor_type=GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(ValueError) as err:
        tierlm.load(path)
    assert "IQ2_XXS" in one_line(err) and "token_embd.weight" in one_line(err) and "Q4_K" in one_line(err)


def test_unknown_dtype(tiny_checkpoints):
    with pytest.raises(ValueError) as err:
        tierlm.load(tiny_checkpoints["llama"], dtype="float8")
    assert "float8" in one_line(err)
