"""Bad checkpoints give one clear error naming the problem."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file, save_file

import tierlm
from tierlm.plan import plan as make_plan


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


def write_gguf(path, arch="llama", tensor_type=GGMLQuantizationType.F32, omit=()):
    writer = GGUFWriter(str(path), arch)
    for key, add, value in [
        ("block_count", writer.add_block_count, 1),
        ("context_length", writer.add_context_length, 64),
        ("embedding_length", writer.add_embedding_length, 8),
        ("feed_forward_length", writer.add_feed_forward_length, 16),
        ("attention.head_count", writer.add_head_count, 2),
        ("attention.head_count_kv", writer.add_head_count_kv, 1),
        ("attention.layer_norm_rms_epsilon", writer.add_layer_norm_rms_eps, 1e-5),
        ("vocab_size", writer.add_vocab_size, 16),
    ]:
        if key not in omit:
            add(value)
    raw = np.zeros((16, 8), dtype=np.float32)
    if tensor_type == GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", raw)
    else:  # any bytes; the type check must fire before the data is read
        row = GGML_QUANT_SIZES[tensor_type][1] * 2  # two blocks
        writer.add_tensor("token_embd.weight", np.zeros((16, row), dtype=np.uint8), raw_dtype=tensor_type)
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
    path = write_gguf(tmp_path / "m.gguf", tensor_type=GGMLQuantizationType.Q8_1)  # an activations' type
    with pytest.raises(ValueError) as err:
        tierlm.load(path)
    assert "Q8_1" in one_line(err) and "token_embd.weight" in one_line(err) and "IQ4_XS" in one_line(err)


def test_unknown_dtype(tiny_checkpoints):
    with pytest.raises(ValueError) as err:
        tierlm.load(tiny_checkpoints["llama"], dtype="float8")
    assert "float8" in one_line(err)


def with_config(tiny_checkpoints, tmp_path, edit) -> tuple:
    """A copy of the tiny llama checkpoint whose config.json text is edit(parsed config)."""
    folder = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "m")
    config = folder / "config.json"
    config.write_text(edit(json.loads(config.read_text())))
    return folder, config


def without(field):
    return lambda cfg: json.dumps({k: v for k, v in cfg.items() if k != field})


BROKEN_CONFIGS = {
    **{
        f"missing {field}": (without(field), f'missing required field "{field}"')
        for field in ("hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers")
    },
    "hidden_size 576x": (
        lambda cfg: json.dumps({**cfg, "hidden_size": "576x"}),
        'field "hidden_size" must be a positive integer, got "576x"',
    ),
    "eos_token_id a string": (
        lambda cfg: json.dumps({**cfg, "eos_token_id": "</s>"}),
        'field "eos_token_id" must be a token id or a list of token ids, got "</s>"',
    ),
    "dtype a list": (
        lambda cfg: json.dumps({**cfg, "dtype": ["float32"]}),
        'field "dtype" must be a dtype name such as "bfloat16", got ["float32"]',
    ),
    "invalid JSON": (lambda cfg: json.dumps(cfg)[:-20], "is not valid JSON"),
    "a JSON list": (lambda cfg: "[1, 2]", "must hold a JSON object, got list"),
}


@pytest.mark.parametrize("case", BROKEN_CONFIGS)
def test_broken_config_is_one_line_naming_file_and_field(tiny_checkpoints, tmp_path, case):
    edit, needle = BROKEN_CONFIGS[case]
    folder, config = with_config(tiny_checkpoints, tmp_path, edit)
    with pytest.raises(ValueError) as err:
        tierlm.load(folder)
    assert one_line(err).startswith(f"config.json at {config}") and needle in one_line(err)


@pytest.mark.parametrize("case", BROKEN_CONFIGS)
def test_broken_config_is_one_cli_error_line_without_traceback(tiny_checkpoints, tmp_path, case):
    edit, needle = BROKEN_CONFIGS[case]
    folder, config = with_config(tiny_checkpoints, tmp_path, edit)
    proc = subprocess.run(
        [sys.executable, "-m", "tierlm.cli", "generate", "--model", str(folder), "Hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"tierlm: error: config.json at {config}")
    assert needle in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize("key", ["block_count", "context_length", "attention.layer_norm_rms_epsilon"])
def test_gguf_missing_metadata_key_is_named(tmp_path, key):
    """Keys llama.cpp requires (it refuses the file) are required here too, not given a default."""
    path = write_gguf(tmp_path / "m.gguf", omit=(key,))
    with pytest.raises(ValueError) as err:
        tierlm.load(path)
    assert "m.gguf" in one_line(err) and f'missing required field "llama.{key}"' in one_line(err)


def test_truncated_gguf_names_the_tensor_it_cannot_read(default_model_path, tmp_path):
    truncated = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        truncated.write_bytes(f.read(50_000_000))
    with pytest.raises(ValueError) as err:
        tierlm.load(truncated)
    message = one_line(err)
    assert "cut.gguf" in message and "GGUF" in message
    assert (
        "tensor blk.16.ffn_down.weight could not be read" in message and "past the end of the file" in message
    )
    assert "out of bounds" not in message and "reshape" not in message


def test_corrupt_gguf_metadata_names_the_key_it_cannot_read(default_model_path, tmp_path):
    with open(default_model_path, "rb") as f:
        head = bytearray(f.read(2_000_000))
    key = b"general.organization"
    at = head.index(key) + len(key) + 4  # past the key and its value type: the string's length
    head[at : at + 8] = b"\xff" * 8
    damaged = tmp_path / "bad.gguf"
    damaged.write_bytes(bytes(head))
    with pytest.raises(ValueError) as err:
        tierlm.load(damaged)
    message = one_line(err)
    assert "bad.gguf" in message and 'metadata key "general.organization" could not be read' in message
    assert "out of bounds" not in message


@pytest.mark.parametrize("endian", ["little", "big"])
def test_gguf_reader_reads_metadata_and_tensors_like_ggufs_own(tmp_path, endian):
    """tierlm's reader (tierlm.gguf_read, faster on large vocabularies) gives the same metadata values and
    tensors as the gguf package's own reader, for every kind of value (numbers, strings, empty, nested and
    large arrays) in either byte order, and its fields still cover the file's bytes exactly."""
    from gguf import GGUFEndian, GGUFReader, GGUFValueType

    from tierlm.gguf_read import metadata, open_gguf

    path = tmp_path / f"{endian}.gguf"
    order = GGUFEndian.LITTLE if endian == "little" else GGUFEndian.BIG
    writer = GGUFWriter(str(path), "llama", endianess=order)
    writer.add_uint32("t.u32", 7)
    writer.add_float32("t.f32", 0.5)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "naïve 日本")
    writer.add_array("t.ints", [3, -1, 2**20])
    writer.add_array("t.floats", [0.25, -1.5])
    writer.add_array("t.strings", ["", "a", "naïve", "日本語", "x" * 300])
    writer.add_array("t.empty", [])
    writer.add_array("t.nested", [[1, 2], [3, 4]])
    writer.add_array("t.nested_strings", [["a", "bc"], ["d", ""]])
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(5000)])
    writer.add_array("tokenizer.ggml.scores", [float(-i) for i in range(5000)])
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = open_gguf(path), GGUFReader(path)

    def value(field):  # gguf's own fields, element by element
        is_array = field.types[:1] == [GGUFValueType.ARRAY]
        string = field.types[-1] == GGUFValueType.STRING
        values = [
            bytes(field.parts[i]).decode() if string else field.parts[i].tolist()[0] for i in field.data
        ]
        return values if is_array else values[0]

    assert metadata(ours) == {k: value(f) for k, f in theirs.fields.items()}
    assert metadata(ours)["t.strings"] == ["", "a", "naïve", "日本語", "x" * 300]
    assert metadata(ours)["tokenizer.ggml.scores"][4999] == -4999.0
    for key, field in theirs.fields.items():
        assert sum(p.nbytes for p in ours.fields[key].parts) == sum(p.nbytes for p in field.parts), key
    assert [(t.name, t.tensor_type, t.data.tolist()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data.tolist()) for t in theirs.tensors
    ]


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"device": "tpu"}, "device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got 'tpu'"),
        ({"device": "disk"}, "'disk' is a tier of a device map, not a device"),
        ({"device_map": {"": "cpu"}, "execution_device": "disk"}, "execution_device must be 'cpu', 'cuda'"),
        ({"dtype": __import__("torch").int8}, "unknown dtype torch.int8; use one of auto, float32"),
        ({"dtype": __import__("torch").float64}, "unknown dtype torch.float64"),
    ],
)
def test_a_device_tierlm_does_not_run_on_is_named(tiny_checkpoints, kwargs, says):
    with pytest.raises(ValueError) as err:
        tierlm.load(tiny_checkpoints["llama"], **kwargs)
    assert says in one_line(err)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "kwargs", [{"device": "cuda"}, {"device_map": {"": 0}}, {"device_map": {"": "cuda:1"}}]
)
def test_a_gpu_this_machine_lacks_is_one_error_at_load_while_plan_describes_it(tiny_checkpoints, kwargs):
    """A plan may describe another machine (`tierlm plan` for a GPU host); a load names the missing device."""
    from tierlm.plan import plan

    assert plan(tiny_checkpoints["llama"], **kwargs).placement.device.type == "cuda"
    with pytest.raises(ValueError) as err:
        tierlm.load(tiny_checkpoints["llama"], **kwargs)
    assert "is not available: this torch" in one_line(err) and "sees no CUDA GPU" in one_line(err)


def test_a_budget_beside_a_dict_map_is_an_error_not_ignored(tiny_checkpoints):
    from tierlm.plan import plan

    with pytest.raises(ValueError) as err:
        plan(tiny_checkpoints["llama"], device_map={"": "cpu"}, max_memory={"cpu": "1GB"})
    assert "the budget would be ignored" in one_line(err)
    assert plan(tiny_checkpoints["llama"], device_map="auto", max_memory={"cpu": "1GB"}).placement.resident


@pytest.mark.parametrize("group_size", [0, -32, 64.0, "32", True])
def test_a_group_size_that_is_not_a_positive_int_is_named(tiny_checkpoints, group_size):
    """0 was taken as "the default", a float failed inside torch."""
    with pytest.raises(ValueError) as err:
        tierlm.load(tiny_checkpoints["llama"], quantize="int4", group_size=group_size)
    assert f"group_size must be a positive int (or None: the default), got {group_size!r}" == one_line(err)


@pytest.mark.parametrize(
    "quantize, says",
    [("int8", "int8 weights are quantized per output channel"), (None, "quantize=None keeps float weights")],
)
def test_a_group_size_where_nothing_is_grouped_is_named(tiny_checkpoints, quantize, says):
    """It was silently ignored: a user asking int8 in groups of 32 got per-channel int8 without a word."""
    with pytest.raises(ValueError) as err:
        tierlm.load(tiny_checkpoints["llama"], quantize=quantize, group_size=32)
    assert one_line(err) == f"group_size is int4's (quantize='int4' or 'auto'); {says}"
    assert tierlm.load(tiny_checkpoints["llama"], quantize="auto", group_size=32).plan.quantization is None


@pytest.mark.parametrize(
    "device_map",
    [None, {"": "cpu", "model.layers.0": "disk"}, {"": "disk"}],
    ids=["resident", "layer-on-disk", "all-on-disk"],
)
def test_a_tensor_of_the_wrong_shape_is_named_wherever_it_is_placed(tiny_checkpoints, tmp_path, device_map):
    """Shapes are checked from the header, for every tensor: one on disk is never loaded at load time, and
    a wrong one there failed inside torch at the first forward (or, for the embedding, gave token 0 on and
    on); `plan` says it too, before anything is read."""
    folder = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:100].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    says = "tensor model.layers.0.mlp.up_proj.weight has shape (100, 64), the config implies (128, 64)"
    kwargs = {"device_map": device_map, "offload_folder": tmp_path / "off"} if device_map else {}
    with pytest.raises(ValueError) as err:
        tierlm.load(folder, dtype="float32", **kwargs)
    assert one_line(err) == says
    with pytest.raises(ValueError) as err:
        make_plan(folder, dtype="float32", **kwargs)
    assert one_line(err) == says


@pytest.mark.parametrize("key", ["weight", "bias"])
def test_a_map_that_splits_a_modules_weight_from_its_bias_is_named(tiny_checkpoints, key):
    """Parameter names are valid keys, but the offload units are modules: a split q_proj was an
    AttributeError from torch's get_submodule at load, while plan() showed the map as fine."""
    device_map = {"": "cpu", f"model.layers.0.self_attn.q_proj.{key}": "disk"}
    says = (
        "device_map puts the parameters of model.layers.0.self_attn.q_proj on cpu, disk; a module's weight and "
        "bias go to one device: map 'model.layers.0.self_attn.q_proj' itself"
    )
    for call in (tierlm.load, make_plan):
        with pytest.raises(ValueError) as err:
            call(tiny_checkpoints["qwen2"], dtype="float32", device_map=device_map)
        assert one_line(err) == says
    whole = {"": "cpu", "model.layers.0.self_attn.q_proj": "disk"}
    assert make_plan(tiny_checkpoints["qwen2"], device_map=whole).placement.offloaded["disk"]


@pytest.mark.parametrize(
    "index", ['{"weight_map": [1, 2]}', '{"weight_map": {"a": 3}}', "[1]", '{"weight_map": {"a": ""}}']
)
def test_a_malformed_index_is_one_line_naming_it(tiny_checkpoints, tmp_path, index):
    """It was an AttributeError traceback ('list' object has no attribute 'items'), in `tierlm plan` too."""
    folder = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "m")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError) as err:
        tierlm.load(folder)
    assert one_line(err).startswith(
        f"{folder / 'model.safetensors.index.json'} is not a valid safetensors index"
    )


def test_model_safetensors_wins_over_an_index_beside_it(tiny_checkpoints, tmp_path):
    """As transformers chooses: the single file, not the shards of a stale index next to it."""
    folder = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    stale = {name: torch.zeros_like(t) for name, t in weights.items()}
    save_file(stale, folder / "old-00001-of-00001.safetensors", metadata={"format": "pt"})
    index = {"weight_map": dict.fromkeys(stale, "old-00001-of-00001.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = torch.tensor([[1, 5, 9]])
    torch.testing.assert_close(
        tierlm.load(folder, dtype="float32")(ids),
        tierlm.load(tiny_checkpoints["llama"], dtype="float32")(ids),
    )


def test_a_single_device_as_the_map_places_the_whole_model_there(tiny_checkpoints, default_model_path):
    """transformers reads device_map="cpu" (or 0, or a torch.device) as {"": that device}; it was refused.
    The quantization default reads it the same way (a GPU model is not quantized for this CPU)."""
    for device_map in (0, "cuda:0"):
        gpu = make_plan(default_model_path, device_map=device_map)
        assert gpu.quantization == make_plan(default_model_path, device_map={"": 0}).quantization is None
    path = tiny_checkpoints["llama"]
    whole = make_plan(path, device_map={"": "cpu"}).placement.module_map
    for device_map in ("cpu", torch.device("cpu"), "CPU"):
        assert make_plan(path, device_map=device_map).placement.module_map == whole
    assert set(make_plan(path, device_map=0).placement.module_map.values()) == {"cuda:0"}
    with pytest.raises(ValueError) as err:
        make_plan(path, device_map="gpu")
    assert one_line(err).startswith(
        "device_map 'gpu' is neither a device (0, 'cuda:1', 'cpu', 'disk', ...) nor one"
    )


def test_an_empty_max_memory_is_named(tiny_checkpoints):
    """It said "max_memory['cpu'] = 0 B is too small", a key the user never gave."""
    with pytest.raises(ValueError) as err:
        make_plan(tiny_checkpoints["llama"], device_map="auto", max_memory={})
    assert (
        one_line(err) == "max_memory is empty: give budgets such as {'cpu': '2GiB'}, or None for what is free"
    )
