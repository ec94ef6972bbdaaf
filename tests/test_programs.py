"""Eager decode steps as layer programs (tierlm.models.programs): the same logits as the module path, bit for
bit, for every family, precision and product path; streamed and hooked layers stay modules."""

from __future__ import annotations

import pytest
import torch
from agreement import greedy
from conftest import write_tiny_checkpoint
from test_gemma3 import write_gemma3

import tierlm
import tierlm.model
from tierlm import kernels
from tierlm.models import layers
from tierlm.models.programs import decode_programs
from tierlm.quant import Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(
    kernels.selected() is None, reason="layer programs run where tierlm's CPU attention kernel is built"
)

# Shapes whose int4 projections fuse (parts of a multiple of 64 rows) and suit every kernel
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
PROMPTS = [[5, 17, 99, 230, 41, 7, 8], [300, 12, 45], [9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("programs")
    paths = {f: write_tiny_checkpoint(root / f, f, WIDE) for f in ("llama", "qwen2", "qwen3", "mistral")}
    paths["gemma3"] = write_gemma3(root / "gemma3", "untied")  # sliding layers (rings) and full ones
    return paths


def with_and_without_programs(model, monkeypatch, rows: int, **overrides):
    """(greedy run through the layer programs, greedy run through the modules, layers that ran as programs)."""
    built = []

    def recording(*args):
        programs = decode_programs(*args)
        built.append(0 if programs is None else programs.layers)
        return programs

    monkeypatch.setattr(tierlm.model, "decode_programs", recording)
    prompts = PROMPTS[:rows]
    fast = greedy(model, prompts, max_new_tokens=10, min_new_tokens=10, **overrides)
    monkeypatch.setattr(tierlm.model, "decode_programs", lambda *args: None)
    slow = greedy(model, prompts, max_new_tokens=10, min_new_tokens=10, **overrides)
    return fast, slow, built


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
@pytest.mark.parametrize(
    "weights", ["float32", "bfloat16", "int8", "int4", "bfloat16 widened", "bfloat16 vector"]
)
@pytest.mark.parametrize("rows", [1, 4])
def test_programs_give_the_module_paths_logits_bit_for_bit(checkpoints, monkeypatch, family, weights, rows):
    """The same products on the same tensors in the same order: every step's logits equal the module path's
    exactly, in every precision (float, int8, int4 weights; the fp32-widened decode products of a CPU without
    native bf16, for 4 rows; one-row products as torch.mv), and every layer that can runs as a program
    (Gemma 3's sliding layers, whose cache is a ring, stay modules)."""
    dtype, _, path = weights.partition(" ")
    quantize = dtype if dtype in ("int8", "int4") else None
    model = tierlm.load(
        checkpoints[family],
        dtype="float32" if dtype == "float32" else "bfloat16",
        quantize=quantize,
        group_size=32 if quantize == "int4" else None,
    )
    if path == "widened":
        model.decoder.widen_prefill(True)
    if path == "vector":
        model.decoder.vector_products(eager=True)
    fast, slow, built = with_and_without_programs(model, monkeypatch, rows)
    decoder_layers = model.decoder.model.layers
    full = sum(not sliding for sliding in model.decoder.sliding)
    assert built == [full] and full > 0, built
    if quantize == "int4":
        assert all(isinstance(layer.mlp.fused.packed, Int4Linear) for layer in decoder_layers)
    if quantize == "int8":
        assert all(isinstance(layer.mlp.fused.packed, Int8Linear) for layer in decoder_layers)
    assert fast.tokens == slow.tokens
    assert torch.equal(fast.logits, slow.logits)


@pytest.mark.parametrize("kind", ["Linear", "Int8Linear", "Int4Linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_a_product_is_its_modules_forward(kind, dtype, rows, bias):
    """`product(rows, dtype)` computes what `forward` computes on [rows, 1, in], bit for bit, for each choice
    of kernel the module makes (widened and torch.mv products of a float Linear included)."""
    torch.manual_seed(rows)
    linear = layers.Linear(128, 192, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        if bias:
            linear.bias.normal_(0, 0.5)
    linear = linear.to(dtype)
    modules = {"plain": linear}
    if kind == "Linear":
        modules["widened"], modules["vector"] = (
            layers.Linear(128, 192, bias=bias),
            layers.Linear(128, 192, bias=bias),
        )
        for name in ("widened", "vector"):
            modules[name].load_state_dict(linear.state_dict())
            modules[name].to(dtype)
        modules["widened"].widen = True
        modules["vector"].vector = layers.VECTOR_EAGER
    elif kind == "Int8Linear":
        modules = {"plain": Int8Linear.from_linear(linear, dtype)}
    else:
        if dtype == torch.float32 and not kernels.reads_torch_int4():
            pytest.skip("aten's CPU int4 product takes bf16 scales here")
        modules = {"plain": Int4Linear.from_linear(linear, 32, dtype)}
    x = torch.randn(rows, 1, 128).to(dtype)
    for name, module in modules.items():
        product = module.product(rows, dtype)
        assert product is not None, name
        assert torch.equal(product(x.view(rows, 128)), module(x).view(rows, 192)), name


def test_streamed_layers_run_as_modules_and_fetch_their_weights(checkpoints, tmp_path, monkeypatch):
    """Layers on disk stream through their hooks, so they run as modules; the resident ones run as programs;
    the tokens are the all-resident model's (fp32)."""
    resident = tierlm.load(checkpoints["llama"], dtype="float32")
    expected = greedy(resident, PROMPTS[:2], max_new_tokens=10, min_new_tokens=10)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
    device_map.update({"model.norm": "cpu", "lm_head": "cpu"})
    model = tierlm.load(checkpoints["llama"], dtype="float32", device_map=device_map, offload_folder=tmp_path)
    fetches = model.streamer.fetches
    fast, slow, built = with_and_without_programs(model, monkeypatch, 2)
    assert built == [1]
    assert model.streamer.fetches - fetches >= 2 * 10  # both runs fetched layer 1 at every step
    assert fast.tokens == slow.tokens == expected.tokens
    assert torch.equal(fast.logits, slow.logits)


def test_a_hooked_layer_runs_as_a_module(checkpoints, monkeypatch):
    """A forward hook on a layer (or under it) still runs: that layer has no program."""
    model = tierlm.load(checkpoints["llama"], dtype="bfloat16")
    calls = []
    handle = model.decoder.model.layers[1].mlp.register_forward_hook(lambda *_: calls.append(1))
    try:
        fast, slow, built = with_and_without_programs(model, monkeypatch, 1)
    finally:
        handle.remove()
    assert built == [1]
    assert len(calls) == 2 * (1 + 9)  # each run: the prefill and nine decode steps through the module
    assert torch.equal(fast.logits, slow.logits)


def test_the_default_model_decodes_through_programs_bit_for_bit(default_model_path, monkeypatch):
    """The default model as `tierlm.load` reads it on this CPU (its default dtype and packed weights): all
    30 layers run as programs, with the module path's logits exactly."""
    model = tierlm.load(default_model_path)
    fast, slow, built = with_and_without_programs(model, monkeypatch, 1)
    assert built == [30]
    assert torch.equal(fast.logits, slow.logits)
