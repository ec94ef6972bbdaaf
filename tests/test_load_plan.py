"""The LoadPlan: computed from headers alone, executed as planned by load(), printed by `tierlm plan`."""

from __future__ import annotations

import dataclasses
import shutil
import warnings

import pytest
import torch

import tierlm
from tierlm import loading
from tierlm.placement.device_map import format_bytes
from tierlm.plan import STEP_ORDER, describe_plan, plan
from tierlm.weights.safetensors import SafetensorsCheckpoint

DISK_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}


def _garbage_copy(src, dst):
    """The checkpoint with every weight byte overwritten (0xff: NaN in fp32); the header is intact."""
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    data = bytearray(file.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start:] = b"\xff" * (len(data) - start)
    file.write_bytes(bytes(data))
    return dst


def test_the_plan_reads_no_weights(tiny_checkpoints, tmp_path, monkeypatch):
    src = tiny_checkpoints["llama"]
    kwargs = dict(dtype="float32", device_map=DISK_MAP, quantize="int8", offload_folder=tmp_path / "off")
    expected = plan(src, **kwargs)
    garbage = _garbage_copy(src, tmp_path / "garbage")

    def refuse(*_args, **_kwargs):
        raise AssertionError("the plan read a weight")

    monkeypatch.setattr(SafetensorsCheckpoint, "load", refuse)
    monkeypatch.setattr(SafetensorsCheckpoint, "load_mapped", refuse)
    got = plan(garbage, **kwargs)
    assert dataclasses.replace(got, path=src) == expected
    assert got.steps == ("open", "build", "quantize", "stream", "fuse")  # the resident layer's int8 groups
    assert got.streamed_bytes["disk"] > 0 and got.streamed_bytes["cpu"] == 0


def test_the_plan_is_frozen_and_compares_by_value(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    p = plan(path, dtype="float32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.dtype = torch.bfloat16
    assert p == plan(path, dtype="float32")
    assert p != plan(path, dtype="bfloat16")
    assert p.decision == plan(path, dtype="float32", compile=False).decision


def _recorded_load(monkeypatch, path, **kwargs):
    """load() with the names of the steps it ran, in order."""
    ran = []
    for name, step in list(loading.STEPS.items()):

        def spy(p, state, name=name, step=step):
            ran.append(name)
            step(p, state)

        monkeypatch.setitem(loading.STEPS, name, spy)
    return tierlm.load(path, **kwargs), ran


def _fused(model) -> set[str]:
    return {n for n, m in model.decoder.named_modules() if getattr(m, "fused", None) is not None}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dtype="float32"),  # fp32 on the CPU: wide weights transposed, so nothing fuses
        dict(dtype="bfloat16"),  # resident: every layer fuses
        dict(dtype="bfloat16", device_map=DISK_MAP),  # the streamed layer stays apart
        dict(dtype="bfloat16", quantize="int8"),  # int8 projections fuse like float ones
        dict(dtype="bfloat16", quantize="int4", group_size=32),  # int4: gate/up fuse, q/k/v (32-row k, v) not
        dict(dtype="bfloat16", quantize="int4", group_size=128),  # in_features 64: int4 leaves them float
    ],
)
def test_load_runs_the_plan_it_reports(tiny_checkpoints, tmp_path, monkeypatch, kwargs):
    path = tiny_checkpoints["llama"]
    kwargs = dict(kwargs, offload_folder=tmp_path / "off")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # int4 names the layers it leaves in float
        model, ran = _recorded_load(monkeypatch, path, **kwargs)
    expected = plan(path, **kwargs)
    assert model.plan == expected
    assert tuple(ran) == expected.steps and list(expected.steps) == [s for s in STEP_ORDER if s in ran]
    assert _fused(model) == {module for module, _ in expected.fusion + expected.streamed_fusion}
    params = dict(model.decoder.named_parameters(remove_duplicate=False))
    transposed = {n for n, p in params.items() if not p.is_meta and p.dim() == 2 and not p.is_contiguous()}
    assert transposed == {n for n in expected.transposed if not params[n].is_meta}
    quantized = {n for n, m in model.decoder.named_modules() if type(m).__name__.startswith("Int")}
    assert bool(quantized) == ("quantize" in expected.steps)


def test_the_fusion_table_follows_the_placement_and_quantization(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    resident = plan(path, dtype="bfloat16").fusion
    assert [m for m, _ in resident] == [f"model.layers.{i}.{p}" for i in (0, 1) for p in ("self_attn", "mlp")]
    assert dict(resident)["model.layers.0.self_attn"] == ("q_proj", "k_proj", "v_proj")
    assert [m for m, _ in plan(path, dtype="bfloat16", device_map=DISK_MAP).fusion] == [
        "model.layers.0.self_attn",
        "model.layers.0.mlp",
    ]
    assert plan(path, dtype="bfloat16", quantize="int8").fusion == resident  # one int8 kernel for each group
    # int4 on the CPU fuses parts of 64-row multiples only: gate/up (128 rows each), not k/v (32 rows)
    int4 = plan(path, dtype="bfloat16", quantize="int4", group_size=32).fusion
    assert [m for m, _ in int4] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    # in_features 64 is no multiple of 128: int4 leaves every projection in float, so they fuse as before
    assert plan(path, dtype="bfloat16", quantize="int4", group_size=128).fusion == resident
    assert plan(path, dtype="float32").fusion == ()  # transposed layout


def test_tierlm_plan_prints_the_plan(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama"]
    kwargs = dict(dtype="float32", device_map=DISK_MAP, compile=True)
    p, text = plan(path, **kwargs), describe_plan(path, **kwargs)
    assert text.splitlines()[-1] == p.decision.explain()
    assert f"streamed per token: {format_bytes(p.streamed_bytes['disk'])} from disk" in text
    assert f"kv cache per sequence: {format_bytes(p.kv_bytes_per_token)} per token" in text
    assert f"execution device: {p.placement.device}" in text
    assert "memory of this process: " in text and "available (" in text


def test_read_per_token_counts_each_tier_and_one_embedding_row(tiny_checkpoints):
    """Every weight a token reads, once, by tier: the untied embedding gives one row; a tied one is read
    whole as the LM head."""
    from tierlm.plan import read_per_token

    p = plan(tiny_checkpoints["llama"], dtype="float32", device_map=DISK_MAP)
    row = p.module_bytes["model.embed_tokens"] // p.config.vocab_size
    disk = sum(b for m, b in p.module_bytes.items() if m in p.placement.offloaded["disk"])
    memory = sum(p.module_bytes.values()) - disk - p.module_bytes["model.embed_tokens"] + row
    assert read_per_token(p) == {"memory": memory, "cpu": 0, "disk": disk} and disk > 0
    assert disk == p.streamed_bytes["disk"]
    tied = plan(tiny_checkpoints["llama_tied"], dtype="float32", quantize=None)
    assert read_per_token(tied) == {"memory": sum(tied.module_bytes.values()), "cpu": 0, "disk": 0}
    text = describe_plan(tiny_checkpoints["llama"], dtype="float32", device_map=DISK_MAP)
    assert f"read per token: {format_bytes(memory)} from memory, {format_bytes(disk)} from disk" in text


@pytest.mark.parametrize("quantize, budget_mb", [("int4", 145), ("int4", 175), ("int8", 200), (None, 180)])
def test_an_auto_map_keeps_within_the_cpu_budget_with_a_quantized_lm_head(quantize, budget_mb):
    """The default model ties its LM head to the embedding; quantized, the head is a packed copy of its own
    (28.4 MB at int8) and counts against the budget beside the embedding: what stays in RAM, the KV cache
    reserve and the largest streamed unit fit in max_memory (the head was counted as shared, so a plan
    could exceed the budget by its size)."""
    from tierlm.placement.placer import KV_RESERVE_TOKENS

    p = plan(dtype="bfloat16", quantize=quantize, max_memory={"cpu": f"{budget_mb}MB"})
    resident = sum(b for m, b in p.module_bytes.items() if p.placement.module_map[m] == "cpu")
    streamed = [m for m, d in p.placement.module_map.items() if d == "disk"]
    units = {m: p.module_bytes[m] for m in streamed}
    if "model.embed_tokens" in units or "lm_head" in units:  # tied: they stream as one unit
        units["model.embed_tokens"] = p.module_bytes["model.embed_tokens"] + p.module_bytes["lm_head"]
    reserve = p.kv_bytes_per_token * KV_RESERVE_TOKENS + max(units.values()) if units else 0
    assert resident + reserve <= budget_mb * 1e6, (format_bytes(resident), format_bytes(reserve))
    assert p.module_bytes["lm_head"] == (0 if quantize is None else 49152 * 576 + 49152 * 2)
