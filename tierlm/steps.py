"""Compiled decode steps, built only after compile.decide() said yes, once per shape, and reused.

A step is keyed by (compile config, batch, cache length, dtype, cache kind) and closes over its cache: a
static cache's step and a continuous batch's (SlotCache) of one shape read different tensors and are never
taken for each other. Steps packaged ahead of time (tierlm.aot) are loaded here too, when they apply.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
import types
import weakref
from collections.abc import Iterator, Mapping

import torch

from tierlm.cache import mark_static
from tierlm.compile import CompileConfig, streamed_config
from tierlm.models.decoder import run_layer
from tierlm.placement.offload import canonical_strides
from tierlm.weights import gguf_cache

log = logging.getLogger("tierlm")

# torch reads inductor's `freezing` flag from its process-wide config while dynamo traces, with no per-call
# way to set it, and the server calls the model from a worker thread: every first (tracing) call of a step
# holds this lock while it sets the flag, so no other thread traces under a flag it did not ask for.
_TRACING = threading.Lock()


class CompiledSteps(Mapping):
    """A model's compiled decode steps by key (compile config, batch, cache length, dtype, cache kind)."""

    def __init__(self) -> None:
        self._steps: dict[tuple, object] = {}

    def __getitem__(self, key: tuple) -> object:
        return self._steps[key]

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def drop(self, batch: int, length: int) -> None:
        """Forget the steps built for caches of (batch, length) (their cache was let go). A generation
        still running may hold one: its graphs go when the step itself goes (CompiledStep)."""
        self._steps = {k: v for k, v in self._steps.items() if k[1:3] != (batch, length)}

    def step(self, model, cache, compile_config: CompileConfig | None):
        """The step for `cache` under `compile_config`: found, loaded from model.packages, or built."""
        cc = compile_config or CompileConfig()
        if model.streamer is not None:  # a whole step cannot take streamed weights: as decide() says
            cc = streamed_config(cc, str(model.device))
        key = (cc, cache.batch, cache.max_len, model.dtype, type(cache).__name__)
        step = self._steps.get(key)
        if step is None and model.packages is not None and model.packages.applies(cc, cache):
            step = model.packages.step(cache, cc)  # loaded, or built once
        if step is None:
            step = build(model, cache, cc)
        self._steps[key] = step
        return step


def build(model, cache, cc: CompileConfig) -> CompiledStep:
    """The decode step over `cache` compiled with torch.compile: the whole step (scope "model") or one
    layer body run for every layer (scope "layer"), with streamed weights fetched outside it."""
    # A persistent per-user inductor cache, so a second process starts warm.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(gguf_cache.cache_root() / "inductor"))
    device, decoder, streamer = model.device, model.decoder, model.streamer
    ones = torch.ones(cache.batch, 1, dtype=torch.bool, device=device)
    kwargs = cc.compile_kwargs(str(device))
    decoder.widen_compiled_attention("max-autotune" not in cc.resolved_mode(str(device)))
    # A CPU whole step compiles its layers' decode attention once (halves a cold compile; CUDA steps and
    # AOT packages keep one graph: neither was measured with nested regions), unless it has a C++ wrapper,
    # which cannot call a nested region (inductor: "codegen invoke_subgraph is not implemented")
    regions = (
        cc.scope == "model" and device.type == "cpu" and not kwargs.get("options", {}).get("cpp_wrapper")
    )
    decoder.attention_regions(regions)
    body = LayerBody(kwargs) if cc.scope == "layer" else None
    layer_fn = body
    if layer_fn is not None and streamer is not None and streamer.streams_layers():
        if not decoder.uniformly_fused():
            decoder.unfuse_projections()  # every layer shaped alike: one body for all
        for layer in decoder.model.layers:
            canonical_strides(layer)
        layer_fn = streamer.around_layers(layer_fn)  # fetch/release outside the compiled body
    length = cache.max_len  # fixed shapes: the step always reads the whole cache

    def decode_step(tokens, positions, slots):
        logits = decoder(
            tokens, ones, positions=positions, cache=cache, slots=slots, layer_fn=layer_fn, length=length
        )
        return logits[:, -1].float()

    if cc.scope == "model" and device.type == "cuda":
        _static_addresses(cache)
    own = body.code_fn if body is not None else _own_code(decode_step)
    compiled = decode_step if body is not None else torch.compile(own, **kwargs)
    freezing = bool(kwargs.get("options", {}).get("freezing"))
    what = (
        f"the decode step (scope {cc.scope}, mode {cc.resolved_mode(str(device))}, "
        f"batch {cache.batch}, cache {cache.max_len})"
    )
    if cc.scope == "model" and device.type == "cpu":
        what += "; a cold whole-model compile takes minutes on a CPU"
    return CompiledStep(compiled, cache, freezing, True, what, own)


def _own_code(fn):
    """`fn` with a code object of its own. Dynamo keeps compiled graphs per code object, and every step
    built here is a closure of the same `decode_step` code: without this, each new whole step (another
    batch, cache length or model) adds one more entry to one shared list, dynamo's recompile limit (8)
    makes the ninth step in a process an error (fullgraph), each call searches the list, and a dropped
    step's graph (with its frozen weights) would stay alive with the code. With its own code object a
    step's graphs are its alone, and CompiledStep frees them when it goes. A layer-scope step's body
    (LayerBody) has a code object of its own too."""
    own = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    own.__qualname__ = fn.__qualname__
    return own


class LayerBody:
    """One compiled layer body of a layer-scope step: body(layer, x, cos, sin, mask, cache_view, slots).

    Compiled with torch.compile like a whole step, with a code object of its own (`_own_code`), so that
    inductor is called for this step's graphs and hands them over. Once a graph is compiled, later calls of
    layers shaped alike call it directly with the layer's tensors, without dynamo: the body runs once per
    layer per token, and dynamo's Python around each call (its frame hook, dispatch-key and
    eval-frame state, the disabled-frame wrappers) cost ~40-70 us a call on a 2-core Zen 3, more than
    some layers' compute. What a direct call passes is what the graph was traced with, found by
    identity: each graph input is a tensor the first call's layer holds (at a fixed attribute path, the
    same in every layer of that structure) or one of its arguments (or an attribute of one, the cache
    view's tensors). A layer's structure (its tensors' paths, shapes and dtypes) and the arguments'
    shapes key the direct calls; anything a graph reads from elsewhere, a non-tensor input or a graph
    with other outputs than the layer's result keeps that key on dynamo's path, as does a structure
    whose first call found a graph dynamo already had (no compile to learn from)."""

    def __init__(self, compile_kwargs: dict) -> None:
        kwargs = dict(compile_kwargs)
        backend = kwargs.pop("backend")
        options = kwargs.pop("options", None)
        if backend == "inductor":
            backend = _RecordingInductor(options or {}, kwargs.get("dynamic"), self._compiled)
        elif options:
            kwargs["options"] = options
        self.code_fn = _own_code(run_layer)
        self.code = self.code_fn.__code__
        self.dynamo = torch.compile(self.code_fn, backend=backend, **kwargs)
        self.direct: dict[tuple, tuple | None] = {}  # key -> (graph, getters), None: dynamo's path
        self.structures: dict[int, tuple] = {}  # id(layer) -> its structure (`_structure`)
        self.tracing: tuple | None = None  # (key, layer, args) of the call dynamo is running

    def __call__(self, layer, *args):
        structure = self.structures.get(id(layer))
        if structure is None:
            structure = self.structures[id(layer)] = _structure(layer)
        key = (structure, tuple(getattr(a, "shape", None) for a in args))
        found = self.direct.get(key, False)
        if found:
            graph, getters = found
            return graph(*[get(layer, args) for get in getters])[0]
        if found is None:
            return self.dynamo(layer, *args)
        self.direct[key] = None  # until a graph compiled in this call says otherwise
        self.tracing = (key, layer, args)
        try:
            return self.dynamo(layer, *args)
        finally:
            self.tracing = None

    def _compiled(self, gm, example_inputs, graph) -> None:
        """Inductor compiled `graph` from `gm` during the call in self.tracing: learn how to call it."""
        if self.tracing is None:
            return
        key, layer, args = self.tracing
        outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
        if not (isinstance(outputs, (tuple, list)) and len(outputs) == 1):
            return
        found = {id(t): get for t, get in _tensors(layer, args)}
        getters = []
        for example in example_inputs:
            get = found.get(id(example)) if isinstance(example, torch.Tensor) else None
            if get is None:
                return
            getters.append(get)
        self.direct[key] = (graph, getters)


class _RecordingInductor(torch._TorchCompileInductorWrapper):
    """torch.compile's inductor backend, telling `on_compile(gm, example_inputs, compiled)` what it built."""

    def __init__(self, options: dict, dynamic, on_compile) -> None:
        super().__init__(None, options, dynamic)
        self.on_compile = on_compile

    def __call__(self, model_, inputs_, **kwargs):
        compiled = super().__call__(model_, inputs_, **kwargs)
        self.on_compile(model_, inputs_, compiled)
        return compiled


def _structure(layer) -> tuple:
    """A layer's tensors' attribute paths, shapes and dtypes, and its class, as a hashable key."""
    return (type(layer), *((path, tuple(t.shape), t.dtype) for path, t in _module_tensors(layer, "")))


def _module_tensors(obj, prefix: str, seen: set[int] | None = None) -> list[tuple[str, torch.Tensor]]:
    """(dotted attribute path, tensor) for every tensor `obj` holds: an nn.Module's parameters, buffers and
    tensor attributes, its submodules', and those of tierlm objects it holds (a FusedProjections), each
    object once."""
    seen = set() if seen is None else seen
    seen.add(id(obj))
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, torch.nn.Module):
        names = {**obj._parameters, **obj._buffers, **obj._modules}
        names.update((k, v) for k, v in vars(obj).items() if not k.startswith("_"))
    else:
        names = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    for name, value in names.items():
        path = f"{prefix}{name}"
        if isinstance(value, torch.Tensor):
            out.append((path, value))
        elif id(value) in seen or not hasattr(value, "__dict__"):
            continue
        elif isinstance(value, torch.nn.Module) or type(value).__module__.startswith("tierlm."):
            out.extend(_module_tensors(value, path + ".", seen))
    return out


def _tensors(layer, args) -> list[tuple[torch.Tensor, object]]:
    """(tensor, getter(layer, args) -> that tensor) for every tensor a layer call can pass to its graph."""
    out = []
    for path, t in _module_tensors(layer, ""):
        get = operator.attrgetter(path)
        out.append((t, lambda layer, args, get=get: get(layer)))
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            out.append((a, lambda layer, args, i=i: args[i]))
        elif hasattr(a, "__dict__"):
            for path, t in _module_tensors(a, ""):
                get = operator.attrgetter(path)
                out.append((t, lambda layer, args, i=i, get=get: get(args[i])))
    return out


def _static_addresses(cache) -> None:
    """Every tensor the cache holds, marked static (cache.mark_static)."""
    for value in vars(cache).values():
        mark_static(
            *(t for t in (value if isinstance(value, list) else [value]) if isinstance(t, torch.Tensor))
        )


class CompiledStep:
    """Calls a compiled decode step: step(tokens, positions, slots, length) -> logits [batch, vocab].

    The first call traces and compiles. Dynamo reads inductor's `freezing` flag while tracing (to make
    the weights graph attributes that inductor folds and prepacks); options given to torch.compile only
    reach inductor, so the flag is set around that call (under _TRACING), else nothing would be frozen.
    Later calls skip dynamo's guard evaluation but for the guards that tell its compiled entries apart:
    the step is built for one cache and one (batch, length), its inputs keep their shapes and dtypes, and
    inductor still asserts each input's size and stride. A whole-model step saves ~0.8 ms a step (~300
    weight guards). A layer body's calls skip dynamo altogether once compiled (LayerBody); its first call
    ran every layer through dynamo with full guards, so every layer kind it meets (sliding or full
    attention, fused or separate projections) has its graph by then.
    `length` is not read: the step always attends over the whole cache.
    """

    def __init__(self, compiled, cache, freezing: bool, skip_guards: bool, what: str, own=None) -> None:
        self.compiled, self.cache = compiled, cache
        self.freezing, self.skip_guards, self.what = freezing, skip_guards, what
        self.traced = False
        if own is not None:  # a function with a code object of its own (_own_code): a step's or its body's
            # Dynamo keeps the graphs on the code object, where the garbage collector does not reach
            # them: when this step is gone (dropped with its cache, and no generation holds it any
            # more), its code's entries are reset, which frees its graphs and their frozen weights
            weakref.finalize(self, torch._dynamo.reset_code, own.__code__).atexit = False

    def __call__(self, tokens, positions, slots, length):
        if not self.traced:
            with _TRACING:
                return self._trace(tokens, positions, slots)
        if self.skip_guards:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self.compiled(tokens, positions, slots)
        return self.compiled(tokens, positions, slots)

    def _trace(self, tokens, positions, slots):
        inductor_config = torch._inductor.config
        old = inductor_config.freezing
        inductor_config.freezing = self.freezing or old
        start = time.perf_counter()
        log.info("compiling %s ...", self.what)
        try:
            logits = self.compiled(tokens, positions, slots)
        finally:
            inductor_config.freezing = old
        log.info("compiled in %.1f s", time.perf_counter() - start)
        self.traced = True
        return logits
