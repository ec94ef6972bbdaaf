"""Streaming offloaded modules: fetch weights right before a module runs, prefetch the next one, release after.

A unit is a module mapped to "cpu" (while an accelerator executes) or to "disk". Its weights live in a
source: pinned CPU tensors, or tensors memory-mapped from a safetensors file. While unit i runs, a
background thread already faults unit i+1's pages in (or copies it on a side CUDA stream); the order wraps
around, so the last unit of one step prefetches the first unit of the next. Pages faulted in once stay
(unless a RAM budget drops them after use) and are used in place on a CPU, with no thread involved. Eager
forwards stream through module hooks; a compiled layer body streams through `around_layers`, and an eager
decode step's layer program through `around_program`, which do the same fetch and release outside them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tierlm.weights.files import madvise_dontneed, page_span, populate

_LAYER = re.compile(r"^model\.layers\.\d+(?=$|\.)")


@dataclass
class Unit:
    """One offloaded module and where its weights come from."""

    name: str
    tier: str  # "cpu" or "disk"
    sources: dict[str, torch.Tensor]  # parameter name relative to the module -> source tensor
    # memory-mapped tensors the unit's forward reads that no parameter holds (a fused product's own, e.g.
    # int4 scales concatenated): faulted in and dropped with the sources
    extra: tuple[torch.Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sources.values())


class Streamer:
    """Installs fetch/release hooks on every offloaded unit of a decoder and runs the prefetch; `around_layers`
    streams the units of a layer around a layer function instead (a compiled body must not see hooks)."""

    def __init__(
        self, decoder: nn.Module, units: list[Unit], device: torch.device, drop_disk_pages: bool
    ) -> None:
        self.units, self.device, self.drop_disk_pages = units, device, drop_disk_pages
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tierlm-prefetch")
        self.pending: dict[int, Future] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.fetches = 0  # how many unit fetches ran (tests and stats read it)
        self.prefetched = 0  # how many of them found their weights under way or already in place
        self.mapped: set[int] = set()  # disk units whose pages are faulted in and not dropped since
        for unit in units:  # the layout compiled code expects of every layer, streamed or resident
            unit.sources = {k: _canonical(t) for k, t in unit.sources.items()}
        self.modules = [decoder.get_submodule(unit.name) for unit in units]
        self.hooks: dict[int, tuple[RemovableHandle, RemovableHandle]] = {}
        for i, module in enumerate(self.modules):
            self._hook(i)
            _assign(module, units[i].sources)
        # A forward without a layer function streams through the hooks: those `around_layers` took off
        # come back first (a compiled step passes its layer function by keyword, as Decoder.forward's
        # callers do)
        decoder.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self.by_layer: dict[int, list[int]] = {}  # id(layer module) -> the units at or under that layer
        for i, unit in enumerate(units):
            layer = _LAYER.match(unit.name)
            if layer:
                self.by_layer.setdefault(id(decoder.get_submodule(layer[0])), []).append(i)

    def _hook(self, i: int) -> None:
        module = self.modules[i]
        pre = module.register_forward_pre_hook(lambda _m, _args: self.fetch(i))
        post = module.register_forward_hook(lambda _m, _args, _out: self.release(i))
        self.hooks[i] = (pre, post)

    def _unhook(self, i: int) -> None:
        for handle in self.hooks.pop(i):
            handle.remove()

    def _before_forward(self, _module, _args, kwargs) -> None:
        if kwargs.get("layer_fn") is None and len(self.hooks) < len(self.modules):
            for i in range(len(self.modules)):
                if i not in self.hooks:
                    self._hook(i)

    def streams_layers(self) -> bool:
        """Whether any unit is a decoder layer or part of one."""
        return bool(self.by_layer)

    def around_layers(self, body: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """A layer function (Decoder.forward's layer_fn) that runs `body(layer, ...)` with the layer's streamed
        weights fetched (the next unit prefetched) before and released after, and with no hooks on the
        layer while `body` runs: a compiled body then sees the weights as plain inputs, never the streaming.
        The hooks stay off until a forward without a layer function needs them (`_before_forward`): taking
        two hooks off a unit and putting them back on every token cost ~5-9 us a streamed layer."""

        def layer_fn(layer: nn.Module, *args) -> torch.Tensor:
            units = self.by_layer.get(id(layer))
            if not units:
                return body(layer, *args)
            for i in units:
                if i in self.hooks:
                    self._unhook(i)
            return self._streaming(units, body, layer, *args)

        return layer_fn

    def _streaming(self, units: list[int], fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        """fn(*args) with `units` fetched (the next one prefetched) before and released after."""
        for i in units:
            self.fetch(i)
        try:
            return fn(*args)
        finally:
            for i in units:
                self.release(i)

    def around_program(self, layer: nn.Module, build: Callable[[], Callable | None]) -> Callable | None:
        """`layer`'s eager decode program (tierlm.models.programs), from build() -> program or None. A layer
        that streams gets one only where fetching never moves its weights (memory-mapped disk pages used in
        place on a CPU: the tensors a program keeps are the ones every fetch would give); its program fetches
        the layer's units (prefetching the next) before it runs and releases them after, as the hooks do
        around the module's forward (which costs the default model's eager int4 decode ~0.4 ms a streamed
        layer). build() runs with those hooks off, so that it sees only hooks of others."""
        units = self.by_layer.get(id(layer))
        if not units:
            return build()
        if not all(self._mapped_in_place(i) for i in units):
            return None  # fetch puts copies on the module: it runs as a module, through its hooks
        hooked = [i for i in units if i in self.hooks]
        for i in hooked:
            self._unhook(i)
        try:
            program = build()
        finally:
            for i in hooked:
                self._hook(i)
        return None if program is None else lambda *args: self._streaming(units, program, *args)

    def _load(self, i: int):
        """Bring unit i's weights to the execution device (on the prefetch thread, or on this one when no
        prefetch was under way)."""
        with torch.inference_mode(False):  # copies are alike from either thread (compiled code guards on it)
            return self._load_unit(i)

    def _load_unit(self, i: int):
        unit = self.units[i]
        if unit.tier == "disk" and i not in self.mapped:
            # Fault the pages in once; they stay mapped unless dropped after use (a RAM budget) or
            # reclaimed by the kernel (then the forward faults them in itself). Re-populating mapped
            # pages every token would only walk page tables on a core the forward needs.
            populate([*unit.sources.values(), *unit.extra])
            self.mapped.add(i)
        if self._mapped_in_place(i):
            return unit.sources, None  # memory-mapped weights are used in place
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                out = {k: t.to(self.device, non_blocking=True) for k, t in unit.sources.items()}
                event = torch.cuda.Event()
                event.record(self.stream)
            return out, event
        return {k: t.to(self.device, copy=True) for k, t in unit.sources.items()}, None

    def _mapped_in_place(self, i: int) -> bool:
        """Whether unit i's weights on its module are its memory-mapped sources themselves (disk pages on a
        CPU), which no fetch or release moves."""
        return self.device.type == "cpu" and self.units[i].tier == "disk"

    def _in_place(self, i: int) -> bool:
        """Whether unit i's weights are used where they are with nothing to do first: memory-mapped pages on a
        CPU, faulted in and not dropped since. Such a unit is never handed to the prefetch thread: waking it
        for no work costs a 2-core CPU more than the thread could save (bf16 layer-compiled decode with every
        layer on disk 22.6 -> 27.1 tok/s, resident 28.2, interleaved in one process on a Zen 3)."""
        return self._mapped_in_place(i) and i in self.mapped

    def fetch(self, i: int) -> None:
        """Put unit i's weights on its module (waiting for its prefetch if under way); prefetch unit i+1."""
        module = self.modules[i]
        future = self.pending.pop(i, None)
        self.fetches += 1
        if future is not None:
            self.prefetched += 1
            tensors, event = future.result()
        elif self._in_place(i):
            self.prefetched += 1
            tensors, event = self.units[i].sources, None
        else:
            tensors, event = self._load(i)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in tensors.values():
                t.record_stream(current)  # allocated on the side stream, used (and freed) on this one
        if tensors is not self.units[i].sources:  # memory-mapped weights used in place are already there
            _assign(module, tensors)
        nxt = (i + 1) % len(self.units)
        if nxt not in self.pending and not self._in_place(nxt):
            self.pending[nxt] = self.pool.submit(self._load, nxt)

    def release(self, i: int) -> None:
        """Point unit i's module back at its sources (device copies go); drop its pages under a RAM budget."""
        unit, module = self.units[i], self.modules[i]
        if not self._mapped_in_place(i):
            _assign(module, unit.sources)  # the device copies go; the sources stay
        if unit.tier == "disk" and self.drop_disk_pages:
            self.mapped.discard(i)
            for t in [*unit.sources.values(), *unit.extra]:
                self._drop_pages(t)

    def _drop_pages(self, t: torch.Tensor) -> None:
        """Unmap a memory-mapped tensor's pages so a RAM budget holds (the file is re-read next time)."""
        madvise_dontneed(*page_span(t))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def canonical_strides(module: nn.Module) -> None:
    """Give each contiguous tensor of `module` the strides a fresh contiguous tensor of its shape has (a view).

    A size-1 dimension's stride is arbitrary (an int4 scale of one group may carry 2 or 256) and compiled
    code guards on it, so a resident layer and a streamed one would otherwise compile twice."""
    _assign(module, {n: c for n, t in _tensors(module) if (c := _canonical(t)) is not t})


def _tensors(module: nn.Module):
    return [*module.named_parameters(), *module.named_buffers()]


def _canonical(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        return t
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    strides.reverse()
    if tuple(strides) == t.stride():
        return t
    return t.detach().as_strided(t.shape, strides, t.storage_offset())


def _assign(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if leaf in owner._buffers:  # packed int8 / int4 weights are buffers
            owner._buffers[leaf] = t
        else:
            owner._parameters[leaf] = nn.Parameter(t, requires_grad=False)
