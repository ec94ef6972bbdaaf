"""tierlm.errors: each kind of bad input raises its own ValueError subclass, so a caller can tell them apart."""

from __future__ import annotations

import json
import shutil

import pytest

import tierlm
from tierlm.errors import ModelFileError, OptionError, PlacementError, RequestError, TierlmError

KINDS = (ModelFileError, OptionError, PlacementError, RequestError)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return tierlm.load(tiny_checkpoints["llama"], dtype="float32")


def raised(call) -> TierlmError:
    with pytest.raises(TierlmError) as err:
        call()
    assert isinstance(err.value, ValueError) and "\n" not in str(
        err.value
    )  # old `except ValueError` still holds
    return err.value


def only(error: TierlmError, kind: type) -> None:
    assert isinstance(error, kind), f"{type(error).__name__}: {error}"
    assert not any(isinstance(error, other) for other in KINDS if other is not kind)


def test_the_classes_are_exported_from_tierlm():
    assert {tierlm.ModelFileError, tierlm.OptionError, tierlm.PlacementError, tierlm.RequestError} == set(
        KINDS
    )
    assert all(issubclass(kind, tierlm.TierlmError) and issubclass(kind, ValueError) for kind in KINDS)


def test_a_device_map_naming_no_module_is_a_placement_error(tiny_checkpoints):
    error = raised(
        lambda: tierlm.load(tiny_checkpoints["llama"], device_map={"model.layer.0": "cpu", "": "cpu"})
    )
    only(error, PlacementError)
    assert "model.layer.0" in str(error)


def test_a_memory_budget_of_nonsense_is_a_placement_error(tiny_checkpoints):
    error = raised(
        lambda: tierlm.load(tiny_checkpoints["llama"], device_map="auto", max_memory={"cpu": "lots"})
    )
    only(error, PlacementError)


def test_a_config_that_is_not_json_is_a_model_file_error(tiny_checkpoints, tmp_path):
    folder = shutil.copytree(tiny_checkpoints["llama"], tmp_path / "m")
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    only(raised(lambda: tierlm.load(folder)), ModelFileError)


def test_an_unknown_architecture_is_a_model_file_error(tiny_checkpoints, tmp_path):
    folder = shutil.copytree(tiny_checkpoints["llama"], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    only(raised(lambda: tierlm.load(folder)), ModelFileError)


def test_a_damaged_gguf_is_a_model_file_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes([3, 0, 0, 0]) + b"\xff" * 20)
    error = raised(lambda: tierlm.load(path))
    only(error, ModelFileError)
    assert "broken.gguf" in str(error)


def test_an_unknown_quantization_or_dtype_is_an_option_error(tiny_checkpoints):
    only(raised(lambda: tierlm.load(tiny_checkpoints["llama"], quantize="int3")), OptionError)
    only(raised(lambda: tierlm.load(tiny_checkpoints["llama"], dtype="float8")), OptionError)


def test_bad_sampling_settings_are_a_request_error(tiny):
    only(raised(lambda: tiny.generate(tierlm_ids(), max_new_tokens=4, temperature=-1.0)), RequestError)
    only(raised(lambda: tiny.generate(tierlm_ids(), max_new_tokens=0)), RequestError)


def test_a_prompt_longer_than_the_context_is_a_request_error(tiny):
    import torch

    ids = torch.ones((1, tiny.config.max_position_embeddings + 1), dtype=torch.long)
    error = raised(lambda: tiny.generate(ids, max_new_tokens=1))
    only(error, RequestError)
    assert "context" in str(error)


def test_a_request_error_leaves_the_model_usable(tiny):
    before = tiny.generate(tierlm_ids(), max_new_tokens=3, do_sample=False).token_ids
    only(raised(lambda: tiny.generate(tierlm_ids(), max_new_tokens=4, top_p=2.0)), RequestError)
    assert tiny.generate(tierlm_ids(), max_new_tokens=3, do_sample=False).token_ids == before


def tierlm_ids():
    import torch

    return torch.tensor([[1, 5, 9]])
