"""tierlm: decoder-only LLMs across memory tiers, compiled when placement allows."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierlm.compile import CompileConfig, CompileSkippedWarning
    from tierlm.config import ModelConfig
    from tierlm.errors import ModelFileError, OptionError, PlacementError, RequestError, TierlmError
    from tierlm.generation.config import GenerationConfig
    from tierlm.model import Model, load

# Public name -> the module defining it. Imported on first use, so that `import tierlm.config` (which runs
# this file first) loads no torch.
_EXPORTS = {
    "CompileConfig": "tierlm.compile",
    "CompileSkippedWarning": "tierlm.compile",
    "GenerationConfig": "tierlm.generation.config",
    "Model": "tierlm.model",
    "ModelConfig": "tierlm.config",
    "load": "tierlm.model",
    **{name: "tierlm.errors" for name in ("ModelFileError", "OptionError", "PlacementError", "RequestError")},
    "TierlmError": "tierlm.errors",
}

__all__ = [
    "CompileConfig",
    "CompileSkippedWarning",
    "GenerationConfig",
    "Model",
    "ModelConfig",
    "ModelFileError",
    "OptionError",
    "PlacementError",
    "RequestError",
    "TierlmError",
    "load",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tierlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
