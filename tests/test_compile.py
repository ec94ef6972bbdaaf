"""End to end: the whole decode step compiles when the model is resident, only the layer body under offload,
and never twice."""

from __future__ import annotations

import contextlib
import gc
import io
import warnings
import weakref

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from agreement import assert_greedy_agrees, greedy
from conftest import SEED_MAP
from torch._dynamo.utils import counters

import tierlm
import tierlm.compile
from tierlm import CompileConfig, CompileSkippedWarning, GenerationConfig
from tierlm.placement.offload import _assign
from tierlm.steps import LayerBody

IDS = torch.tensor([[5, 17, 99, 230, 41, 7, 8]])
LONGER = torch.tensor([[9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]])


def run(model, ids=IDS, n=20, **kw):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)


@pytest.fixture(scope="module")
def compiled(tiny_checkpoints):
    """A resident tiny model whose decode step is compiled once for the whole module."""
    torch._dynamo.reset()
    counters.clear()
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    eager = run(model)
    cold = torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False)  # so it autotunes
    with (
        cold,
        contextlib.redirect_stderr(io.StringIO()) as stderr,
    ):  # inductor writes its tables to sys.stderr
        result = run(model, compile_config=CompileConfig())
    return model, eager, result, stderr.getvalue()


def test_resident_static_cache_compiles_and_matches_eager(compiled):
    model, eager, result, _ = compiled
    assert result.stats.compile.compile and result.stats.compile.reasons == ()
    assert counters["stats"]["unique_graphs"] == 1  # one compiled frame: the decode step
    assert result.token_ids == eager.token_ids


def test_max_autotune_prints_no_tables(compiled):
    """CompileConfig()'s max-autotune on a CPU benchmarks each product's kernels; tierlm keeps inductor from
    printing a table per product (and its choice statistics) under its own 'compiling' line."""
    *_, stderr = compiled
    assert "AUTOTUNE" not in stderr and "Autotune Choices Stats" not in stderr, stderr


def test_no_recompilation_across_prompts_and_lengths(compiled):
    model, *_ = compiled
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        a = run(model, LONGER, n=31, compile_config=CompileConfig())
        b = run(model, IDS[:, :3], n=5, compile_config=CompileConfig())
    assert counters["stats"]["unique_graphs"] == graphs
    assert a.token_ids == run(model, LONGER, n=31).token_ids
    assert b.token_ids == run(model, IDS[:, :3], n=5).token_ids


def test_layer_scope_compiles_one_body_for_all_layers(tiny_checkpoints):
    model = tierlm.load(tiny_checkpoints["qwen3"], dtype="float32")
    eager = run(model, n=12)
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        layered = run(model, n=12, compile_config=CompileConfig(scope="layer"))
        again = run(model, LONGER, n=7, compile_config=CompileConfig(scope="layer"))
    assert layered.stats.compile.compile
    assert counters["stats"]["unique_graphs"] == graphs + 1  # both layers ran the same compiled body
    assert layered.token_ids == eager.token_ids
    assert again.token_ids == run(model, LONGER, n=7).token_ids
    assert CompileConfig(scope="layer").compile_kwargs("cpu")["options"]["freezing"] is False


def test_a_compiled_layer_body_is_called_without_dynamo(tiny_checkpoints, layer_bodies):
    """Once the layer body is compiled, every layer calls the compiled graph directly with its own tensors
    (tierlm.steps.LayerBody): dynamo is not called again, and the tokens are those of the same graphs
    called through dynamo."""
    model = tierlm.load(tiny_checkpoints["qwen3"], dtype="float32")
    cc = CompileConfig(scope="layer")
    first = run(model, n=12, compile_config=cc)
    (body,) = [ref() for ref in layer_bodies]
    assert len(body.graphs) == 1 and all(body.graphs)  # one graph, called directly by every layer:
    assert len(body.direct) == model.config.num_layers and all(body.direct.values())
    calls = []
    dynamo = body.dynamo
    body.dynamo = lambda *args: calls.append(1) or dynamo(*args)
    direct = run(model, LONGER, n=7, compile_config=cc)
    assert calls == [] and run(model, n=12, compile_config=cc).token_ids == first.token_ids
    body.direct = dict.fromkeys(body.direct)  # every call through dynamo's path, to the same graph
    through_dynamo = run(model, LONGER, n=7, compile_config=cc)
    assert len(calls) == 6 * model.config.num_layers  # 6 decode steps (the first token is the prefill's)
    assert direct.token_ids == through_dynamo.token_ids == run(model, LONGER, n=7).token_ids


def test_streamed_layers_call_the_compiled_body_directly(tiny_checkpoints, layer_bodies):
    """Layers streamed from disk (their weights put on the module around each call) are called directly
    with the weights they hold at that call: the resident eager tokens (fp32)."""
    resident = run(tierlm.load(tiny_checkpoints["llama"], dtype="float32"), n=10)
    model = tierlm.load(
        tiny_checkpoints["llama"], dtype="float32", device_map={"": "cpu", "model.layers.1": "disk"}
    )
    streamed = run(model, n=10, compile_config=CompileConfig(scope="layer"))
    (body,) = [ref() for ref in layer_bodies]
    assert all(body.direct.values()) and model.streamer.fetches > 0
    assert streamed.token_ids == resident.token_ids


def test_frozen_layer_weights_are_never_called_directly(tiny_checkpoints, layer_bodies):
    """A layer graph with its weights frozen into it (freezing asked for in the options) serves that one
    layer: the body keeps dynamo's path (which tells the layers apart), and the eager tokens."""
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    frozen = CompileConfig(scope="layer", cpp_wrapper=False, options={"freezing": True})
    result = run(model, n=10, compile_config=frozen)
    (body,) = [ref() for ref in layer_bodies]
    layers = model.config.num_layers  # a graph per layer (dynamo guards on the frozen weights), none direct
    assert len(body.graphs) == layers and not any(body.graphs) and not any(body.direct.values())
    assert result.token_ids == run(model, n=10).token_ids


def test_a_dropped_layer_step_frees_its_body(tiny_checkpoints, layer_bodies):
    """A layer-scope step the model lets go (newer cache shapes) takes its body and graphs with it."""
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    cc = CompileConfig(scope="layer", cpp_wrapper=False)
    run(model, n=2, max_cache_len=32, compile_config=cc)
    assert layer_bodies[0]() is not None and all(layer_bodies[0]().direct.values())
    for length in (40, 48, 56, 64):  # four newer caches: the model lets the first one go
        run(model, n=2, max_cache_len=length, compile_config=cc)
    gc.collect()
    assert layer_bodies[0]() is None and layer_bodies[-1]() is not None


_OFFSET = torch.ones(8)  # a tensor a layer reads from its module's globals


class _GlobalReadingLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)

    def forward(self, x, rope, mask, cache_view, slots):
        return x @ self.weight + _OFFSET


def test_a_layer_body_whose_graph_reads_other_tensors_stays_on_dynamo():
    """A graph input that is neither the layer's tensor nor an argument's cannot be passed directly: that
    layer structure keeps dynamo's path, with the right result."""
    body = LayerBody(CompileConfig(scope="layer", cpp_wrapper=False).compile_kwargs("cpu"))
    layer, x = _GlobalReadingLayer(), torch.randn(1, 8)
    with torch.inference_mode():
        out = [body(layer, x, None, None, None, None, None) for _ in range(2)]
    assert list(body.direct.values()) == [None]
    for o in out:
        torch.testing.assert_close(o, x @ layer.weight + _OFFSET)


class _View:  # a cache view's shape: a plain object holding tensors
    def __init__(self) -> None:
        self.keys = torch.randn(8)


class _TwoPartLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.inner = torch.nn.Linear(8, 8, bias=False).requires_grad_(False)
        self.register_buffer("shift", torch.randn(8))

    def forward(self, x, rope, mask, cache_view, slots):
        return self.inner(x @ self.weight) + self.shift + cache_view.keys


def test_a_direct_layer_body_call_reads_the_tensors_put_in_place_since():
    """Direct calls resolve each input once per layer (a module's parameters, its buffers, a view's
    attributes) and read them at every call: tensors swapped in as the streamer does (`_assign`) or as
    a view's attribute are what the next call computes with."""
    body = LayerBody(CompileConfig(scope="layer", cpp_wrapper=False).compile_kwargs("cpu"))
    layers, view, x = [_TwoPartLayer(), _TwoPartLayer()], _View(), torch.randn(1, 8)

    def expected(layer):
        return layer.inner(x @ layer.weight) + layer.shift + view.keys

    with torch.inference_mode():
        for layer in layers * 2:  # the first call through dynamo, the others direct
            torch.testing.assert_close(body(layer, x, None, None, None, view, None), expected(layer))
        assert all(body.direct.values()) and len(body.resolved) == 2
        layer = layers[1]
        _assign(
            layer, {"weight": torch.randn(8, 8), "inner.weight": torch.randn(8, 8), "shift": torch.randn(8)}
        )
        view.keys = torch.randn(8)
        torch.testing.assert_close(body(layer, x, None, None, None, view, None), expected(layer))
        torch.testing.assert_close(body(layers[0], x, None, None, None, view, None), expected(layers[0]))


class _BrokenLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)

    def forward(self, x, rope, mask, cache_view, slots):
        y = x @ self.weight
        torch._dynamo.graph_break()
        return y.relu() @ self.weight


def test_a_layer_body_with_a_graph_break_stays_on_dynamo():
    """Two graphs for one layer (fullgraph off and a break): neither is the layer, so dynamo's path stays."""
    body = LayerBody(CompileConfig(scope="layer", cpp_wrapper=False, fullgraph=False).compile_kwargs("cpu"))
    layer, x = _BrokenLayer(), torch.randn(1, 8)
    with torch.inference_mode():
        out = [body(layer, x, None, None, None, None, None) for _ in range(2)]
    assert list(body.direct.values()) == [None]
    for o in out:
        torch.testing.assert_close(o, (x @ layer.weight).relu() @ layer.weight)


def test_decode_step_is_one_graph_without_breaks(tiny_checkpoints):
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    ones = torch.ones(1, 1, dtype=torch.bool)
    with torch.inference_mode():
        cache = model.static_cache(1, 256)
        model.decoder.ensure_rope(256, model.device)

        def decode_step(tokens, positions, slots):
            return model.decoder(tokens, attention_mask=ones, positions=positions, cache=cache, slots=slots)

        explained = torch._dynamo.explain(decode_step)(
            torch.tensor([[5]]), torch.tensor([[7]]), torch.tensor([7])
        )
    assert explained.graph_count == 1
    assert explained.graph_break_count == 0


def test_disk_offload_compiles_only_the_layer_body_and_warns_once(tiny_checkpoints, monkeypatch):
    """scope "model" under offload: never the whole step; one warning, then the layer body (issue 12;
    tests/test_compile_offload.py runs it compiled for real)."""
    monkeypatch.setattr(tierlm.compile, "_warned", set())
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append((fn.__name__, kw)) or fn)
    resident = run(tierlm.load(tiny_checkpoints["llama"], dtype="float32"))
    model = tierlm.load(
        tiny_checkpoints["llama"],
        dtype="float32",
        device_map={"": "cpu", "model.layers.1": "disk", "model.norm": "disk"},
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        results = [run(model, compile_config=CompileConfig()) for _ in range(3)]
    skipped = [w for w in seen if issubclass(w.category, CompileSkippedWarning)]
    assert len(skipped) == 1
    assert "(model.layers.1, model.norm are offloaded to disk)" in str(skipped[0].message)
    assert [name for name, _ in calls] == ["run_layer"]  # once, and never the whole decode step
    for r in results:
        assert r.stats.compile.compile and r.stats.compile.scope == "layer"
        assert r.token_ids == resident.token_ids


def test_freezing_is_never_used_for_an_offloaded_model(tiny_checkpoints, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)  # runs uncompiled
    model = tierlm.load(
        tiny_checkpoints["llama"], dtype="float32", device_map={"": "cpu", "model.layers.0": "disk"}
    )
    with pytest.warns(CompileSkippedWarning):
        run(model, compile_config=CompileConfig(freezing=True, mode="max-autotune-no-cudagraphs"))
    # the layer body (its inductor options are its backend's: tierlm.steps.LayerBody): weights are inputs
    assert len(calls) == 1 and calls[0]["backend"].config["freezing"] is False
    resident = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    run(resident, compile_config=CompileConfig(freezing=True))
    assert len(calls) == 2 and calls[1]["options"]["freezing"] is True


def test_freezing_makes_the_weights_graph_constants(tiny_checkpoints, monkeypatch):
    """With freezing on, inductor folds every projection weight into the graph (not a graph input)."""
    import torch._inductor.freezing as inductor_freezing

    real_freeze, frozen = inductor_freezing.freeze, []

    def spy(dynamo_gm, aot_gm, example_inputs):
        gm, preserved = real_freeze(dynamo_gm, aot_gm, example_inputs)
        frozen.append(len(example_inputs) - len(preserved))
        return gm, preserved

    monkeypatch.setattr(inductor_freezing, "freeze", spy)
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    result = run(model, n=4, compile_config=CompileConfig(freezing=True))
    assert result.stats.compile.compile
    layers = model.config.num_layers
    # q/k/v + o + gate/up + down per layer (fused or not), the norms and the LM head, at the least
    assert frozen and frozen[0] >= 4 * layers + 1, frozen
    assert result.token_ids == run(model, n=4).token_ids


def test_forced_cpu_offload_compiles_the_layer_body(tiny_checkpoints, monkeypatch):
    monkeypatch.setattr(tierlm.compile, "_warned", set())
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the decision, not the compiler, is tested
    model = tierlm.load(
        tiny_checkpoints["llama"], dtype="float32", device_map=SEED_MAP, execution_device="cpu"
    )
    with pytest.warns(CompileSkippedWarning, match=r"model.layers.1, model.norm are offloaded to cpu\)"):
        r = run(model, compile_config=CompileConfig())
    assert r.stats.compile.compile and r.stats.compile.scope == "layer"
    assert r.token_ids == run(tierlm.load(tiny_checkpoints["llama"], dtype="float32")).token_ids


def test_dynamic_cache_and_disable_compile_run_eagerly(tiny_checkpoints):
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    tierlm.compile._warned.clear()
    with pytest.warns(CompileSkippedWarning, match="cache 'dynamic' is not compilable"):
        r = run(model, compile_config=CompileConfig(), cache_implementation="dynamic")
    assert not r.stats.compile.compile
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileSkippedWarning)
        off = run(model, disable_compile=True)  # no compile_config: nothing asked, nothing to warn
    assert off.stats.compile.reasons[0] == "disable_compile=True"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_seed_map_does_not_compile_and_matches_all_gpu(tiny_checkpoints):
    path = tiny_checkpoints["mistral"]
    all_gpu = tierlm.load(path, dtype="float32", device_map={"": 0})
    counters.clear()
    compiled_run = run(all_gpu, cache_implementation="static")
    assert compiled_run.stats.compile.compile  # CUDA compiles by default (reduce-overhead)
    assert counters["inductor"]["cudagraph_skips"] == 0  # the in-place cache writes did not stop the graphs
    offloaded = tierlm.load(path, dtype="float32", device_map=SEED_MAP)
    r = run(offloaded, cache_implementation="static")
    assert not r.stats.compile.compile
    assert r.token_ids == compiled_run.token_ids == run(all_gpu, disable_compile=True).token_ids


def test_a_gpu_map_run_on_the_cpu_compiles_only_with_consent(tiny_checkpoints):
    """execution_device="cpu" makes the CPU the execution device: no compile without compile_config."""
    model = tierlm.load(
        tiny_checkpoints["llama"], dtype="float32", device_map={"": 0}, execution_device="cpu"
    )
    decision = run(model, n=3).stats.compile
    assert not decision.compile and decision.device == "cpu"
    assert decision.reasons == ("execution device 'cpu' compiles only when compile_config is set",)


@pytest.mark.parametrize(
    "family, dtype, regions",
    [
        ("llama", "float32", "split"),  # fp32 on the CPU: transposed weights, q/k/v not fused
        ("llama", "bfloat16", "fused"),
        ("qwen2", "bfloat16", "fused"),  # q/k/v biases, inside the fused product
        ("qwen3", "bfloat16", None),  # q/k norms: the inline path
    ],
)
def test_whole_step_compiles_decode_attention_once_for_all_layers(
    tiny_checkpoints, monkeypatch, family, dtype, regions
):
    """A CPU whole step runs every fitting layer's decode attention through one nested compile region
    (layers.decode_attention_region, or its split form for unfused q/k/v): the graph the backend receives
    calls the same subgraph once per layer and the subgraph holds no weight; tokens and log probabilities
    are exactly those of the same step without the region (the same ops, in any dtype), and in fp32 the
    tokens are those of eager decode.
    A family with q/k norms calls no region. (With tierlm's attention kernel, which the next test covers, no
    layer calls a region: the kernel is off here.)"""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    from tierlm.models.decoder import Decoder

    torch._dynamo.reset()  # two compiles of the step's code here; the earlier tests' count toward dynamo's limit
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = tierlm.load(tiny_checkpoints[family], dtype=dtype)
    model.decoder.attention_kernels(False)
    fused = {layer.self_attn.fused is not None for layer in model.decoder.model.layers}
    assert fused == {regions != "split"}
    with_region = run(model, n=6, logprobs=3, compile_config=CompileConfig(backend=capture))
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is invoke_subgraph]
    assert len(calls) == (model.config.num_layers if regions else 0)
    if regions:
        assert len({n.args[0].target for n in calls}) == 1  # one subgraph, called by every layer
        inner = getattr(gm, calls[0].args[0].target).graph
        assert not any("weight" in str(n.target) for n in inner.nodes if n.op in ("get_attr", "placeholder"))
    real = Decoder.attention_regions
    monkeypatch.setattr(Decoder, "attention_regions", lambda self, on: real(self, False))
    without = tierlm.load(tiny_checkpoints[family], dtype=dtype)
    without.decoder.attention_kernels(False)
    inline = run(without, n=6, logprobs=3, compile_config=CompileConfig(backend=capture))
    calls = [n for n in graphs[-1].graph.nodes if n.op == "call_function" and n.target is invoke_subgraph]
    assert not calls
    assert with_region.token_ids == inline.token_ids
    assert with_region.logprobs == inline.logprobs  # every step's log probabilities and top 3, exactly
    if dtype == "float32":
        assert with_region.token_ids == run(model, n=6).token_ids


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_whole_step_attends_through_the_fused_kernel_without_regions(tiny_checkpoints, family):
    """Where tierlm's CPU kernels run, a CPU whole step calls no nested region: each layer's rotary, K/V write
    and attention are one call of decode_rope_attention (in the step's own graph, with no roll, index_copy or
    matmul left), q/k norms (qwen3) or not. Its greedy logits agree with the region's matmul path (kernel off)
    within bf16's tolerance (tests/agreement.py)."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    from tierlm import kernels

    if kernels.selected() is None:
        pytest.skip("tierlm's CPU kernels are not used on this CPU")
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = tierlm.load(tiny_checkpoints[family], dtype="bfloat16")
    assert model.decoder.attends_through_kernel()
    model.decoder.compute_dtype = torch.float16  # a dtype the kernel does not take: regions stay on there
    assert not model.decoder.attends_through_kernel()
    model.decoder.compute_dtype = torch.bfloat16
    prompts = [[5, 17, 99, 230, 41, 7, 8], [300, 12, 45]]
    fused = greedy(
        model, prompts, max_new_tokens=8, min_new_tokens=8, compile_config=CompileConfig(backend=capture)
    )
    targets = [str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function"]
    assert invoke_subgraph not in [n.target for n in graphs[-1].graph.nodes]
    assert sum("decode_rope_attention" in t for t in targets) == model.config.num_layers
    assert not any(op in t for t in targets for op in ("roll", "index_copy", "matmul", "bmm"))
    model.decoder.attention_kernels(False)
    reference = greedy(
        model, prompts, max_new_tokens=8, min_new_tokens=8, compile_config=CompileConfig(backend=capture)
    )
    assert_greedy_agrees(reference, fused, "bfloat16")


def test_inductor_writes_the_cache_in_place_through_the_fused_kernel(tiny_checkpoints):
    """decode_rope_attention mutates the cache (`Tensor(a!)`): inductor's generated step passes each layer's
    keys and values, graph inputs, to it as they are, and copies or clones nothing (a functionalized copy of
    the cache would cost a whole cache per layer per step, with the same tokens)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from tierlm import kernels

    if kernels.selected() is None:
        pytest.skip("tierlm's CPU kernels are not used on this CPU")
    torch._dynamo.reset()
    model = tierlm.load(tiny_checkpoints["llama"], dtype="bfloat16")
    _, codes = run_and_get_code(lambda: run(model, n=4, compile_config=CompileConfig()))
    code = "\n".join(codes)
    call = re.compile(
        r"decode_rope_attention\.default\(.*, (\w+), (\w+), (\w+), (\w+), (\w+), (\w+), [-\d.e]+\)$"
    )
    calls = [m.groups() for line in code.splitlines() if (m := call.search(line.strip()))]
    assert len(calls) == model.config.num_layers
    for _cos, _sin, keys, values, _slots, _mask in calls:
        assert keys.startswith("arg") and values.startswith("arg")  # the step's inputs: the cache itself
    assert len({c[2] for c in calls} | {c[3] for c in calls}) == 2 * model.config.num_layers
    assert ".copy_(" not in code and "aten.copy" not in code and "clone" not in code


def test_whole_step_with_a_cpp_wrapper_inlines_the_attention(tiny_checkpoints):
    """inductor's C++ wrapper cannot call a nested compile region, so a whole step with cpp_wrapper=True
    inlines each layer's decode attention (it failed with "codegen invoke_subgraph is not implemented")."""
    torch._dynamo.reset()
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    eager = run(model, n=8)
    out = run(model, n=8, compile_config=CompileConfig(cpp_wrapper=True))
    assert out.stats.compile.compile and out.token_ids == eager.token_ids
    assert not any(layer.self_attn.region for layer in model.decoder.model.layers)


def weak_capture():
    """A fresh dynamo and a backend that runs each graph as traced, keeping a weak reference to it."""
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(weakref.ref(gm))
        return gm.forward

    return graphs, capture


def test_more_whole_steps_than_dynamos_recompile_limit_in_one_process(tiny_checkpoints):
    """Twelve whole steps (twelve cache lengths) built in one process each compile once and decode the
    eager tokens: each step has a code object of its own, so dynamo's per-code recompile limit (8, an
    error under fullgraph) does not count them together. The graphs of the steps the model dropped (with
    their caches) are freed; those of the steps it holds are alive."""
    graphs, capture = weak_capture()
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    eager = run(model, n=4)
    lengths = [32 + 8 * i for i in range(12)]
    assert len(lengths) > torch._dynamo.config.recompile_limit
    for length in lengths:
        result = run(model, n=4, max_cache_len=length, compile_config=CompileConfig(backend=capture))
        assert result.token_ids == eager.token_ids
    assert len(graphs) == len(lengths)  # one graph per step, none traced twice
    held = {key[2] for key in model._compiled}  # the model keeps the steps of the caches it keeps
    assert held and held < set(lengths)
    gc.collect()
    alive = [length for length, ref in zip(lengths, graphs) if ref() is not None]
    assert set(alive) == held  # a dropped step's graph went with it


def test_a_running_generation_keeps_its_step_when_the_model_drops_it(tiny_checkpoints):
    """A generation holds its compiled step: when newer cache shapes push its cache (and step) out of the
    model's keeping mid-run, it decodes on with the same graph, not a retraced one, and the eager tokens;
    that graph is freed only once the generation is done with it too."""
    graphs, capture = weak_capture()
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    eager = run(model, n=8)
    cc = CompileConfig(backend=capture)
    config = GenerationConfig(max_new_tokens=8, min_new_tokens=8, max_cache_len=32, compile_config=cc)
    generation = model.start(IDS, config)
    events = generation.events()
    with torch.inference_mode():  # as generate() and the server's worker drive a generation
        for _ in range(3):  # prefill and two compiled steps
            next(events)
        assert len(graphs) == 1
        for length in (40, 48, 56, 64):  # four newer caches: the model lets the first one go
            run(model, n=2, max_cache_len=length, compile_config=cc)
        assert 32 not in {key[2] for key in model._compiled}
        for _ in events:
            pass
    assert len(graphs) == 5  # its step was not traced again
    assert generation.result().token_ids == eager.token_ids
    first = graphs[0]
    assert first() is not None  # the generation still holds its step
    del generation, events
    gc.collect()
    assert first() is None
