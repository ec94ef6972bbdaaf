"""From a checkpoint and a device map to a placement: one tier per parameter, offloaded units, disk sources."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierlm.config import ModelConfig
from tierlm.errors import PlacementError
from tierlm.models.decoder import Decoder
from tierlm.module_names import under
from tierlm.placement.device_map import (
    STRATEGIES,
    execution_device,
    expand_device_map,
    infer_device_map,
    module_map,
    offloaded_modules,
)
from tierlm.placement.memory import checked_device
from tierlm.weights.entry_names import offload_entry
from tierlm.weights.files import (
    commit_folder,
    file_identity,
    filling,
    folder_matches,
    fresh_tmp_folder,
    identity_key,
)
from tierlm.weights.safetensors import SafetensorsCheckpoint, mmap_tensors
from tierlm.weights.temporaries import remove_stale_temporaries

KV_RESERVE_TOKENS = 2048  # "auto" maps keep room for a KV cache of this many tokens (batch 1)


@dataclass
class Placement:
    """Where every parameter lives and what streams."""

    module_map: dict[str, str]  # HF hf_device_map shape, normalized devices
    param_devices: dict[str, str]  # full parameter name -> device
    device: torch.device  # where the forward executes
    offloaded: dict[str, list[str]]  # {"cpu": [...], "disk": [...]} module names, in model order
    drop_disk_pages: bool  # a RAM budget is in force: unmap disk-offloaded pages after use

    @property
    def resident(self) -> bool:
        return not (self.offloaded["cpu"] or self.offloaded["disk"])

    def tier_of(self, param: str) -> str:
        """ "resident", "cpu" (offloaded) or "disk" for a parameter."""
        unit = self.unit_of(param)
        if unit is None:
            return "resident"
        return "cpu" if unit in self.offloaded["cpu"] else "disk"

    def unit_of(self, param: str) -> str | None:
        for tier in ("cpu", "disk"):
            for unit in self.offloaded[tier]:
                if under(param, unit):
                    return unit
        return None


def resolve(
    param_names: list[str],
    param_bytes: Mapping[str, int],
    device_map: Any,
    max_memory: Mapping | None,
    default_device: str,
    tied: list[tuple[str, str]],
    kv_bytes_per_token: int,
    execution_override: str | None = None,
) -> Placement:
    """Expand or infer the map, check ties, and find the execution device (override: run accelerators there).

    A memory budget without a map means "auto" (a budget is only ever read to infer a map). A single device
    (0, "cpu", "cuda:1", a torch.device) places the whole model there, as transformers reads it."""
    if max_memory is not None and not max_memory:
        raise PlacementError(
            "max_memory is empty: give budgets such as {'cpu': '2GiB'}, or None for what is free"
        )
    device_map = single_device_map(device_map)
    if device_map is None:
        device_map = "auto" if max_memory else {"": default_device}
    elif max_memory and not isinstance(device_map, str):
        raise PlacementError(
            "max_memory budgets an inferred map (device_map 'auto', 'balanced' or 'sequential'); "
            "a dict device_map places every module itself, so the budget would be ignored"
        )
    reserve = kv_bytes_per_token * KV_RESERVE_TOKENS
    modules, params = _maps(param_names, _budgeted(param_bytes, tied), device_map, max_memory, tied, reserve)
    _check_devices(params, tied)
    executor = execution_override or execution_device(modules)
    return Placement(
        module_map=modules,
        param_devices=params,
        device=torch.device(executor),
        offloaded=offloaded_modules(modules),
        drop_disk_pages=isinstance(device_map, str) and max_memory is not None,
    )


def single_device_map(device_map: Any) -> Any:
    """One device given as the map (0, "cpu", "cuda:1", a torch.device) as {"": that device}, as transformers
    reads it; a dict, a strategy name or None unchanged."""
    if isinstance(device_map, torch.device) or (
        isinstance(device_map, (int, str))
        and not isinstance(device_map, bool)
        and device_map not in STRATEGIES
    ):
        try:
            return {"": checked_device(device_map, "device_map =")}
        except ValueError:
            raise PlacementError(
                f"device_map {device_map!r} is neither a device (0, 'cuda:1', 'cpu', 'disk', ...) nor one of "
                f"{', '.join(STRATEGIES)}; or give a dict"
            ) from None
    return device_map


def _budgeted(param_bytes: Mapping[str, int], tied: list[tuple[str, str]]) -> dict[str, int]:
    """The bytes a budget counts: a tied pair shares one tensor (the follower counts 0, parameter_table), but
    a follower with bytes of its own (a quantized LM head: its own packed copy of the embedding) adds them
    to the leader's, so the pair, placed together, counts both."""
    sizes = dict(param_bytes)
    for leader, follower in tied:
        if sizes.get(follower):
            sizes[leader] = sizes.get(leader, 0) + sizes[follower]
            sizes[follower] = 0
    return sizes


def _maps(
    param_names: list[str],
    param_bytes: Mapping[str, int],
    device_map: Any,
    max_memory: Mapping | None,
    tied: list[tuple[str, str]],
    reserve_bytes: int,
) -> tuple[dict[str, str], dict[str, str]]:
    """(module map, device per parameter): a strategy's map inferred within `max_memory`, or a dict expanded."""
    if isinstance(device_map, str):
        if device_map not in STRATEGIES:
            raise PlacementError(
                f"device_map {device_map!r} is not valid; use a dict or one of {', '.join(STRATEGIES)}"
            )
        modules = infer_device_map(
            param_bytes, max_memory, device_map, tied=tied, reserve_bytes=reserve_bytes
        )
        return modules, expand_device_map(modules, param_names)
    if not isinstance(device_map, Mapping):
        raise PlacementError(
            f"device_map must be a dict, 'auto', 'balanced' or 'sequential', got {device_map!r}"
        )
    params = expand_device_map(device_map, param_names)
    for leader, follower in tied:  # a tied weight follows its leader unless the map names it
        if not any(under(follower, k) for k in device_map if k):
            params[follower] = params[leader]
    return module_map(params), params


def _check_devices(params: dict[str, str], tied: list[tuple[str, str]]) -> None:
    """Tied parameters share a device, and at most one accelerator is named."""
    for leader, follower in tied:
        if params.get(follower, params[leader]) != params[leader]:
            raise PlacementError(
                f"{leader} and {follower} are tied (one tensor) and must share a device, "
                f"got {params[leader]} and {params[follower]}"
            )
    accelerators = sorted({d for d in params.values() if d not in ("cpu", "disk")})
    if len(accelerators) > 1:
        raise PlacementError(
            f"the map names several accelerators ({', '.join(accelerators)}); tierlm runs on one"
        )


def parameter_table(cfg: ModelConfig, dtype: torch.dtype, quantize: tuple[str, int] | None = None):
    """All parameter names (tied ones too), their sizes in `dtype`, and the tied pairs.

    quantize (mode, group size): projections and the LM head count at their packed size (a tied LM head
    then has its own packed copy).
    """
    with torch.device("meta"):
        probe = Decoder(cfg)
    params = dict(probe.named_parameters(remove_duplicate=False))
    sizes = {n: p.numel() * dtype.itemsize for n, p in params.items()}
    tied = [("model.embed_tokens.weight", "lm_head.weight")] if cfg.tie_word_embeddings else []
    for _, follower in tied:
        sizes[follower] = 0
    if quantize is not None:
        from tierlm.quant import check_mode

        check_mode(quantize[0])
        int8 = set(quantize[2]) if len(quantize) > 2 else set()  # a Quantization's int8 modules
        for n, p in params.items():
            mode = "int8" if n.removesuffix(".weight") in int8 else quantize[0]
            packed = _packed_bytes(n, tuple(p.shape), mode, quantize[1], dtype)
            if packed is not None:
                sizes[n] = packed
    return list(params), sizes, tied


def _packed_bytes(name: str, shape: tuple[int, ...], mode: str, group: int, dtype: torch.dtype) -> int | None:
    """Bytes of a quantized projection weight (codes plus scales), None if it stays float."""
    from tierlm.quant import check_int4_shape, mode_of, quantizes

    if not (name.endswith(".weight") and quantizes(name.removesuffix(".weight"))):
        return None
    n, k = shape
    if mode_of(name.removesuffix(".weight"), mode) == "int8":
        return n * k + n * dtype.itemsize
    try:
        check_int4_shape(n, k, group, torch.device("cpu"))
    except ValueError:
        return None
    return n * k // 2 + (k // group) * n * 2 * dtype.itemsize


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tokens: int = KV_RESERVE_TOKENS) -> int:
    """K/V bytes per token of a cache of `tokens` tokens (sliding-window layers hold at most their window,
    so past it they add nothing), rounded up."""
    per_slot = 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    return -(-per_slot * cfg.kv_slots(tokens) // tokens)


def disk_sources(
    checkpoint: SafetensorsCheckpoint,
    names: list[str],
    dtype: torch.dtype,
    offload_folder: Path,
    transposed: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Memory-mapped tensors for disk-offloaded parameters.

    They come from the checkpoint's own files when the stored dtype is `dtype` and the layout matches;
    otherwise from an offload folder written once, atomically, and reused while it matches the
    checkpoint, dtype and layout. Names in `transposed` are stored there transposed (weights/layout.py)
    and returned as `.T` views of their shape. What killed writers left in the offload folder goes first.
    """
    remove_stale_temporaries(offload_folder, offload_entry)
    converted = [n for n in names if checkpoint.dtype(n) != dtype or n in transposed]
    files: dict[str, Path] = {n: checkpoint.files[n] for n in names if n not in converted}
    flipped = frozenset(n for n in converted if n in transposed)
    if converted:
        folder = ensure_offload_folder(checkpoint, converted, dtype, offload_folder, flipped)
        files.update(dict.fromkeys(converted, folder / "weights.safetensors"))
    tensors = {}
    for file in sorted(set(files.values())):
        tensors.update(mmap_tensors(file, [n for n in names if files[n] == file]))
    return {n: t.T if n in flipped else t for n, t in tensors.items()}


def source_paths(checkpoint, names: list[str] | None = None) -> list[str]:
    """The resolved files `names` (default: all) come from, recorded in an offload folder's manifest so that
    `tierlm cache` can tell when they are gone (any spelling of them finds the folder: its key resolves)."""
    files = getattr(checkpoint, "files", {})
    return sorted({str(Path(files[n]).resolve()) for n in (files if names is None else names)})


def offload_key(checkpoint: SafetensorsCheckpoint, names: list[str]) -> str:
    """Identity of the checkpoint files and of the set of tensors an offload folder holds."""
    files = [file_identity(f) for f in sorted(set(checkpoint.files.values()))]
    return identity_key(files + sorted(names))


def ensure_offload_folder(
    checkpoint, names: list[str], dtype: torch.dtype, root: Path, transposed: frozenset[str] = frozenset()
) -> Path:
    """<root>/<key>/weights.safetensors holding `names` in `dtype` (those in `transposed` stored
    transposed); rebuilt when the dtype or the layout differs."""
    from tierlm.weights.gguf_cache import write_safetensors

    folder = root / offload_key(checkpoint, names)
    want = {
        "source": str(checkpoint.path),
        "sources": source_paths(checkpoint, names),  # not compared: for `tierlm cache`
        "dtype": str(dtype),
        "tensors": sorted(names),
        "transposed": sorted(transposed),
    }
    if folder_matches(folder, want):
        return folder
    tmp = fresh_tmp_folder(folder)

    def stored(n: str) -> torch.Tensor:
        t = checkpoint.load(n).to(dtype)
        return t.T.contiguous() if n in transposed else t

    shapes = {
        n: tuple(reversed(checkpoint.shape(n))) if n in transposed else checkpoint.shape(n) for n in names
    }
    with filling(tmp, folder):
        write_safetensors(tmp / "weights.safetensors", shapes, dtype, ((n, stored(n)) for n in names))
    commit_folder(tmp, folder, want)
    return folder
