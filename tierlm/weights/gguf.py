"""GGUF files via the `gguf` package: metadata -> ModelConfig, tensors -> dequantized torch tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from tierlm.config import ModelConfig
from tierlm.weights.names import gguf_to_hf_name, unpermute_qk

SUPPORTED_TYPES = (
    Q.F32,
    Q.F16,
    Q.BF16,
    Q.Q8_0,
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
)


class GGUFCheckpoint:
    """A GGUF file; tensors are dequantized one at a time from the memory-mapped file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        self.reader = _read(self.path)
        self.metadata = read_metadata(self.reader)
        self.reader.fields.clear()  # ~160 MB of per-token Python objects; the tensors do not need them
        self.tensors = {}
        arch = self.metadata.get("general.architecture")
        for t in self.reader.tensors:
            hf = gguf_to_hf_name(t.name, arch)
            if hf is not None:
                self.tensors[hf] = t
        tied = "lm_head.weight" not in self.tensors
        meta = {**self.metadata, "tierlm.tied_embeddings": tied}
        embed = self.tensors.get("model.embed_tokens.weight")
        n_vocab = int(embed.shape[-1]) if embed is not None else None
        try:
            self.config = ModelConfig.from_gguf_metadata(meta, n_vocab_tensor=n_vocab)
        except ValueError as e:
            raise ValueError(f"GGUF metadata of {self.path}: {e}") from None
        for t in self.tensors.values():
            if t.tensor_type not in SUPPORTED_TYPES:
                supported = ", ".join(q.name for q in SUPPORTED_TYPES)
                raise ValueError(
                    f"{self.path.name}: tensor {t.name} has unsupported type {t.tensor_type.name}; "
                    f"supported: {supported}"
                )

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def dtype(self, name: str) -> torch.dtype:
        t = self.tensors[name]
        return {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(t.tensor_type, torch.float32)

    def nbytes(self, name: str) -> int:
        return int(self.tensors[name].n_bytes)

    def load(self, name: str) -> torch.Tensor:
        """The tensor dequantized to fp32 (or its stored float dtype), in Hugging Face layout."""
        t = self.tensors[name]
        if t.tensor_type == Q.BF16:
            data = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
        elif t.tensor_type in (Q.F32, Q.F16):
            data = torch.from_numpy(np.array(t.data))
        else:
            data = _dequantize_rows(t.data, t.tensor_type)
        data = data.reshape(self.shape(name))
        return self._fix(name, data)

    def _fix(self, name: str, data: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if cfg.family.gemma_norms and name.endswith("norm.weight"):
            return data - 1.0  # llama.cpp stores Gemma's norm weights as (1 + w); HF's modules add the 1
        if not cfg.family.gguf_permuted_qk:
            return data
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            return unpermute_qk(data, cfg.num_heads)
        if name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
            return unpermute_qk(data, cfg.num_kv_heads)
        return data


def _dequantize_rows(raw: np.ndarray, qtype: Q, rows_per_chunk: int = 2048) -> torch.Tensor:
    """Dequantize block by block of rows into one fp32 tensor, so temporaries stay small."""
    first = dequantize(raw[:1], qtype)
    out = torch.empty((raw.shape[0], first.shape[-1]), dtype=torch.float32)
    for start in range(0, raw.shape[0], rows_per_chunk):
        chunk = dequantize(raw[start : start + rows_per_chunk], qtype)
        out[start : start + chunk.shape[0]] = torch.from_numpy(chunk)
    return out


def _read(path: Path) -> GGUFReader:
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
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {where}") from None
    return reader


class _LocatingReader(GGUFReader):
    """GGUFReader that remembers what it was reading, so a damaged file's error names the metadata key or
    the tensor instead of numpy's complaint about it."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None):
        if offset + np.dtype(dtype).itemsize * int(count) > len(self.data):  # numpy would cut it short
            raise ValueError("read past the end of the file")
        return super()._get(offset, dtype, count, override_order)

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


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """GGUF key/values as Python values; large token arrays are skipped (the tokenizer reads those)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and field.types[:1] == [GGUFValueType.ARRAY]:
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # unreadable values are metadata tierlm does not need
            continue
    return meta
