"""Memory sizes and device names as users write them: parsed, validated, normalized and printed.

Pure functions, no torch import (a torch.device is recognised only once torch is loaded).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from tierlm.errors import PlacementError

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_MEMORY_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.IGNORECASE)
_DEVICE_RE = re.compile(r"(cuda|mps|cpu)(?::(\d+))?")
_DEVICE_FORMS = "an int N, 'cuda', 'cuda:N', 'mps', 'cpu', 'disk' or a torch.device"
_MEMORY_FORMS = (
    "bytes as an int >= 0 or a string like '300MB' or '1.5GiB' (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
)


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a size string: "300MB" (powers of 1000), "1.5 GiB" (powers of 1024)."""
    return _parse_memory(value, "memory size")


def _parse_memory(value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _MEMORY_RE.fullmatch(value.strip()) if isinstance(value, str) else None
    unit = match[2].lower() or "b" if match else ""
    if match is None or unit not in _UNITS:
        raise PlacementError(f"{what} {value!r} is not valid; give {_MEMORY_FORMS}.")
    return int(Decimal(match[1]) * _UNITS[unit])


def normalize_device(value: Any) -> str:
    """ "cuda:N", "mps", "cpu" or "disk" from an int, a device string or a torch.device."""
    return checked_device(value, "device")


def checked_device(value: Any, what: str) -> str:
    """normalize_device, whose error names the value as `what`, e.g. "device_map['model.norm'] ="."""
    torch = sys.modules.get("torch")  # a torch.device can only exist once torch is imported
    text = str(value) if torch is not None and isinstance(value, torch.device) else value
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return f"cuda:{text}"
    text = text.strip().lower() if isinstance(text, str) else ""
    match = _DEVICE_RE.fullmatch(text)
    if text.isascii() and text.isdigit():
        return f"cuda:{int(text)}"
    if text == "disk" or (match and match[1] != "cuda" and match[2] in (None, "0")):
        return text.partition(":")[0]
    if match and match[1] == "cuda":
        return f"cuda:{int(match[2] or 0)}"
    raise PlacementError(f"{what} {value!r} is not a valid device; use {_DEVICE_FORMS}.")


def parse_max_memory(max_memory: Mapping[Any, int | str]) -> dict[str, int]:
    """{normalized device: bytes} from a max_memory dict such as {0: "20GiB", "cpu": "8GiB"}."""
    if not isinstance(max_memory, Mapping):
        raise PlacementError(
            f"max_memory {max_memory!r} is not a dict; give e.g. {{0: '20GiB', 'cpu': '8GiB'}}."
        )
    return _parse_budget_pairs(max_memory.items())


def parse_max_memory_arg(text: str) -> dict[str, int]:
    """The CLI form "cpu=2GiB,0=20GiB" parsed like parse_max_memory."""
    pairs = []
    for item in (part.strip() for part in text.split(",")):
        key, sep, value = (piece.strip() for piece in item.partition("="))
        if not (key and sep and value):
            raise PlacementError(
                f"max memory entry {item!r} is not DEVICE=SIZE; write e.g. 'cpu=2GiB,0=20GiB'."
            )
        pairs.append((key, value))
    return _parse_budget_pairs(pairs)


def _parse_budget_pairs(pairs: Iterable[tuple[Any, Any]]) -> dict[str, int]:
    budgets: dict[str, int] = {}
    for key, value in pairs:
        device = checked_device(key, "max_memory key")
        if device == "disk":
            raise PlacementError(
                "max_memory key 'disk' is not allowed: disk is unlimited; budget only accelerators and 'cpu'."
            )
        if device in budgets:
            raise PlacementError(
                f"max_memory names device {device} twice (again as {key!r}); give each device once."
            )
        budgets[device] = _parse_memory(value, f"max_memory[{key!r}] =")
    return budgets


def format_bytes(size: int) -> str:
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
