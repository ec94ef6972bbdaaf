"""Writing safetensors files whose header is known before the tensors are: one writer for every file tierlm
derives (the GGUF cache's weights, float and packed offload folders), streaming the tensors one at a time."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from tierlm.errors import ModelFileError
from tierlm.weights.safetensors import CODES


def write_safetensors(
    path: Path,
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    align: int | None = None,
) -> None:
    """Stream (name, tensor) pairs, in the order of `specs` ({name: (dtype, shape)}), into `path`.

    The data starts on an 8-byte boundary (or an `align` one). With `align`, every tensor starts at a
    multiple of `align` bytes in the file, a memory-mapped tensor being only as aligned as its offset:
    "~pad.N" byte tensors fill the gaps, so the file stays valid safetensors (no holes).
    """
    header, gaps = _layout(specs, align or 1)
    blob = json.dumps(header).encode()
    blob += b" " * (-(8 + len(blob)) % max(align or 8, 8))
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, t in tensors:
            dtype, shape = specs[name]
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ModelFileError(f"tensor {name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
            f.write(bytes(gaps.get(name, 0)))
            f.write(t.detach().contiguous().cpu().view(torch.uint8).numpy().data)


def _layout(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], align: int) -> tuple[dict, dict]:
    """The header entries (padding entries before the tensors they align) and each tensor's gap in bytes."""
    header, gaps, offset = {}, {}, 0
    for i, (name, (dtype, shape)) in enumerate(specs.items()):
        gap = -offset % align
        if gap:
            header[f"~pad.{i}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            gaps[name], offset = gap, offset + gap
        nbytes = dtype.itemsize * math.prod(shape)
        header[name] = {
            "dtype": CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    return header, gaps
