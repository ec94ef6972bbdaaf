"""The compile decision: whether generate() compiles the decode step, and why not.

`decide()` is the only place that decides. It looks at the resolved placement, the cache and the
generation config (never at a loaded model), so any placement can be reasoned about on any machine.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierlm.placement.device_map import execution_device, format_modules, offloaded_modules


class CompileSkippedWarning(UserWarning):
    """Compilation was requested (compile_config) but cannot happen; generation runs eagerly."""


SCOPES = ("model", "layer")


@dataclass(frozen=True)
class CompileConfig:
    """How the decode step is compiled with torch.compile.

    mode None means "reduce-overhead" on CUDA; on CPU "max-autotune-no-cudagraphs" for scope "model"
    (inductor's C++ GEMM kernels on frozen, prepacked weights: 120 tok/s bf16 on the default model
    against 57 with mode "default", for a ~2 min compile instead of ~50 s; see DESIGN.md) and "default"
    for scope "layer". freezing None means on for CPU (weights become graph constants and are prepacked;
    only resident models compile, so that is safe). cpp_wrapper trims per-step overhead at the cost of
    compile time. scope "model" compiles the whole decode step (one graph, fastest, long cold compile);
    "layer" compiles one layer body that every layer reuses (~15 s cold compile; weights are inputs, so it
    never freezes).
    """

    fullgraph: bool = True
    dynamic: bool = False
    backend: str = "inductor"
    mode: str | None = None
    options: dict[str, Any] | None = None
    freezing: bool | None = None
    cpp_wrapper: bool = False
    scope: str = "model"

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"CompileConfig.scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")

    def __hash__(self) -> int:
        opts = tuple(sorted((self.options or {}).items()))
        return hash(
            (
                self.fullgraph,
                self.dynamic,
                self.backend,
                self.mode,
                opts,
                self.freezing,
                self.cpp_wrapper,
                self.scope,
            )
        )

    def resolved_mode(self, device: str) -> str:
        if self.mode is not None:
            return self.mode
        if device.startswith("cuda"):
            return "reduce-overhead"
        return "max-autotune-no-cudagraphs" if self.scope == "model" else "default"

    def compile_kwargs(self, device: str) -> dict[str, Any]:
        """Keyword arguments for torch.compile: inductor options carry the mode (both cannot be passed)."""
        kwargs: dict[str, Any] = {
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
            "backend": self.backend,
        }
        if self.backend != "inductor":
            return kwargs
        import torch._inductor

        options = dict(torch._inductor.list_mode_options(self.resolved_mode(device)))
        freezing = self.freezing if self.freezing is not None else not device.startswith("cuda")
        freezing = freezing and self.scope == "model"  # a shared layer body takes weights as inputs
        options.update({"freezing": freezing, "cpp_wrapper": self.cpp_wrapper}, **(self.options or {}))
        kwargs["options"] = options
        return kwargs


@dataclass(frozen=True)
class CompileDecision:
    """Whether the decode step is compiled, and every reason it is not."""

    compile: bool
    reasons: tuple[str, ...] = ()
    device: str = "cpu"

    def explain(self) -> str:
        if self.compile:
            return f"compile: yes (decode step on {self.device})"
        return "compile: no (" + "; ".join(self.reasons) + ")"


def decide(
    placement: Mapping[str, Any] | None,
    cache: Any,
    generation_config: Any,
    *,
    uncompilable: Sequence[str] = (),
    device: str | None = None,
) -> CompileDecision:
    """Compile only if enabled, the cache is compilable, the device is supported and nothing is offloaded.

    placement: the resolved module -> device map (None: the whole model on the CPU). cache: a cache object
    or its kind ("static", "dynamic"). uncompilable: reasons the model itself cannot be compiled.
    device: the execution device the placement resolved to (it honours `execution_device=`); None
    derives it from the map.
    """
    placement = dict(placement) if placement else {"": "cpu"}
    device = str(device) if device is not None else execution_device(placement)
    config = generation_config
    reasons: list[str] = []
    if config.disable_compile:
        reasons.append("disable_compile=True")
    kind = cache if isinstance(cache, str) else cache.kind
    compileable = cache == "static" if isinstance(cache, str) else cache.is_compileable
    if not compileable:
        reasons.append(f"cache {kind!r} is not compilable; use cache_implementation='static'")
    if not device.startswith("cuda") and config.compile_config is None:
        reasons.append(f"execution device {device!r} compiles only when compile_config is set")
    offloaded = offloaded_modules(placement)
    for tier in ("cpu", "disk"):
        if offloaded.get(tier):
            names = offloaded[tier]
            verb = "is" if len(names) == 1 else "are"
            reasons.append(f"{format_modules(names)} {verb} offloaded to {tier}")
    reasons.extend(uncompilable)
    return CompileDecision(not reasons, tuple(reasons), device)


_warned: set[str] = set()  # causes already reported in this process


def warn_if_skipped(decision: CompileDecision, generation_config: Any) -> None:
    """Warn once per distinct cause when compile_config was set but the step will not be compiled."""
    if decision.compile or generation_config.compile_config is None:
        return
    reasons = decision.reasons
    if generation_config.disable_compile:
        reasons = ("disable_compile=True overrides compile_config",)
    reasons = tuple(r for r in reasons if r not in _warned)
    if not reasons:
        return
    _warned.update(reasons)
    warnings.warn(
        "compile_config is set but the decode step will not be compiled: " + "; ".join(reasons),
        CompileSkippedWarning,
        stacklevel=3,
    )
