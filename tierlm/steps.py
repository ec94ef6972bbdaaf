"""Compiled decode steps, built only after compile.decide() said yes, once per shape, and reused.

A step is keyed by (compile config, batch, cache length, dtype, cache kind) and closes over its cache: a
static cache's step and a continuous batch's (SlotCache) of one shape read different tensors and are never
taken for each other. Steps packaged ahead of time (tierlm.aot) are loaded here too, when they apply.
"""

from __future__ import annotations

import logging
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
    layer_fn = torch.compile(run_layer, **kwargs) if cc.scope == "layer" else None
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
    own = None if cc.scope == "layer" else _own_code(decode_step)
    compiled = decode_step if own is None else torch.compile(own, **kwargs)
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
    step's graphs are its alone, and CompiledStep frees them when it goes. (A layer-scope step compiles
    `run_layer` itself, shared by all of them: a second shape recompiles it with dynamic shapes.)"""
    own = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    own.__qualname__ = fn.__qualname__
    return own


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
    weight guards); a layer body is called once per layer, so it saves a guard evaluation per layer (on a
    Zen 3, resident layer-compiled decode went from 45 to 49 tok/s int4; streamed layers, whose fetches
    dominate, within noise). Its first call ran every layer with full guards, so every layer
    kind it meets (sliding or full attention, fused or separate projections, another
    step's batch shape) has its entry by then, and the entries' differing guards still pick among them.
    `length` is not read: the step always attends over the whole cache.
    """

    def __init__(self, compiled, cache, freezing: bool, skip_guards: bool, what: str, own=None) -> None:
        self.compiled, self.cache = compiled, cache
        self.freezing, self.skip_guards, self.what = freezing, skip_guards, what
        self.traced = False
        if own is not None:  # a whole step's function, with a code object of its own (_own_code)
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
