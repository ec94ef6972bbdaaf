"""Hugging Face folders: config.json plus one model.safetensors or shards with an index; read lazily."""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from tierlm.config import ModelConfig
from tierlm.errors import ModelFileError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    """A Hugging Face checkpoint folder; tensors are read one at a time from memory-mapped files."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder)
        if not self.path.is_dir():
            raise FileNotFoundError(f"model folder {self.path} does not exist")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"model folder {self.path} has no config.json")
        self._init(ModelConfig.from_hf_json(config_path), _weight_files(self.path))

    @classmethod
    def from_file(cls, file: Path, config: ModelConfig) -> SafetensorsCheckpoint:
        """One safetensors file in HF naming, with a config known from elsewhere (e.g. a GGUF cache)."""
        self = cls.__new__(cls)
        self.path = file.parent
        self._init(config, {name: file for name in _open(file).keys()})
        return self

    def _init(self, config: ModelConfig, files: dict[str, Path]) -> None:
        self.config = config
        self.files = files  # HF name -> file
        self._headers: dict[Path, tuple[int, dict]] = {}
        self._handles = {f: _open(f) for f in sorted(set(files.values()))}
        # open now: memory-mapped later from these, a file removed meanwhile (`tierlm cache clear` in
        # another process) still reads
        self._opened = {f: open(f, "rb") for f in self._handles}  # noqa: SIM115 (closed by the finalizer)
        weakref.finalize(self, _close_all, list(self._opened.values()))
        self._check_index()

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.files[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._handles[self.files[name]].get_slice(name).get_dtype()]

    def nbytes(self, name: str) -> int:
        n = 1
        for d in self.shape(name):
            n *= d
        return n * self.dtype(name).itemsize

    def load_mapped(self, name: str) -> torch.Tensor:
        """The tensor as stored, zero-copy: memory-mapped from its file (copy-on-write, the file never changes)."""
        file = self.files[name]
        if file not in self._headers:
            self._headers[file] = header(self._opened[file])
        return mmap_tensors(self._opened[file], [name], self._headers[file])[name]

    def load(self, name: str) -> torch.Tensor:
        """The tensor as stored (CPU, the checkpoint's dtype)."""
        try:
            return self._handles[self.files[name]].get_tensor(name)
        except SafetensorError as e:
            raise ModelFileError(f"cannot read tensor {name} from {self.files[name]}: {e}") from None

    def _check_index(self) -> None:
        for file, handle in self._handles.items():
            present = set(handle.keys())
            missing = [n for n, f in self.files.items() if f == file and n not in present]
            if missing:
                raise ModelFileError(f"{file.name} lacks tensors its index lists: {', '.join(missing[:5])}")


# safetensors dtype codes <-> torch dtypes: the one table for reading and writing safetensors files.
DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file: model.safetensors when the folder has it (as transformers chooses, beside an
    index too), else the shards its index names."""
    index, single = folder / INDEX, folder / SINGLE
    if index.is_file() and not single.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ModelFileError(f"{index} is not a valid safetensors index: {e!r}") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items()
        ):
            raise ModelFileError(
                f"{index} is not a valid safetensors index: weight_map must map names to file names"
            )
        files = {name: folder / file for name, file in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} named in {INDEX} is missing from {folder}")
        return files
    if not single.is_file():
        raise FileNotFoundError(f"model folder {folder} has no {SINGLE} or {INDEX}")
    return {name: single for name in _open(single).keys()}


def _open(file: Path):
    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ModelFileError(
            f"{file} is not a readable safetensors file (truncated or corrupt?): {e}"
        ) from None
    _check_size(file)
    return handle


def _check_size(file: Path) -> None:
    """A truncated file can have an intact header; check that the data section is all there."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    actual = file.stat().st_size - 8 - header_len
    if actual < end:
        raise ModelFileError(
            f"{file} is truncated: its header describes {end} bytes of data but {actual} are present"
        )


# The numpy dtype a memory-mapped tensor's bytes are read as before its torch view (numpy has no bf16).
NP_VIEWS = {"F32": "float32", "F16": "float16", "BF16": "int16", "I8": "int8", "U8": "uint8", "I32": "int32"}


def header(file: Path | BinaryIO) -> tuple[int, dict]:
    """(data start offset, header dict) of a safetensors file, by its path or an open binary file."""
    if isinstance(file, (str, Path)):
        with open(file, "rb") as f:
            return header(f)
    fd = file.fileno()  # pread: the file object's position is not this reader's
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    return 8 + n, json.loads(os.pread(fd, n, 8))


def _close_all(files: list[BinaryIO]) -> None:
    for f in files:
        f.close()


def mmap_tensors(
    file: Path | BinaryIO, names: list[str], parsed: tuple[int, dict] | None = None
) -> dict[str, torch.Tensor]:
    """Zero-copy tensors backed by the file's pages (file-backed memory the kernel can drop and re-read).

    The mapping is copy-on-write: writing to a tensor gives the process a private page, never a changed file.
    """
    import numpy as np

    start, head = parsed or header(file)
    out = {}
    for name in names:
        info = head[name]
        np_dtype, dtype = NP_VIEWS[info["dtype"]], DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = (end - begin) // np.dtype(np_dtype).itemsize
        arr = np.memmap(file, dtype=np_dtype, mode="c", offset=start + begin, shape=(count,))
        out[name] = torch.from_numpy(arr).view(dtype).view(info["shape"])
    return out
