"""Streaming offloaded modules: fetch weights right before a module runs, prefetch the next one, release after.

A unit is a module mapped to "cpu" (while an accelerator executes) or to "disk". Its weights live in a
source: pinned CPU tensors, or tensors memory-mapped from a safetensors file. While unit i runs, a
background thread already faults unit i+1's pages in (or copies it on a side CUDA stream); the order wraps around, so the last
unit of one step prefetches the first unit of the next.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from tierlm.weights.files import madvise_dontneed, page_span, populate


@dataclass
class Unit:
    """One offloaded module and where its weights come from."""

    name: str
    tier: str  # "cpu" or "disk"
    sources: dict[str, torch.Tensor]  # parameter name relative to the module -> source tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sources.values())


class Streamer:
    """Installs fetch/release hooks on every offloaded unit of a decoder and runs the prefetch."""

    def __init__(
        self, decoder: nn.Module, units: list[Unit], device: torch.device, drop_disk_pages: bool
    ) -> None:
        self.units, self.device, self.drop_disk_pages = units, device, drop_disk_pages
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tierlm-prefetch")
        self.pending: dict[int, Future] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.fetches = 0  # how many unit fetches ran (tests and stats read it)
        self.prefetched = 0  # how many of them were already under way when needed
        self.mapped: set[int] = set()  # disk units whose pages are faulted in and not dropped since
        for i, unit in enumerate(units):
            module = decoder.get_submodule(unit.name)
            module.register_forward_pre_hook(partial(self._fetch, i))
            module.register_forward_hook(partial(self._release, i))
            _assign(module, unit.sources)

    def _load(self, i: int):
        """Bring unit i's weights to the execution device (runs on the prefetch thread)."""
        unit = self.units[i]
        if unit.tier == "disk" and i not in self.mapped:
            # Fault the pages in once; they stay mapped unless dropped after use (a RAM budget) or
            # reclaimed by the kernel (then the forward faults them in itself). Re-populating mapped
            # pages every token would only walk page tables on a core the forward needs.
            populate(unit.sources.values())
            self.mapped.add(i)
        if self.device.type == "cpu" and unit.tier == "disk":
            return unit.sources, None  # memory-mapped weights are used in place
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                out = {k: t.to(self.device, non_blocking=True) for k, t in unit.sources.items()}
                event = torch.cuda.Event()
                event.record(self.stream)
            return out, event
        return {k: t.to(self.device, copy=True) for k, t in unit.sources.items()}, None

    def _fetch(self, i: int, module: nn.Module, _args) -> None:
        future = self.pending.pop(i, None)
        self.fetches += 1
        if future is not None:
            self.prefetched += 1
            tensors, event = future.result()
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
        if nxt not in self.pending:
            self.pending[nxt] = self.pool.submit(self._load, nxt)

    def _release(self, i: int, module: nn.Module, _args, _output) -> None:
        unit = self.units[i]
        if not (unit.tier == "disk" and self.device.type == "cpu"):
            _assign(module, unit.sources)  # the device copies go; the sources stay
        if unit.tier == "disk" and self.drop_disk_pages:
            self.mapped.discard(i)
            for t in unit.sources.values():
                self._drop_pages(t)

    def _drop_pages(self, t: torch.Tensor) -> None:
        """Unmap a memory-mapped tensor's pages so a RAM budget holds (the file is re-read next time)."""
        madvise_dontneed(*page_span(t))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _assign(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if leaf in owner._buffers:  # packed int8 / int4 weights are buffers
            owner._buffers[leaf] = t
        else:
            owner._parameters[leaf] = nn.Parameter(t, requires_grad=False)
