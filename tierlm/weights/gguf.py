"""GGUF files via the `gguf` package: metadata -> ModelConfig, tensors -> dequantized torch tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from tierlm.config import ModelConfig
from tierlm.gguf_read import metadata, open_gguf
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
                raise ValueError(f"rope_freqs.weight is {freqs.tensor_type.name}, not F32")
            rope_freqs = None if freqs is None else [float(f) for f in np.asarray(freqs.data).ravel()]
            self.config = ModelConfig.from_gguf_metadata(meta, n_vocab_tensor=n_vocab, rope_freqs=rope_freqs)
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
