"""`tierlm plan`: placement, streaming volume and the compile decision, from metadata only (no weights read)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tierlm import cpu
from tierlm.compile import CompileConfig, decide
from tierlm.generation.config import GenerationConfig
from tierlm.placement.device_map import format_bytes, format_modules
from tierlm.placement.placer import Placement, kv_bytes_per_token, parameter_table, resolve
from tierlm.weights import gguf_cache
from tierlm.weights.gguf import GGUFCheckpoint
from tierlm.weights.load import default_gguf_dtype, default_model_path, open_checkpoint, resolve_dtype

_LAYER = re.compile(r"^model\.layers\.(\d+)$")


def plan(
    path: str | Path | None = None,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    device_map=None,
    max_memory=None,
    cache: str = "static",
    compile: bool = False,
    quantize: str | None = None,
    group_size: int | None = None,
):
    """(config, dtype, placement, sizes per module, compile decision) for a model, without its weights."""
    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    dev = torch.device(device)
    if path.is_file() and path.suffix == ".gguf":
        target = default_gguf_dtype(dev) if dtype == "auto" else resolve_dtype(dtype, None, dev)
        checkpoint = gguf_cache.open_cached(path, target) or GGUFCheckpoint(path)
    else:
        checkpoint = open_checkpoint(path)
        target = resolve_dtype(dtype, checkpoint, dev)
    cfg = checkpoint.config
    quant = None
    if quantize is not None:
        quant = (quantize, group_size or gguf_cache.default_int4_group(path))
    names, sizes, tied = parameter_table(cfg, target, quant)
    placement = resolve(names, sizes, device_map, max_memory, device, tied, kv_bytes_per_token(cfg, target))
    module_bytes = {
        m: sum(b for n, b in sizes.items() if n == m or n.startswith(m + ".")) for m in placement.module_map
    }
    config = GenerationConfig(cache_implementation=cache, compile_config=CompileConfig() if compile else None)
    decision = decide(
        placement.module_map, cache, config, device=str(placement.device), layers=cfg.num_layers
    )
    return cfg, target, placement, module_bytes, decision, quant


def describe_plan(path=None, **kwargs) -> str:
    """The plan as the text `tierlm plan` prints."""
    cfg, dtype, placement, module_bytes, decision, quant = plan(path, **kwargs)
    weights = (
        f", {quant[0]} weights" + (f" (group {quant[1]})" if quant[0] == "int4" else "") if quant else ""
    )
    lines = [
        f"model: {path or default_model_path()} ({cfg.architecture}, {cfg.num_layers} layers, "
        f"{str(dtype)[6:]}{weights})",
        f"execution device: {placement.device}",
        f"cpu: {cpu.detect().describe()}",
        "",
        f"{'module':<28} {'tier':<8} {'bytes':>12}",
    ]
    for names, tier, size in _runs(placement, module_bytes):
        shown = (
            "(tied to model.embed_tokens)"
            if names == ["lm_head"] and cfg.tie_word_embeddings and not quant
            else format_bytes(size)
        )
        lines.append(f"{format_modules(names):<28} {tier:<8} {shown:>12}")
    totals: dict[str, int] = {}
    for module, size in module_bytes.items():
        tier = _tier(placement, module)
        totals[tier] = totals.get(tier, 0) + size
    lines += ["", "totals: " + ", ".join(f"{t} {format_bytes(b)}" for t, b in totals.items())]
    per_4k = kv_bytes_per_token(cfg, dtype, 4096) * 4096
    window = f" (sliding layers keep {cfg.sliding_window} tokens)" if cfg.sliding_layers else ""
    lines.append(
        f"kv cache per sequence: {format_bytes(kv_bytes_per_token(cfg, dtype, 1))} per token, "
        f"{format_bytes(per_4k)} per 4k tokens{window}"
    )
    streamed = {t: sum(module_bytes[m] for m in placement.offloaded[t]) for t in ("cpu", "disk")}
    lines.append(
        "streamed per token: "
        + (
            ", ".join(f"{format_bytes(b)} from {t}" for t, b in streamed.items() if b)
            if any(streamed.values())
            else "nothing (all weights resident)"
        )
    )
    lines.append(decision.explain())
    return "\n".join(lines)


def _tier(placement: Placement, module: str) -> str:
    device = placement.module_map[module]
    if module in placement.offloaded["disk"]:
        return "disk"
    if module in placement.offloaded["cpu"]:
        return "cpu (offloaded)"
    return device


def _runs(placement: Placement, module_bytes: dict[str, int]):
    """Modules grouped into runs of consecutive layers on the same tier."""
    runs: list[tuple[list[str], str, int]] = []
    for module, size in module_bytes.items():
        tier = _tier(placement, module)
        if runs and runs[-1][1] == tier and _LAYER.match(module) and _LAYER.match(runs[-1][0][-1]):
            names, _, total = runs[-1]
            runs[-1] = (names + [module], tier, total + size)
        else:
            runs.append(([module], tier, size))
    return runs
