"""Reading a GGUF file's header: the one place the `gguf` package's reader is opened and its metadata decoded,
for the weights (tierlm.weights.gguf) and the vocabulary (tierlm.tokenizer.gguf_vocab) alike."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType
from gguf import GGMLQuantizationType as Q

from tierlm.errors import ModelFileError


def is_gguf(path: Path) -> bool:
    """Whether `path` is a GGUF file: named *.gguf (any case) or starting with GGUF's magic (a .bin)."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader; a missing file is FileNotFoundError, a damaged one one ModelFileError naming the metadata
    key or tensor that could not be read."""
    if path.is_dir():
        raise ModelFileError(f"{path} is a folder, not a GGUF file")
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    reader = _LocatingReader.__new__(_LocatingReader)  # built in two steps: a failed one is still there
    try:
        reader.__init__(path)
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors on damaged files
        where = str(e)
        if getattr(reader, "phase", None):  # past the magic and version: say what it was reading
            try:
                where = reader.failed_at(path)
            except Exception:  # a file damaged past describing: gguf's own message
                pass
        raise ModelFileError(f"cannot read {path} as GGUF (truncated or corrupt?): {where}") from None
    return reader


class _LocatingReader(GGUFReader):
    """GGUFReader that remembers what it was reading, so a damaged file's error names the metadata key or
    the tensor instead of numpy's complaint about it."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None):
        """gguf's `_get` on a plain ndarray view of the memory map: slicing the np.memmap itself runs its
        Python-level finalizer per slice, which made a 262k-token vocabulary's header take ~40 s to parse."""
        dtype, count = np.dtype(dtype), int(count)
        end = offset + dtype.itemsize * count
        if end > len(self.data):  # numpy would cut it short
            raise ValueError("read past the end of the file")
        order = self.byte_order if override_order is None else override_order
        return self._plain_data()[offset:end].view(dtype.newbyteorder(order))

    def _plain_data(self) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None or plain.base is not self.data:
            plain = self._plain = self.data.view(np.ndarray)
        return plain

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        """gguf's parts of one metadata value, with arrays of numbers read as one array (one part) and
        arrays of strings without a call per element into the generic reader: a 262k-token vocabulary's
        three arrays otherwise take seconds. The parts still cover the value's bytes exactly. Unlike gguf's
        own fields, an array of numbers has one data index (its whole array), so gguf's
        `ReaderField.contents()` does not read them: `metadata()` does."""
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count, offs = int(raw_itype[0]), int(alen[0]), orig_offs + 12
        if count == 0:  # gguf's reader accepts an empty array of any element type, known or not
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY, GGUFValueType(itype)]
        nptype = self.gguf_scalar_to_np.get(types[1])
        if nptype is not None:
            values = self._get(offs, nptype, count)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types
        if types[1] != GGUFValueType.STRING:  # arrays of arrays: the generic reader
            return super()._get_field_parts(orig_offs, raw_type)
        parts, data = [raw_itype, alen], []
        swapped = {"little": "big", "big": "little"}[sys.byteorder]
        order = swapped if self.byte_order == "S" else sys.byteorder  # "I": the file's order is native
        view = memoryview(self._plain_data())
        for _ in range(count):
            if offs + 8 > len(view):
                raise ValueError("read past the end of the file")
            n = int.from_bytes(view[offs : offs + 8], order)
            length, text = self._get(offs, np.uint64), self._get(offs + 8, np.uint8, n)
            data.append(len(parts) + 1)
            parts += (length, text)
            offs += 8 + n
        return offs - orig_offs, parts, data, types

    def _push_field(self, field, skip_sum: bool = False) -> int:
        self.phase, self.last_field = "metadata", field
        return super()._push_field(field, skip_sum)

    def _build_tensor_info(self, offs: int, count: int):
        self.phase, self.infos, self.info_count = "tensor info", [], int(count)
        return super()._build_tensor_info(offs, count)

    def _get_tensor_info_field(self, orig_offs: int):
        self.info_offset = orig_offs
        field = super()._get_tensor_info_field(orig_offs)
        self.infos.append(field)
        return field

    def _build_tensors(self, start_offs: int, fields) -> None:
        self.phase, built = "tensors", []
        for field in fields:  # one at a time, to know which one fails
            self.current = field
            super()._build_tensors(start_offs, [field])
            if any(t.name == self.tensors[0].name for t in built):
                raise ValueError(f"tensor {self.tensors[0].name} appears twice")
            built.extend(self.tensors)
        self.tensors = built

    def failed_at(self, path: Path) -> str:
        """What could not be read: a metadata key, a tensor's description, or a tensor's data."""
        if self.phase == "metadata" and self.last_field.name == "GGUF.version":
            return "the header's tensor and metadata counts could not be read"
        if self.phase == "metadata":
            last = self.last_field
            key = self._string_at(last.offset + sum(int(p.nbytes) for p in last.parts))
            named = f'key "{key}"' if key else f'entry after "{last.name}"'
            return f"metadata {named} could not be read"
        if self.phase == "tensor info" and len(self.infos) == self.info_count:
            return "the tensor data offset could not be found (bad general.alignment?)"
        if self.phase == "tensor info":
            name = self._string_at(self.info_offset)
            n = len(self.infos) + 1
            return f"the description of tensor {name or n} ({n} of {self.info_count}) could not be read"
        name = str(bytes(self.current.parts[1]), encoding="utf-8")
        return f"tensor {name} could not be read ({self._data_problem(path)})"

    def _string_at(self, offs: int) -> str | None:
        """A GGUF string (u64 length, utf-8 bytes) at `offs`, if one is readable there."""
        try:
            _, data = self._get_str(offs)
            text = str(bytes(data), encoding="utf-8")
        except Exception:
            return None
        return text if 0 < len(text) <= 256 and text.isprintable() else None

    def _data_problem(self, path: Path) -> str:
        _, _, _, dims, raw_type, offset = self.current.parts
        try:
            block, type_size = GGML_QUANT_SIZES[Q(int(raw_type[0]))]
        except (ValueError, KeyError):
            return f"unknown tensor type {int(raw_type[0])}"
        end = self.data_offset + int(offset[0]) + int(np.prod(dims.astype(np.float64))) * type_size // block
        size = path.stat().st_size
        return (
            f"its data ends at byte {end}, past the end of the file at {size}"
            if end > size
            else "its shape does not fit its type"
        )


def metadata(
    reader: GGUFReader, include: Callable[[str], bool] = lambda key: True, token_arrays: bool = True
) -> dict[str, Any]:
    """The key/values `include` accepts, as Python values (strings decoded leniently, as llama.cpp does).
    Without `token_arrays`, the large `tokenizer.ggml.*` arrays are skipped (only the vocabulary needs them).
    A value that cannot be decoded is left out: it is metadata tierlm does not read."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        is_array = field.types[:1] == [GGUFValueType.ARRAY]
        if not include(key) or (not token_arrays and is_array and key.startswith("tokenizer.ggml.")):
            continue
        try:
            meta[key] = _value(field, is_array)
        except Exception:
            continue
    return meta


def _value(field: Any, is_array: bool) -> Any:
    def scalar(part: Any) -> Any:
        if field.types[-1] == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0]

    if is_array and field.types[-1] != GGUFValueType.STRING:  # numbers: one part per array (_LocatingReader)
        return [v for i in field.data for v in field.parts[i].tolist()]
    values = [scalar(field.parts[i]) for i in field.data]
    return values if is_array else values[0]
