"""Device maps: validate them, expand them to parameters, read them, compute them from memory budgets.

Pure functions over parameter names and byte counts; names follow Hugging Face exactly. Sizes and device
names as users write them are parsed in memory.py (its public names are re-exported here).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tierlm.errors import PlacementError
from tierlm.placement.limits import MemoryLimit, memory_limit
from tierlm.placement.memory import checked_device, format_bytes, normalize_device, parse_max_memory
from tierlm.placement.memory import parse_max_memory_arg as parse_max_memory_arg
from tierlm.placement.memory import parse_memory as parse_memory

STRATEGIES = ("auto", "balanced", "sequential")

_LAYER_RE = re.compile(r"model\.layers\.(\d+)")
# Modules with buffers but no parameters: transformers' hf_device_map names them, so accept them as keys.
_PARAMETERLESS = frozenset({"model.rotary_emb", "model.rotary_emb_local"})

V = TypeVar("V")


# ---------------------------------------------------------------- module names


def _unit(name: str) -> str:
    """The placement unit holding a parameter: model.layers.N inside a layer, else its own module."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isascii() and parts[2].isdigit():
        return ".".join(parts[:3])
    return ".".join(parts[:-1]) or name


def _order_key(name: str) -> tuple[int, int]:
    """Model order: embeddings, layers by index, other model modules, final norm, lm_head, the rest."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isascii() and parts[2].isdigit():
        return (1, int(parts[2]))
    ranks = {"model.embed_tokens": 0, "model.norm": 3}
    top = ".".join(parts[:2])
    rank = ranks.get(top, 4 if parts[0] == "lm_head" else 2 if parts[0] == "model" else 5)
    return (rank, 0)


def _collapse(values: Mapping[str, V]) -> dict[str, V]:
    """Coarsest module prefixes with one value each, never coarser than a placement unit, in model order."""
    groups: dict[str, list[str]] = {}
    for name in values:
        groups.setdefault(_unit(name), []).append(name)
    collapsed: dict[str, V] = {}
    for unit in sorted(groups, key=_order_key):
        collapsed.update(_split(unit, groups[unit], values))
    return collapsed


def _split(prefix: str, names: list[str], values: Mapping[str, V]) -> dict[str, V]:
    first = values[names[0]]
    if all(values[name] == first for name in names):
        return {prefix: first}
    depth = prefix.count(".") + 2
    children: dict[str, list[str]] = {}
    for name in names:
        children.setdefault(".".join(name.split(".")[:depth]), []).append(name)
    split: dict[str, V] = {}
    for child, group in children.items():
        split.update(_split(child, group, values))
    return split


def format_modules(names: Sequence[str]) -> str:
    """Names joined with ", ", runs of consecutive layers collapsed: "model.layers.15-29, model.norm"."""
    pieces: list[str] = []
    start = end = None
    for name in names:
        match = _LAYER_RE.fullmatch(name)
        index = int(match[1]) if match else None
        if index is not None and end is not None and index == end + 1:
            end = index
            continue
        if end is not None:
            pieces.append(f"model.layers.{start}" + (f"-{end}" if end != start else ""))
        start = end = index
        if index is None:
            pieces.append(name)
    if end is not None:
        pieces.append(f"model.layers.{start}" + (f"-{end}" if end != start else ""))
    return ", ".join(pieces)


# ---------------------------------------------------------------- expanding a user map


def expand_device_map(device_map: Mapping[str, Any], param_names: Sequence[str]) -> dict[str, str]:
    """One normalized device per parameter; the longest key equal to it or a dot-prefix of it wins.

    Pass every parameter name, tied ones included (named_parameters(remove_duplicate=False))."""
    devices = _checked_keys(device_map, param_names)
    resolved = {name: _lookup(name, devices) for name in param_names}
    if None in resolved.values():
        covered = {name: device is not None for name, device in resolved.items()}
        missing = [name for name, ok in _collapse(covered).items() if not ok]
        raise PlacementError(
            f"device_map gives no device for {format_modules(missing)}; "
            "add keys for them, or a '' key for the whole model."
        )
    owners: dict[str, set[str]] = {}
    for name, device in resolved.items():
        owners.setdefault(name.rpartition(".")[0], set()).add(device)  # type: ignore[arg-type]
    split = next(((m, d) for m, d in owners.items() if len(d) > 1), None)
    if split is not None:
        raise PlacementError(
            f"device_map puts the parameters of {split[0]} on {', '.join(sorted(split[1]))}; a module's weight "
            f"and bias go to one device: map {split[0]!r} itself"
        )
    return resolved  # type: ignore[return-value]


def _checked_keys(device_map: Mapping[str, Any], param_names: Sequence[str]) -> dict[str, str]:
    modules = {name.rsplit(".", i)[0] for name in param_names for i in range(1, name.count(".") + 1)}
    valid = modules | set(param_names) | _PARAMETERLESS | {""}
    devices = {}
    for key, value in device_map.items():
        if not isinstance(key, str):
            raise PlacementError(
                f"device_map key {key!r} is not a string; use module names like 'model.layers.0', or ''."
            )
        if key not in valid:
            nearest = difflib.get_close_matches(key, sorted(modules), n=3) or sorted(modules, key=len)[:3]
            raise PlacementError(
                f"device_map key {key!r} names no module of this model; nearest valid names: {', '.join(nearest)}."
            )
        devices[key] = checked_device(value, f"device_map[{key!r}] =")
    return devices


def _lookup(name: str, devices: Mapping[str, str]) -> str | None:
    key = name
    while key not in devices:
        if not key:
            return None
        key = key.rpartition(".")[0]
    return devices[key]


def module_map(param_map: Mapping[str, str]) -> dict[str, str]:
    """A per-parameter map collapsed to the shape of transformers' hf_device_map, in model order."""
    return _collapse(param_map)


# ---------------------------------------------------------------- reading a map


def execution_device(module_map: Mapping[str, Any]) -> str:
    """The first accelerator in the map (lowest cuda index, else mps), else "cpu"."""
    devices = {normalize_device(device) for device in module_map.values()}
    cuda = sorted((d for d in devices if d.startswith("cuda:")), key=lambda d: int(d[5:]))
    return cuda[0] if cuda else "mps" if "mps" in devices else "cpu"


def offloaded_modules(module_map: Mapping[str, Any]) -> dict[str, list[str]]:
    """{"cpu": names on cpu while an accelerator executes, "disk": names on disk}, in model order."""
    executor = execution_device(module_map)
    names = sorted(module_map, key=_order_key)
    placed = {name: normalize_device(module_map[name]) for name in names}
    return {
        "cpu": [n for n in names if placed[n] == "cpu" and executor != "cpu"],
        "disk": [n for n in names if placed[n] == "disk"],
    }


# ---------------------------------------------------------------- computing a map


def available_memory(limit: MemoryLimit | None = None) -> dict[str, int]:
    """Free bytes on each visible GPU and the CPU RAM this process may still use (the least of MemAvailable
    and its memory cgroup's room: tierlm.placement.limits; `limit` when already read), each less 10% headroom."""
    import torch

    budgets = {}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            budgets[f"cuda:{index}"] = int(torch.cuda.mem_get_info(index)[0] * 0.9)
    budgets["cpu"] = int((limit or memory_limit()).available * 0.9)
    return budgets


def infer_device_map(
    param_bytes: Mapping[str, int],
    max_memory: Mapping[Any, int | str] | None,
    strategy: str = "auto",
    *,
    tied: Sequence[tuple[str, str]] = (),
    reserve_bytes: int = 0,
) -> dict[str, str]:
    """A module-level map filling accelerators, then cpu, then disk, within max_memory (None: what is free).

    "auto"/"sequential" fill accelerators in index order; "balanced" spreads layers evenly over them."""
    if strategy not in STRATEGIES:
        raise PlacementError(
            f"device map strategy {strategy!r} is not valid; use one of {', '.join(STRATEGIES)}."
        )
    if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
        raise PlacementError(f"reserve_bytes {reserve_bytes!r} is not valid; give a number of bytes >= 0.")
    found = memory_limit() if max_memory is None else None
    budgets = available_memory(found) if found else parse_max_memory(max_memory)
    units, leaders = _placement_units(param_bytes, tied)
    try:
        placement = _place(units, budgets, strategy, reserve_bytes)
    except _TooSmall as e:
        raise PlacementError(e.message(found)) from None
    placement.update({follower: placement[leader] for follower, leader in leaders.items()})
    return {unit: placement[unit] for unit in sorted(placement, key=_order_key)}


def _placement_units(
    param_bytes: Mapping[str, int], tied: Sequence[tuple[str, str]]
) -> tuple[dict[str, int], dict[str, str]]:
    """Bytes per unit in model order (a tied tensor counted once, in its first unit) and {follower: leader}."""
    sizes = dict(param_bytes)
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise PlacementError(f"param_bytes[{name!r}] = {size!r} is not a byte count; give an int >= 0.")
    leaders: dict[str, str] = {}
    for pair in tied:
        if not any(name in sizes for name in pair):
            raise PlacementError(
                f"tied pair {pair!r} names no parameter in param_bytes; tie existing parameters."
            )
        first, second = sorted(pair, key=_order_key)
        sizes[first], sizes[second] = max(sizes.get(first, 0), sizes.get(second, 0)), 0
        if _unit(first) != _unit(second):
            leaders[_unit(second)] = _unit(first)
    units: dict[str, int] = {}
    for name in sorted(sizes, key=_order_key):
        units[_unit(name)] = units.get(_unit(name), 0) + sizes[name]
    roots = {}
    for follower in leaders:
        root = leaders[follower]
        while root in leaders:
            root = leaders[root]
        roots[follower] = root
    for follower, root in roots.items():
        units[root] += units.pop(follower)
    return units, roots


def _place(units: dict[str, int], budgets: dict[str, int], strategy: str, reserve: int) -> dict[str, str]:
    accelerators = sorted((d for d, b in budgets.items() if d != "cpu" and b > 0), key=_device_order)
    while True:
        devices = [*accelerators, "cpu", "disk"]
        if strategy == "balanced" and (placement := _balanced(units, accelerators, budgets)):
            return placement
        placement = _fill_with_reserve(units, devices, budgets, reserve)
        if not accelerators or accelerators[0] in placement.values():
            return placement
        accelerators = accelerators[1:]  # nothing fits beside the reserve: the next device executes


def _device_order(device: str) -> tuple[int, int]:
    return (0, int(device[5:])) if device.startswith("cuda:") else (1, 0)


def _balanced(
    units: dict[str, int], accelerators: list[str], budgets: dict[str, int]
) -> dict[str, str] | None:
    """Layers split evenly by count over the accelerators, or None when that does not fit."""
    layers = [unit for unit in units if _LAYER_RE.fullmatch(unit)]
    if len(accelerators) < 2 or not layers:
        return None
    share = {layer: accelerators[i * len(accelerators) // len(layers)] for i, layer in enumerate(layers)}
    placement, device, used = {}, accelerators[0], dict.fromkeys(accelerators, 0)
    for unit, size in units.items():
        device = share.get(unit, device)
        placement[unit] = device
        used[device] += size
    return placement if all(used[d] <= budgets[d] for d in accelerators) else None


def _fill_with_reserve(
    units: dict[str, int], devices: list[str], budgets: dict[str, int], reserve: int
) -> dict[str, str]:
    """Sequential fill keeping room on the executing device for the KV cache and the streamed unit."""
    executor, reserved = devices[0], 0
    while True:
        caps = {device: budgets.get(device, 0) for device in devices}
        caps[executor] = max(0, caps[executor] - reserved)
        placement = _fill(units, devices, caps)
        offloaded = [u for u, d in placement.items() if d == "disk" or (d == "cpu" and executor != "cpu")]
        if not offloaded:
            return placement
        streamed = max(offloaded, key=lambda unit: units[unit])
        need = reserve + units[streamed]
        if need <= reserved:
            return placement
        if need > budgets.get(executor, 0):
            raise _TooSmall(executor, budgets.get(executor, 0), streamed, units[streamed], reserve)
        reserved = need


def _fill(units: dict[str, int], devices: list[str], caps: dict[str, int]) -> dict[str, str]:
    placement, used, index = {}, dict.fromkeys(devices, 0), 0
    for unit, size in units.items():
        while devices[index] != "disk" and used[devices[index]] + size > caps[devices[index]]:
            index += 1
        placement[unit] = devices[index]
        used[devices[index]] += size
    return placement


@dataclass
class _TooSmall(Exception):
    """The executing device's budget cannot hold the streamed layer and the KV cache (worded by `message`)."""

    device: str
    budget: int
    streamed: str
    size: int
    reserve: int

    def message(self, found: MemoryLimit | None) -> str:
        """found: the budgets are what this process may still use (available_memory), not max_memory's."""
        cache = f" plus the KV cache ({format_bytes(self.reserve)})" if self.reserve else ""
        need = self.size + self.reserve
        with_headroom = -(-need * 10 // 9)  # available_memory keeps 10% back
        what, least = (
            f"max_memory[{self.device!r}] = {format_bytes(self.budget)}",
            f"Give at least {format_bytes(need)}",
        )
        if found and self.device == "cpu":
            limit = found
            what = f"the memory this process may use ({limit.describe()}, less 10% headroom)"
            least = f"Free at least {format_bytes(with_headroom)}"
            if limit.limit is not None:  # the limit that leaves `need` beside what is in use now
                least = f"A memory limit of at least {format_bytes(limit.limit - limit.available + with_headroom)} works"
        elif found:
            what = f"the free memory of {self.device} ({format_bytes(self.budget)} less 10% headroom)"
        streamed = f"the streamed layer {self.streamed} ({format_bytes(self.size)}){cache}"
        return f"{what} is too small: {streamed} must fit there. {least}."
