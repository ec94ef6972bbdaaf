"""Streaming offloaded modules: fetch weights right before a module runs, prefetch the next one, release after.

A unit is a module mapped to "cpu" (while an accelerator executes) or to "disk". Its weights live in a
source: pinned CPU tensors, or tensors memory-mapped from a safetensors file. While unit i runs, a
background thread already faults unit i+1's pages in (or copies it on a side CUDA stream); the order wraps around, so the last
unit of one step prefetches the first unit of the next.
"""

from __future__ import annotations

import ctypes
import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22
_LIBC = ctypes.CDLL(None, use_errno=True)


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


def populate(tensors) -> None:
    """Fault memory-mapped tensors' pages in ahead of use (reading the file only where the page cache lacks
    them), without copying: MADV_POPULATE_READ, or MADV_WILLNEED read-ahead on kernels before 5.14."""
    for t in tensors:
        addr, length = page_span(t)
        if _LIBC.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_POPULATE_READ) != 0:
            _LIBC.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_WILLNEED)


def madvise_dontneed(addr: int, length: int) -> None:
    """MADV_DONTNEED over [addr, addr + length): only for file-backed memory (anonymous pages would read
    back as zeros)."""
    _LIBC.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_DONTNEED)


def file_mappings() -> list[tuple[int, int, int, Path]]:
    """(start, end, file offset, path) of this process's file-backed mappings (/proc/self/maps)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, int(parts[2], 16), Path(parts[5])))
    return out


def page_span(t: torch.Tensor) -> tuple[int, int]:
    page = mmap.PAGESIZE
    start = t.data_ptr()
    aligned = start - start % page
    return aligned, t.numel() * t.element_size() + (start - aligned)
