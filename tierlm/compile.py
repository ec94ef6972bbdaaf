"""The compile decision: whether generate() compiles the decode step, and why not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class CompileSkippedWarning(UserWarning):
    """Compilation was requested (compile_config) but cannot happen; generation runs eagerly."""


@dataclass(frozen=True)
class CompileConfig:
    """How the decode step is compiled with torch.compile."""

    fullgraph: bool = True
    dynamic: bool = False
    backend: str = "inductor"
    mode: str | None = None  # None: "reduce-overhead" on CUDA, "default" elsewhere
    options: dict[str, Any] | None = None
