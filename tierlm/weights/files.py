"""Low-level memory-mapped file helpers: page spans of tensors, madvise, this process's file mappings.

Nothing here knows about models or tiers; `weights.layout` and `placement.offload` build on it.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22
_LIBC = ctypes.CDLL(None, use_errno=True)


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
