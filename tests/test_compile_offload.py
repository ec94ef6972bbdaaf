"""Compile under offload: one compiled layer body for streamed and resident layers, the same tokens as the
layer-compiled resident model, weights fetched (and prefetched) around every compiled layer call."""

from __future__ import annotations

import json
import socket
import threading
import time
import warnings
from pathlib import Path

import httpx
import pytest
import torch
import torch._dynamo
from agreement import assert_greedy_agrees, greedy
from conftest import FAMILIES, SEED_MAP, write_tiny_checkpoint
from torch._dynamo.utils import counters

import tierlm
import tierlm.compile
from tierlm import CompileConfig, CompileSkippedWarning

LAYER = CompileConfig(scope="layer")
# Three calls of different prompt lengths within one static cache bucket: one compile serves them all.
PROMPTS = [
    (torch.tensor([[5, 17, 99, 230, 41, 7, 8]]), 12),
    (torch.tensor([[5, 17, 99]]), 5),
    (torch.tensor([[9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]), 9),
]
HALF_ON_DISK = {"": "cpu", "model.layers.1": "disk", "model.norm": "disk"}
MAPS = {
    "half-disk": dict(device_map=HALF_ON_DISK),
    "all-but-embed-disk": dict(device_map={"": "disk", "model.embed_tokens": "cpu"}),
    "cpu-offload-forced": dict(device_map=SEED_MAP, execution_device="cpu"),
}
WIDE = {"intermediate_size": 2048, "num_hidden_layers": 4}  # layers big enough for an "auto" budget to split
DEFAULT_HALF_ON_DISK = {
    "": "cpu",
    **{f"model.layers.{i}": "disk" for i in range(15, 30)},
    "model.norm": "disk",
}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(tierlm.compile, "_warned", set())


def compiled_runs(model, config=LAYER, prompts=PROMPTS, kinds=1):
    """Generate for every prompt from a fresh dynamo state; with one layer kind, recompiling anything is an
    error (several kinds compile one body each, which dynamo counts as recompiles of the first).
    Returns (results, how many graphs dynamo compiled)."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=kinds == 1):
        results = [
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, compile_config=config)
            for ids, n in prompts
        ]
    return results, counters["stats"]["unique_graphs"]


def assert_streamed_every_step(model, before: tuple[int, int], prompts=PROMPTS) -> None:
    """Every forward (one prefill, then each compiled decode step) fetched every streamed unit, and every
    fetch but the first of the model's life found its prefetch under way."""
    s = model.streamer
    steps = sum(n for _, n in prompts)  # one prefill + (n - 1) decode steps per call
    assert s.fetches - before[0] == len(s.units) * steps
    assert s.prefetched - before[1] == s.fetches - before[0] - (1 if before[0] == 0 else 0)


@pytest.fixture(scope="module")
def resident_layer(tiny_checkpoints):
    """Tokens of the layer-compiled resident model, per family (computed once each)."""
    seen: dict[str, list] = {}

    def tokens(family: str) -> list:
        if family not in seen:
            model = tierlm.load(tiny_checkpoints[family], dtype="float32")
            results, graphs = compiled_runs(model)
            assert graphs == 1 and results[0].stats.compile.scope == "layer"
            seen[family] = [r.token_ids for r in results]
        return seen[family]

    return tokens


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("map_name", list(MAPS))
def test_layer_compiled_offload_matches_layer_compiled_resident(
    tiny_checkpoints, resident_layer, family, map_name, tmp_path
):
    model = tierlm.load(tiny_checkpoints[family], dtype="float32", offload_folder=tmp_path, **MAPS[map_name])
    expected = resident_layer(family)
    results, graphs = compiled_runs(model)
    assert graphs == 1  # one layer body for every layer, streamed or resident, and for all three calls
    assert [r.token_ids for r in results] == expected
    assert_streamed_every_step(model, (0, 0))
    decision = results[0].stats.compile
    assert decision.compile and decision.scope == "layer" and decision.streamed
    assert [k[0].scope for k in model._compiled] == ["layer"]  # one step built: the layer body


def test_weights_stream_through_the_compiled_layer_body(tiny_checkpoints):
    """cpu offload forced onto the CPU: each compiled layer call sees the fetched copies, not the sources,
    and no hooks (the streaming stays outside the compiled code); the sources come back after each call, the
    hooks when an eager forward needs them (before, in between and after, eager generates stream alike)."""
    model = tierlm.load(tiny_checkpoints["qwen3"], dtype="float32", **MAPS["cpu-offload-forced"])
    streamer = model.streamer
    ids, n = PROMPTS[0]
    eager = model.generate(ids, max_new_tokens=n, min_new_tokens=n)  # through the hooks
    wrap = streamer.around_layers
    seen: list[tuple[bool, bool]] = []  # per streamed layer call: (weights are copies, no hooks)

    def spying(compiled):
        def spy(layer, *args):
            for i in streamer.by_layer.get(id(layer), []):
                weights = dict(streamer.modules[i].named_parameters())
                copies = all(
                    weights[k].data_ptr() != t.data_ptr() for k, t in streamer.units[i].sources.items()
                )
                seen.append((copies, not streamer.modules[i]._forward_pre_hooks))
            return compiled(layer, *args)

        return wrap(spy)

    streamer.around_layers = spying
    before = (streamer.fetches, streamer.prefetched)
    results, graphs = compiled_runs(model)
    assert graphs == 1
    assert len(seen) == sum(n - 1 for _, n in PROMPTS) and all(a and b for a, b in seen)
    assert_streamed_every_step(model, before)
    in_layers = [streamer.modules[i] for units in streamer.by_layer.values() for i in units]
    assert in_layers and not any(m._forward_pre_hooks for m in in_layers)  # off since the last decode step
    before = (streamer.fetches, streamer.prefetched)
    again = model.generate(ids, max_new_tokens=n, min_new_tokens=n)  # eager: the hooks come back
    assert again.token_ids == eager.token_ids  # fp32, the same kernels and placement
    assert_streamed_every_step(model, before, prompts=PROMPTS[:1])
    assert all(m._forward_pre_hooks and m._forward_hooks for m in streamer.modules)
    assert all(
        dict(m.named_parameters())[k].data_ptr() == t.data_ptr()
        for m, unit in zip(streamer.modules, streamer.units)
        for k, t in unit.sources.items()
    )  # released: the modules point at their sources again


def test_auto_map_with_a_tight_budget(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "wide", "llama", WIDE)
    resident, graphs = compiled_runs(tierlm.load(path, dtype="float32"))
    assert graphs == 1
    model = tierlm.load(path, dtype="float32", device_map="auto", max_memory={"cpu": "6MB"})
    assert model.placement.drop_disk_pages and model.placement.offloaded["disk"]
    assert model.device_map["model.layers.0"] == "cpu"  # a resident layer beside streamed ones
    results, graphs = compiled_runs(model)
    assert graphs == 1
    assert [r.token_ids for r in results] == [r.token_ids for r in resident]
    assert_streamed_every_step(model, (0, 0))


def test_int4_layer_compiled_offload_agrees_with_resident(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama"]
    ids, n = PROMPTS[0]
    torch._dynamo.reset()
    ref = greedy(
        tierlm.load(path, quantize="int4"), ids, max_new_tokens=n, min_new_tokens=n, compile_config=LAYER
    )
    model = tierlm.load(path, quantize="int4", device_map=HALF_ON_DISK, offload_folder=tmp_path)
    torch._dynamo.reset()
    counters.clear()
    out = greedy(model, ids, max_new_tokens=n, min_new_tokens=n, compile_config=LAYER)
    assert counters["stats"]["unique_graphs"] == 1
    assert_greedy_agrees(ref, out, "int4")
    assert model.streamer.fetches == len(model.streamer.units) * n


def test_default_model_half_on_disk(tmp_path):
    """The default model in its default dtype: layers 15-29 stream from disk through the one compiled body."""
    ids = torch.tensor([[1, 504, 2365, 3624, 4786, 359]])
    n = 8
    torch._dynamo.reset()
    resident = tierlm.load()
    ref = greedy(resident, ids, max_new_tokens=n, min_new_tokens=n, compile_config=LAYER)
    model = tierlm.load(device_map=DEFAULT_HALF_ON_DISK, offload_folder=tmp_path)
    torch._dynamo.reset()
    counters.clear()
    out = greedy(model, ids, max_new_tokens=n, min_new_tokens=n, compile_config=LAYER)
    assert counters["stats"]["unique_graphs"] == 1  # 30 layers, one body
    assert counters["inductor"]["fxgraph_cache_hit"] == 1  # the resident step's very code
    layers = model.decoder.model.layers  # streamed layers fused from the fused offload file, as resident ones
    assert layers[20].self_attn.fused is not None and layers[20].mlp.fused is not None
    assert model.decoder.uniformly_fused()
    assert_greedy_agrees(ref, out, str(model.dtype).removeprefix("torch."))
    assert model.streamer.fetches == 16 * n and model.streamer.prefetched == 16 * n - 1
    assert out.tokens and resident.dtype == model.dtype


# --- the decision, end to end ----------------------------------------------------------------------------


def test_scope_model_under_offload_warns_once_and_compiles_the_layer_body(tiny_checkpoints, tmp_path):
    """The seed's map (an accelerator and cpu offload, run here on the CPU) with a static cache and the
    default CompileConfig never compiles the whole step: it warns once and compiles the layer body."""
    model = tierlm.load(
        tiny_checkpoints["llama"], dtype="float32", device_map=SEED_MAP, execution_device="cpu"
    )
    eager = [model.generate(ids, max_new_tokens=n, min_new_tokens=n).token_ids for ids, n in PROMPTS]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        results, graphs = compiled_runs(model, CompileConfig())
    skipped = [str(w.message) for w in seen if issubclass(w.category, CompileSkippedWarning)]
    assert skipped == [
        "compile_config has scope 'model', but the whole decode step cannot be compiled while weights stream "
        "(model.layers.1, model.norm are offloaded to cpu); compiling the layer body instead, as "
        "CompileConfig(scope='layer') does under offload without this warning"
    ]
    assert graphs == 1 and [k[0].scope for k in model._compiled] == ["layer"]
    assert [r.token_ids for r in results] == eager
    assert (
        results[0]
        .stats.compile.explain()
        .startswith(
            "compile: layer body on cpu (2 layers; model.layers.1, model.norm stream from cpu); whole step: no ("
            "model.layers.1, model.norm are offloaded to cpu; scope 'model' fell back to 'layer')"
        )
    )


@pytest.mark.parametrize("overrides", [{}, {"disable_compile": True}], ids=["no-compile-config", "disable"])
def test_offload_without_consent_runs_eagerly_and_silently(tiny_checkpoints, tmp_path, overrides):
    model = tierlm.load(
        tiny_checkpoints["llama"], dtype="float32", device_map=HALF_ON_DISK, offload_folder=tmp_path
    )
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = model.generate(PROMPTS[0][0], max_new_tokens=6, **overrides)
    assert not result.stats.compile.compile and not model._compiled
    assert counters["stats"]["unique_graphs"] == 0


# --- the server ------------------------------------------------------------------------------------------


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer "t0" .. "t<vocab-1>" (t2 ends a sequence), enough to serve a tiny model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "pad_token": "t0"}))


@pytest.mark.parametrize("compile_config", [CompileConfig(), None], ids=["--compile", "no-compile"])
def test_server_compiles_only_what_decide_says(tmp_path, compile_config):
    """`tierlm serve --compile` with layers on disk: the worker builds only the layer body decide() names
    (no whole-step graph), streams through it, and answers what the eager library call does."""
    from tierlm.generation.config import GenerationConfig
    from tierlm.server import build_app, make_server

    folder = write_tiny_checkpoint(tmp_path / "served", "mistral")
    write_word_tokenizer(folder, 320)
    model = tierlm.load(folder, dtype="float32", device_map=HALF_ON_DISK, offload_folder=tmp_path / "off")
    prompt = [5, 17, 99, 230, 41]
    eager = model.generate(torch.tensor([prompt]), max_new_tokens=6)
    expected, forwards = eager.texts[0], len(eager.token_ids[0])  # one forward per token
    config = GenerationConfig(compile_config=compile_config) if compile_config else None
    server = make_server(build_app(model, generation_config=config), log_level="warning", shutdown_grace_s=1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    torch._dynamo.reset()
    counters.clear()
    fetches = model.streamer.fetches
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        body = {"model": "served", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            answer = httpx.post(f"{url}/v1/completions", json=body, trust_env=False, timeout=120)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected
    assert model.streamer.fetches - fetches == len(model.streamer.units) * forwards
    if compile_config is None:
        assert not model._compiled and counters["stats"]["unique_graphs"] == 0
    else:
        assert [k[0] for k in model._compiled] == [CompileConfig(scope="layer")]
        assert counters["stats"]["unique_graphs"] == 1  # the layer body, no whole-step graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pinned_cpu_weights_feed_the_compiled_layer_body(tiny_checkpoints):
    """On CUDA, layers on the cpu tier are copied from pinned RAM on the side stream (the next unit while
    this one computes) into the compiled layer body: no CUDA graphs, the tokens of the resident body."""
    path = tiny_checkpoints["llama"]
    resident = tierlm.load(path, dtype="float32", device_map={"": 0})
    resident.decoder.unfuse_projections()  # the same kernels as the streamed layers: exact in fp32
    expected, _ = compiled_runs(resident)
    model = tierlm.load(path, dtype="float32", device_map={**SEED_MAP, "model.layers.0": "cpu"})
    assert model.streamer.stream is not None
    results, graphs = compiled_runs(model)
    assert graphs == 1
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    decision = results[0].stats.compile
    assert decision.device == "cuda:0" and decision.config.mode == "default"
    assert_streamed_every_step(model, (0, 0))


def test_gemma3_streams_through_one_body_per_layer_kind(tmp_path):
    """Gemma 3 has sliding and full layers (a ring-buffer view and a full one): one body per kind, for
    resident and streamed layers alike, and the layer-compiled resident tokens."""
    from test_gemma3 import write_gemma3

    path = write_gemma3(
        tmp_path / "gemma3", "untied"
    )  # layers: sliding, sliding, full, sliding, full, sliding
    resident, graphs = compiled_runs(tierlm.load(path, dtype="float32"), kinds=2)
    assert graphs == 2
    model = tierlm.load(path, dtype="float32", device_map=HALF_ON_DISK, offload_folder=tmp_path / "off")
    results, graphs = compiled_runs(model, kinds=2)
    assert graphs == 2  # and no more across the three calls
    assert [r.token_ids for r in results] == [r.token_ids for r in resident]
    assert_streamed_every_step(model, (0, 0))
