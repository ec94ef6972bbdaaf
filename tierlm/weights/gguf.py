"""GGUF files via the `gguf` package: metadata -> ModelConfig, tensors -> dequantized torch tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from tierlm.config import ModelConfig
from tierlm.errors import ModelFileError
from tierlm.gguf_read import metadata, open_gguf
from tierlm.weights import gguf_blocks
from tierlm.weights.files import file_identity
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
    # i-quants, ternary and 4-bit float blocks: dequantized by gguf-py's reference code (tested against ggml's)
    *(getattr(Q, n) for n in ("IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS")),
    *(getattr(Q, n) for n in ("IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4") if hasattr(Q, n)),
)


class GGUFCheckpoint:
    """A GGUF file; tensors are dequantized one at a time from the memory-mapped file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = open_gguf(self.path)
        self.metadata = metadata(self.reader, token_arrays=False)
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
        freqs = next((t for t in self.reader.tensors if t.name == "rope_freqs.weight"), None)
        try:
            if freqs is not None and freqs.tensor_type != Q.F32:
                raise ModelFileError(f"rope_freqs.weight is {freqs.tensor_type.name}, not F32")
            rope_freqs = None if freqs is None else [float(f) for f in np.asarray(freqs.data).ravel()]
            self.config = ModelConfig.from_gguf_metadata(meta, n_vocab_tensor=n_vocab, rope_freqs=rope_freqs)
        except ValueError as e:
            raise ModelFileError(f"GGUF metadata of {self.path}: {e}") from None
        for t in self.tensors.values():
            if t.tensor_type not in SUPPORTED_TYPES:
                supported = ", ".join(q.name for q in SUPPORTED_TYPES)
                raise ModelFileError(
                    f"{self.path.name}: tensor {t.name} has unsupported type {t.tensor_type.name}; "
                    f"supported: {supported}"
                )

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        """The file's checkpoint, its header parsed once per process while the file is unchanged (a plan, the
        default quantization and the load all read it; parsing a large vocabulary's header takes ~0.3 s)."""
        key = file_identity(Path(path))
        if _opened.get("key") != key:
            _opened.clear()
            _opened.update(key=key, checkpoint=cls(path))
        return _opened["checkpoint"]

    def release_pages(self, name: str | None = None) -> None:
        """Drop the file's pages (of tensor `name`, else all) from this process's resident set: MADV_DONTNEED on
        its read-only mapping. Every tensor read is a copy, so the pages only counted against it; a later read
        maps them again from the page cache or the file."""
        import mmap

        mapping = getattr(self.reader.data, "_mmap", None)
        if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, length = 0, len(mapping)
        if name is not None:
            t = self.tensors[name]
            start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
            length = min(int(t.data_offset) + int(t.n_bytes), len(mapping)) - start
        mapping.madvise(mmap.MADV_DONTNEED, start, length)

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def dtype(self, name: str) -> torch.dtype:
        t = self.tensors[name]
        return {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(t.tensor_type, torch.float32)

    def nbytes(self, name: str) -> int:
        return int(self.tensors[name].n_bytes)

    def kind(self, name: str) -> str:
        """The tensor's GGUF type name, e.g. "Q4_K"."""
        return self.tensors[name].tensor_type.name

    def int4_parts(
        self, name: str, block: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A projection weight stored as 4-bit codes on a grid of 32 (Q4_0, Q4_1, Q4_K) as those codes, their
        scales and zeros in Hugging Face row order (tierlm.weights.gguf_blocks; block: the codes packed in
        torch's CPU int4 layout of that many rows); None for another type."""
        kind = self.kind(name)
        if kind not in gguf_blocks.INT4_TYPES or len(self.shape(name)) != 2:
            return None
        rows = self.shape(name)[0]
        order = None
        heads = self._permuted_heads(name)
        if heads is not None:
            order = unpermute_qk(torch.arange(rows), heads)
        parts = gguf_blocks.int4_parts(self.tensors[name].data, kind, order, block)
        self.release_pages(name)
        return parts

    def _permuted_heads(self, name: str) -> int | None:
        """The head count whose q/k row permutation llama.cpp applied to this tensor, or None."""
        cfg = self.config
        if not cfg.family.gguf_permuted_qk:
            return None
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            return cfg.num_heads
        if name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
            return cfg.num_kv_heads
        return None

    def load(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor dequantized to fp32 (or its stored float dtype), in Hugging Face layout; dtype: blocks
        dequantized into that dtype a chunk of rows at a time (no fp32 copy of the whole tensor)."""
        t = self.tensors[name]
        if t.tensor_type == Q.BF16:
            data = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
        elif t.tensor_type in (Q.F32, Q.F16):
            data = torch.from_numpy(np.array(t.data))
        else:
            data = _dequantize_rows(t.data, t.tensor_type, dtype or torch.float32)
        self.release_pages(name)  # `data` is a copy
        data = data.reshape(self.shape(name))
        return self._fix(name, data)

    def _fix(self, name: str, data: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if cfg.family.gemma_norms and name.endswith("norm.weight"):
            return data - 1.0  # llama.cpp stores Gemma's norm weights as (1 + w); HF's modules add the 1
        heads = self._permuted_heads(name)
        return data if heads is None else unpermute_qk(data, heads)


_opened: dict = {}  # GGUFCheckpoint.open's one parsed header


def _dequantize_rows(
    raw: np.ndarray, qtype: Q, dtype: torch.dtype = torch.float32, rows_per_chunk: int = 2048
) -> torch.Tensor:
    """Dequantize block by block of rows into one tensor of `dtype`, so temporaries stay small."""
    first = dequantize(raw[:1], qtype)
    out = torch.empty((raw.shape[0], first.shape[-1]), dtype=dtype)
    for start in range(0, raw.shape[0], rows_per_chunk):
        chunk = dequantize(raw[start : start + rows_per_chunk], qtype)
        out[start : start + chunk.shape[0]] = torch.from_numpy(chunk)
    return out
