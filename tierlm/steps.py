"""Compiled decode steps, built only after compile.decide() said yes, once per shape, and reused.

A step is keyed by (compile config, batch, cache length, dtype, cache kind) and closes over its cache: a
static cache's step and a continuous batch's (SlotCache) of one shape read different tensors and are never
taken for each other. Steps packaged ahead of time (tierlm.aot) are loaded here too, when they apply.
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
import time
import types
import weakref
from collections.abc import Iterator, Mapping

import torch

from tierlm import cpu
from tierlm.cache import mark_static
from tierlm.compile import CompileConfig, streamed_config, use_inductor_cache
from tierlm.models.decoder import run_layer
from tierlm.placement.offload import canonical_strides

log = logging.getLogger("tierlm")

# torch reads inductor's `freezing` flag from its process-wide config while dynamo traces, with no per-call
# way to set it, and the server calls the model from a worker thread: every first (tracing) call of a step
# holds this lock while it sets the flag, so no other thread traces under a flag it did not ask for.
_TRACING = threading.Lock()

# Where a layer-scope body's one-row bf16 products are inductor's reductions (cpu.compiled_layer_mv), a pointwise
# producer of more ops than this (the RMS norm before q/k/v and gate/up) is computed into a buffer of its own
# rather than inlined into the reduction that reads it, which would recompute it once per output row (3072
# times over for gate/up): bf16 layer-scope decode of the default model 36.3 -> 39.1 tok/s on an AMX Xeon
# (inductor's default: 30 ops)
LAYER_REALIZE_OPCOUNT = 8


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
    use_inductor_cache()
    device, decoder, streamer = model.device, model.decoder, model.streamer
    ones = torch.ones(cache.batch, 1, dtype=torch.bool, device=device)
    kwargs = cc.compile_kwargs(str(device))
    on_cpu = device.type == "cpu"
    decoder.widen_compiled_attention(
        "max-autotune" not in cc.resolved_mode(str(device)), on_cpu and cpu.detect().compiled_wide_attention
    )
    # A layer body's one-row bf16 products as torch.mv where inductor's reductions beat aten's product
    # (tierlm.cpu); a whole step keeps F.linear (max-autotune's GEMM templates, frozen weights)
    reductions = cc.scope == "layer" and on_cpu and cpu.detect().compiled_layer_mv
    decoder.vector_products(compiled=reductions)
    if reductions and "options" in kwargs:  # the caller's own options win
        kwargs["options"].setdefault("realize_opcount_threshold", LAYER_REALIZE_OPCOUNT)
    # A CPU whole step compiles its layers' decode attention once (halves a cold compile; CUDA steps and
    # AOT packages keep one graph: neither was measured with nested regions), unless it has a C++ wrapper,
    # which cannot call a nested region (inductor: "codegen invoke_subgraph is not implemented"), or its
    # layers attend through tierlm's kernel, whose one call a layer (rotary, K/V write and attention:
    # layers.rope_attention) leaves nothing to compile once; it mutates the cache, which a nested region's
    # functionalization cannot take from a custom op
    regions = (
        cc.scope == "model"
        and device.type == "cpu"
        and not kwargs.get("options", {}).get("cpp_wrapper")
        and not decoder.attends_through_kernel()
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
    inductor is called for this step's graphs and reports them. Once a graph is compiled, later calls of
    layers alike call it directly with the layer's tensors, without dynamo: the body runs once per layer
    per token, and dynamo's Python around each call (its frame hook, dispatch-key and eval-frame state,
    the disabled-frame wrappers) costs ~40-70 us a call on a 2-core Zen 3, more than some layers' compute.

    What a direct call passes is what the graph was traced with, found by identity: each graph input is a
    tensor the first call's layer holds (at an attribute path, the same in every layer alike) or one of its
    arguments (or an attribute of one: the cache view's tensors). Each layer (with its cache view) resolves
    those paths once, to the dictionary that holds each tensor (a module's parameters or buffers, an
    object's attributes) and its name: reading them through nn.Module's attribute lookup cost ~40 us a
    layer call for 17 inputs (AMX Xeon), ~1.2 ms a token over 30 layers, while a dictionary read follows
    whatever the streaming puts there. "Alike" is the key: the layer's class,
    its tensors' paths, shapes and dtypes and its plain attributes (flags, eps, window), and the same of
    every argument (a cache view's class, ring size and tensors). A key stays on dynamo's path where its
    first call did not compile exactly one graph (a graph break, or a graph dynamo already had), or where
    the graph has another input (a global tensor, a symbolic size), holds tensors of its own (weights
    frozen into it) or returns more than the layer's result."""

    def __init__(self, compile_kwargs: dict) -> None:
        kwargs = dict(compile_kwargs)
        backend = kwargs.pop("backend")
        options = kwargs.pop("options", None)
        if backend == "inductor":
            backend = _RecordingInductor(options or {}, kwargs.get("dynamic"), self)
        elif options:
            kwargs["options"] = options
        self.code_fn = _own_code(run_layer)
        self.dynamo = torch.compile(self.code_fn, backend=backend, **kwargs)
        self.direct: dict[tuple, tuple | None] = {}  # key -> (graph, inputs, held); None: dynamo's path
        # (id(layer), ids of the arguments whose attributes are inputs) -> (those objects, kept so that
        # their ids stay theirs, and each input's (dictionary, name), or (None, argument index))
        self.resolved: dict[tuple, tuple] = {}
        self.kinds: dict[tuple, int] = {}  # a structure (`_structure`) -> a small number standing for it
        self.kind_of: dict[int, int] = {}  # id(layer or cache view) -> its kind (they outlive the step)
        self.graphs: list[tuple | None] = []  # each compiled graph's direct call, by number (None: none)
        self.reports: list[tuple] | None = None  # the graphs compiled during the call dynamo is running
        self.used: list[int] = []  # the graphs (by number) dynamo ran during that call

    def __call__(self, layer, *args):
        key = (self._kind(layer), *[self._arg_key(a) for a in args])
        found = self.direct.get(key, False)
        if found:
            graph, inputs, held = found
            where = (id(layer), *[id(args[i]) for i in held])
            resolved = self.resolved.get(where)
            if resolved is None:
                resolved = self.resolved[where] = (
                    layer,
                    [args[i] for i in held],
                    _resolve(inputs, layer, args),
                )
            return graph(*[args[k] if d is None else d[k] for d, k in resolved[2]])[0]
        if found is None:
            return self.dynamo(layer, *args)
        self.direct[key], self.reports, self.used = None, [], []
        try:  # with every guard: the graph dynamo picks here is the one this kind of layer gets
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=False):
                out = self.dynamo(layer, *args)
            for gm, example_inputs, graph in self.reports:
                try:
                    self.graphs.append(_direct_call(gm, example_inputs, graph, layer, args))
                except Exception:  # whatever it was, dynamo's path stays right
                    log.debug("layer body: no direct call for a graph", exc_info=True)
                    self.graphs.append(None)
            # Dynamo ran one graph for the whole layer, by its guards right for this layer: call it
            # directly from now on (its inputs are attribute paths, the same in every layer it fits)
            if len(self.used) == 1 and len(self.reports) <= 1:
                self.direct[key] = self.graphs[self.used[0]]
            return out
        finally:
            self.reports = None

    def _arg_key(self, a):
        if isinstance(a, torch.Tensor):
            return a.shape, a.dtype, a.device
        if a is None or isinstance(a, (bool, int, float, str)):
            return type(a), a
        return self._kind(a)  # a cache view: the same object at every step

    def _kind(self, obj) -> int:
        kind = self.kind_of.get(id(obj))
        if kind is None:
            kind = self.kind_of[id(obj)] = self.kinds.setdefault(_structure(obj), len(self.kinds))
        return kind

    def _report(self, gm, example_inputs, graph):
        """Inductor compiled `graph` from `gm`: its number, for `_ran`, or None outside a first call."""
        if self.reports is None:
            return None
        self.reports.append((gm, example_inputs, graph))
        return len(self.graphs) + len(self.reports) - 1

    def _ran(self, number: int) -> None:
        self.used.append(number)


def _direct_call(gm, example_inputs, graph, layer, args) -> tuple | None:
    """(graph, inputs, held) to call `graph` directly with a layer's tensors, or None where it cannot be:
    each input a `_tensors` path, `held` the arguments some path reads an attribute of."""
    outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    if not (isinstance(outputs, (tuple, list)) and len(outputs) == 1):
        return None
    if any(node.op == "get_attr" for node in gm.graph.nodes):  # tensors of its own: frozen weights
        return None
    found = {id(t): path for t, path in _tensors(layer, args)}
    inputs = []
    for example in example_inputs:
        path = found.get(id(example)) if isinstance(example, torch.Tensor) else None
        if path is None:
            return None
        inputs.append(path)
    held = tuple(sorted({source for source, attribute in inputs if source >= 0 and attribute is not None}))
    return graph, inputs, held


class _RecordingInductor(torch._TorchCompileInductorWrapper):
    """torch.compile's inductor backend, reporting each graph it built to its LayerBody (held weakly:
    torch.compile keeps its backends in a process-wide table), which also learns when dynamo runs it."""

    def __init__(self, options: dict, dynamic, body: LayerBody) -> None:
        super().__init__(None, options, dynamic)
        self.body = weakref.ref(body)

    def __call__(self, model_, inputs_, **kwargs):
        compiled = super().__call__(model_, inputs_, **kwargs)
        body = self.body()
        number = None if body is None else body._report(model_, inputs_, compiled)
        if number is None:
            return compiled
        ran = weakref.WeakMethod(body._ran)

        @functools.wraps(compiled)
        def run(*args):  # dynamo's path only: tells the body which graph ran
            tell = ran()
            if tell is not None:
                tell(number)
            return compiled(*args)

        return run


def _structure(obj) -> tuple:
    """What a layer (or a cache view) is made of, as a hashable key: its class, its tensors' attribute paths,
    shapes, dtypes and devices, and its (and its parts') plain attributes: numbers, strings, flags."""
    tensors, plain = [], []
    for path, value in _module_attributes(obj, ""):
        if isinstance(value, torch.Tensor):
            tensors.append((path, tuple(value.shape), value.dtype, value.device))
        else:
            plain.append((path, value))
    return type(obj), tuple(tensors), tuple(plain)


def _module_attributes(obj, prefix: str, seen: set[int] | None = None) -> list[tuple[str, object]]:
    """(dotted attribute path, value) for every tensor and plain value (bool, int, float, str, None) `obj`
    holds: an nn.Module's parameters, buffers and attributes, its submodules', and those of tierlm objects
    it holds (a FusedProjections), each object once."""
    seen = set() if seen is None else seen
    seen.add(id(obj))
    out: list[tuple[str, object]] = []
    if isinstance(obj, torch.nn.Module):
        names = {**obj._parameters, **obj._buffers, **obj._modules}
        names.update((k, v) for k, v in vars(obj).items() if not k.startswith("_"))
    else:
        names = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    for name, value in names.items():
        path = f"{prefix}{name}"
        if isinstance(value, (torch.Tensor, bool, int, float, str, type(None))):
            out.append((path, value))
        elif id(value) in seen or not hasattr(value, "__dict__"):
            continue
        elif isinstance(value, torch.nn.Module) or type(value).__module__.startswith("tierlm."):
            out.extend(_module_attributes(value, path + ".", seen))
    return out


def _tensors(layer, args) -> list[tuple[torch.Tensor, tuple[int, str | None]]]:
    """(tensor, path) for every tensor a layer call can pass to its graph; a path is (-1, attribute path) in
    the layer, (i, None) for argument i, (i, attribute path) in argument i."""
    out = [(t, (-1, path)) for path, t in _module_attributes(layer, "") if isinstance(t, torch.Tensor)]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            out.append((a, (i, None)))
        elif hasattr(a, "__dict__"):
            out.extend((t, (i, path)) for path, t in _module_attributes(a, "") if isinstance(t, torch.Tensor))
    return out


def _resolve(inputs, layer, args) -> list[tuple[dict | None, str | int]]:
    """Each input path of one layer call as (the dictionary holding the tensor, its name), or (None, i) for
    argument i. A layer's modules stay what they are once its step is built (build unfuses projections
    before any call); the tensors in them may be replaced (streamed weights) and are read at every call."""
    out = []
    for source, path in inputs:
        if path is None:
            out.append((None, source))
            continue
        owner_path, _, name = path.rpartition(".")
        owner = layer if source < 0 else args[source]
        if owner_path:
            owner = operator.attrgetter(owner_path)(owner)
        where = vars(owner)
        if isinstance(owner, torch.nn.Module):
            where = next((d for d in (owner._parameters, owner._buffers) if name in d), where)
        out.append((where, name))
    return out


def _static_addresses(cache) -> None:
    """Every tensor the cache holds, marked static (cache.mark_static), but a continuous batch's row slots,
    which a step only reads and whose values change between steps (SlotCache: a static input is a constant
    to a frozen step)."""
    for name, value in vars(cache).items():
        if name == "row_slots":
            continue
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
    weight guards). A layer body's calls skip dynamo altogether once its graph is compiled (LayerBody):
    the first layer of each kind (sliding or full attention, fused or separate projections) goes through
    dynamo with full guards, the later ones call that kind's graph directly.
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
