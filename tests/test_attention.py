"""Decode attention for grouped-query heads (K/V never expanded) gives the same tokens as SDPA."""

from __future__ import annotations

import contextlib

import pytest
import torch
from agreement import assert_greedy_agrees, greedy
from torch.utils._python_dispatch import TorchDispatchMode

import tierlm
from tierlm.models.layers import grouped_attention


def use_sdpa_for_decode(model, on: bool) -> None:
    for layer in model.decoder.model.layers:
        layer.self_attn.grouped_decode = not on


def test_grouped_attention_matches_sdpa_numerically():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 1, 64, generator=gen)
    k, v = torch.randn(2, 3, 40, 64, generator=gen), torch.randn(2, 3, 40, 64, generator=gen)
    mask = torch.rand(2, 1, 1, 40, generator=gen) > 0.3
    mask[..., 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(grouped_attention(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_grouped_decode_tokens_equal_sdpa_tiny(tiny_checkpoints, family):
    model = tierlm.load(tiny_checkpoints[family], dtype="float32")
    prompts = [[5, 17, 99, 230, 41, 7, 8], [300, 12, 45]]
    grouped = model.generate(prompts, max_new_tokens=24, min_new_tokens=24).token_ids
    use_sdpa_for_decode(model, True)
    assert model.generate(prompts, max_new_tokens=24, min_new_tokens=24).token_ids == grouped


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_decode_tokens_equal_sdpa_default_model(dtype):
    model = tierlm.load(dtype=dtype)
    prompt = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three rivers in Europe."}]
    )
    grouped = greedy(model, prompt, max_new_tokens=32)
    use_sdpa_for_decode(model, True)
    assert_greedy_agrees(
        grouped, greedy(model, prompt, max_new_tokens=32), dtype
    )  # bf16: logits, tests/agreement.py
    assert tierlm.load(dtype=dtype).decoder.model.layers[0].self_attn.grouped_decode  # a per-model setting


def use_attention_kernel(model, on: bool) -> None:
    for layer in model.decoder.model.layers:
        layer.self_attn.kernel = on


@pytest.mark.parametrize("scope", ["eager", "layer", "model"])
def test_decode_steps_attend_through_the_kernel_where_it_is_built(tiny_checkpoints, scope):
    """Where tierlm's CPU kernels are built (x86 with AVX2), every kind of decode step rotates, writes its K/V
    and attends in one call of the kernel (decode_rope_attention): eager, a compiled layer body, a compiled
    whole step (one call a layer, in the step's own graph); the graphs hold the kernel and no matmul, roll or
    index_copy. Its greedy logits agree with the matmul path's (kernel off) within bf16's tolerance
    (tests/agreement.py)."""
    from tierlm import CompileConfig, kernels
    from tierlm.models.layers import attention_kernel

    if kernels.selected() is None:
        pytest.skip("tierlm's CPU kernels are not used on this CPU")
    assert attention_kernel()
    model = tierlm.load(tiny_checkpoints["llama"], dtype="bfloat16")
    assert all(layer.self_attn.kernel for layer in model.decoder.model.layers)
    calls = []

    def recorder(gm, example_inputs):
        for graph in (m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)):
            calls.extend(str(node.target) for node in graph.nodes if node.op == "call_function")
        return gm.forward

    class Ops(TorchDispatchMode):  # the ops an eager step dispatches
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    prompts = [[5, 17, 99, 230, 41, 7, 8], [300, 12, 45]]
    cc = None if scope == "eager" else CompileConfig(backend=recorder, scope=scope)
    with Ops() if cc is None else contextlib.nullcontext():
        with_kernel = greedy(model, prompts, max_new_tokens=12, min_new_tokens=12, compile_config=cc)
    assert any("decode_rope_attention" in c for c in calls), calls
    assert not any(op in c for c in calls for op in ("matmul", "bmm", "roll", "index_copy") if cc is not None)
    # eager: 11 decode steps of 2 layers each attend through the kernel (prefill runs SDPA), and every bf16
    # norm (2 a layer and the final one, prefill too) is one call of the norm kernel; compiled steps fuse theirs
    layers = len(model.decoder.model.layers)
    if cc is None:
        assert sum("decode_rope_attention" in c for c in calls) == 11 * layers
        assert sum("rms_norm" in c for c in calls) >= 12 * (2 * layers + 1)
        assert not any("rsqrt" in c for c in calls), calls
    else:
        assert not any("rms_norm" in c for c in calls), calls
    use_attention_kernel(model, False)
    reference = greedy(model, prompts, max_new_tokens=12, min_new_tokens=12)
    assert_greedy_agrees(reference, with_kernel, "bfloat16")
