"""A disk cache of dequantized GGUF weights, keyed by the GGUF file's identity and the dtype.

Parsing a GGUF header and dequantizing takes seconds; a cached safetensors file loads in a fraction.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from pathlib import Path

import torch

from tierlm.config import ModelConfig, RopeScaling, cache_root
from tierlm.gguf_read import is_gguf
from tierlm.weights import safetensors_write
from tierlm.weights.files import atomic_write, file_identity, identity_key
from tierlm.weights.gguf_blocks import INT4_TYPES
from tierlm.weights.safetensors import SafetensorsCheckpoint
from tierlm.weights.temporaries import remove_stale_temporaries

log = logging.getLogger(__name__)

# The cached config's format: 2 since a GGUF's rope_freqs tensor is read (format 1 dropped it, so a cached
# Llama 3.x config lacks its rotary scaling and must be rebuilt); 3 since its YaRN keys are read (format 2
# dropped them); 4 since context_length and the rms epsilon are required (3 defaulted them).
CONFIG_FORMAT = 4


def cache_dir(gguf_path: Path) -> Path:
    return cache_root() / "gguf" / identity_key([file_identity(gguf_path)])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def open_cached(gguf_path: Path, dtype: torch.dtype) -> SafetensorsCheckpoint | None:
    """The cached weights of this GGUF file in this dtype, or None when there are none (yet)."""
    folder = cache_dir(gguf_path)
    weights = folder / f"weights-{_dtype_name(dtype)}.safetensors"
    meta = folder / "config.json"
    if not (weights.is_file() and meta.is_file()):
        return None
    try:
        raw = json.loads(meta.read_text())
        if raw.pop("tierlm_config_format", 1) != CONFIG_FORMAT:
            return None  # written by an older tierlm: rebuilt
        raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
        raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
        raw["layer_types"] = tuple(raw.get("layer_types", ()))
        return SafetensorsCheckpoint.from_file(weights, ModelConfig(**raw))
    except (ValueError, TypeError, KeyError, OSError):
        return None  # a stale or damaged cache is rebuilt, never trusted


def ensure(gguf_path: Path, dtype: torch.dtype, progress=None) -> SafetensorsCheckpoint:
    """The GGUF file's weights as a safetensors file in `dtype`, dequantized and written once.

    Tensors are dequantized and written one at a time, so the peak memory is one tensor, not the model.
    What a killed earlier writer left in the cache folder is removed first.
    """
    remove_stale_temporaries(cache_dir(gguf_path))
    cached = open_cached(gguf_path, dtype)
    if cached is not None:
        return cached
    from tierlm.weights.gguf import GGUFCheckpoint

    gguf = GGUFCheckpoint(gguf_path)
    folder = cache_dir(gguf_path)
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / f"weights-{_dtype_name(dtype)}.safetensors"
    if weights.is_file() and (folder / "source.json").is_file():  # only the config is of an older format
        _write_config(folder, gguf)
        try:
            return SafetensorsCheckpoint.from_file(weights, gguf.config)
        except (ValueError, OSError):
            pass  # damaged weights: written again below
    names = gguf.names()
    shapes = {n: gguf.shape(n) for n in names}

    def tensors():
        for i, n in enumerate(names):
            yield n, gguf.load(n).to(dtype)
            if progress is not None:
                progress(i + 1, len(names))

    log.info(
        "dequantizing %s to %s once, into %s (%d tensors) ...", gguf_path.name, dtype, folder, len(names)
    )
    atomic_write(weights, lambda p: write_safetensors(p, shapes, dtype, tensors()))
    types = {n: gguf.tensors[n].tensor_type.name for n in names}
    source = {"gguf": str(gguf_path.resolve()), "tensor_types": types}
    atomic_write(folder / "source.json", lambda p: p.write_text(json.dumps(source)))
    _write_config(folder, gguf)
    return SafetensorsCheckpoint.from_file(weights, gguf.config)


def _write_config(folder: Path, gguf) -> None:
    config = {**dataclasses.asdict(gguf.config), "tierlm_config_format": CONFIG_FORMAT}
    atomic_write(folder / "config.json", lambda p: p.write_text(json.dumps(config)))


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, tensors) -> None:
    """Stream (name, tensor) pairs, all of one dtype, into a safetensors file whose header is known up front
    (the one writer; a name of its own here so tests can stand in for it and kill a write half-way)."""
    safetensors_write.write_safetensors(path, {n: (dtype, tuple(s)) for n, s in shapes.items()}, tensors)


def source_tensor_types(gguf_path: Path) -> dict[str, str]:
    """The GGUF quantization type of each tensor (e.g. "Q4_1"), as recorded when the cache was filled."""
    try:
        return json.loads((cache_dir(gguf_path) / "source.json").read_text())["tensor_types"]
    except (OSError, ValueError, KeyError):
        return {}


def default_int4_group(types: list[str]) -> int:
    """32 when some projections (their `projection_types`) are 4-bit GGUF blocks on a grid of 32 (Q4_0, Q4_1,
    Q4_K: a group is a block or a sub-block, whose codes int4 keeps), else 64."""
    return 32 if any(t in INT4_TYPES for t in types) else 64


FLOAT_TYPES = ("F32", "F16", "BF16")


def projection_kinds(path: Path) -> dict[str, str]:
    """The GGUF type (e.g. "Q4_1", "Q6_K", "F16") of each projection weight of `path`, by module name (e.g.
    "model.layers.0.mlp.down_proj"); {} if it is no GGUF."""
    from tierlm.weights.gguf import GGUFCheckpoint

    if not is_gguf(path):
        return {}
    recorded = source_tensor_types(path)  # when the dequantized cache exists
    if not recorded:  # else from the GGUF's own header (memory-mapped; no tensor is read)
        gguf = GGUFCheckpoint.open(path)
        recorded = {n: gguf.tensors[n].tensor_type.name for n in gguf.names()}
    return {n.removesuffix(".weight"): t for n, t in recorded.items() if n.endswith("proj.weight")}


def projection_types(path: Path) -> list[str]:
    """The GGUF type of each projection weight of `path` (`projection_kinds`' values)."""
    return list(projection_kinds(path).values())


def quantized_blocks(types: list[str]) -> bool:
    """Whether these projection types are all quantized blocks (Q4_0 ... Q8_0, K-quants), none stored as
    floats: int8 per row then keeps about the file's quality (tierlm.plan)."""
    return bool(types) and not any(t in FLOAT_TYPES for t in types)


# Bumped when the tokenizer built from a GGUF changes (2: Gemma's vocabulary, end-of-turn and chat template;
# 3: llama.cpp's end-of-generation tokens and BOS default; 4: those tokens are control tokens), so one cached
# by an older tierlm is rebuilt.
TOKENIZER_FORMAT = 4


def open_cached_tokenizer(gguf_path: Path):
    """The GGUF file's tokenizer from the cache, or None (also when an older tierlm cached it)."""
    from tokenizers import Tokenizer as Backend

    from tierlm.tokenizer import SpecialTokens, Tokenizer

    folder = cache_dir(gguf_path)
    try:
        meta = json.loads((folder / "tokenizer-meta.json").read_text())
        if meta.get("format") != TOKENIZER_FORMAT:
            return None
        backend = Backend.from_file(str(folder / "tokenizer.json"))
    except (OSError, ValueError, Exception):  # tokenizers raises its own Exception type on bad files
        return None
    special = SpecialTokens(meta["bos_id"], tuple(meta["eos_ids"]), meta["pad_id"], meta["unk_id"])
    return Tokenizer(backend, special, add_bos=meta["add_bos"], chat_template=meta["chat_template"])


def store_tokenizer(gguf_path: Path, tokenizer) -> None:
    folder = cache_dir(gguf_path)
    s = tokenizer.special
    meta = {
        "format": TOKENIZER_FORMAT,
        "bos_id": s.bos_id,
        "eos_ids": list(s.eos_ids),
        "pad_id": s.pad_id,
        "unk_id": s.unk_id,
        "add_bos": tokenizer.add_bos,
        "chat_template": tokenizer.chat_template,
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / "tokenizer.json", lambda p: p.write_text(tokenizer.backend.to_str()))
        atomic_write(folder / "tokenizer-meta.json", lambda p: p.write_text(json.dumps(meta)))
    except OSError as e:
        warnings.warn(f"could not cache the tokenizer in {folder}: {e}", stacklevel=2)
