"""The compile decision: whether generate() compiles the decode step, and why not.

`decide()` is the only place that decides. It looks at the resolved placement, the cache and the
generation config (never at a loaded model), so any placement can be reasoned about on any machine.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tierlm.config import cache_root
from tierlm.errors import OptionError
from tierlm.placement.device_map import execution_device, format_modules, offloaded_modules


def use_inductor_cache() -> str:
    """Point torch inductor at tierlm's persistent cache folder (unless TORCHINDUCTOR_CACHE_DIR is set), so a
    second process starts warm, and check that inductor can compile there: it splits its C++ compiler
    commands as a shell would, so whitespace, quotes or a backslash in the path failed every compile with a
    bare "C++ compile error" (or "No closing quotation")."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    folder = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    if any(c.isspace() or c in "'\"\\" for c in folder):
        raise OptionError(
            f"torch inductor cannot compile in {folder!r}: its compiler commands break at whitespace, quotes "
            "and backslashes in that path; set TIERLM_CACHE_DIR (or TORCHINDUCTOR_CACHE_DIR) to one without"
        )
    return folder


class CompileSkippedWarning(UserWarning):
    """Compilation was requested (compile_config) but cannot happen as asked: generation runs eagerly, or
    (scope "model" under offload) with only the layer body compiled."""


SCOPES = ("model", "layer")
KNOWN_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's

# A CPU step's Python wrapper runs on every decode step, and inductor's checks of each extern kernel's
# output size, strides and alignment (two calls per kernel: ~240 a step for the default model at int4) were
# 4% of it (simulated AVX2 on a Zen 4, int4 whole step, interleaved in one process: 121.4 -> 126.0 tok/s,
# the same tokens). The kernels are aten's and tierlm's, which return what their fake kernels say. A
# CompileConfig's own options win.
CPU_WRAPPER_OPTIONS = {"size_asserts": False, "alignment_asserts": False}

# A CPU whole step with a C++ wrapper compiles its wrapper (one call per kernel, 30 layers unrolled) apart
# from its kernels and at -O1 (inductor's cpp_wrapper_build_separate): the int4 step's first call 34.8-35.9
# -> 23.8-32.5 s, its decode unchanged (simulated AVX2 on a Zen 4, fresh inductor caches, alternated runs).
# A layer body's wrapper runs once per layer per step and is small: it keeps inductor's one -O3 build.
CPU_WHOLE_STEP_CPP_OPTIONS = {"cpp_wrapper_build_separate": True}

# max-autotune writes a table per tuned product to stderr (20-40 lines a step); tierlm says it is compiling.
QUIET_AUTOTUNE_OPTIONS = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}


@dataclass(frozen=True)
class CompileConfig:
    """How the decode step is compiled with torch.compile.

    mode None means "reduce-overhead" on CUDA for scope "model" ("default" for scope "layer", which CUDA
    graphs cannot serve); on CPU "max-autotune-no-cudagraphs" for scope "model" (inductor's C++ GEMM
    kernels on frozen, prepacked weights: 120 tok/s bf16 on the default model against 57 with mode
    "default", for a ~2 min compile instead of ~50 s; see docs/compile.md) and "default" for scope "layer".
    freezing None means on for CPU (weights become graph constants and are prepacked; only scope "model"
    freezes, and only resident models get it, so no streamed weight is ever frozen).
    cpp_wrapper (inductor's C++ wrapper instead of its Python one) trims per-call overhead at the cost of
    compile time; None means on for scope "layer" on the CPU, whose body is called once per layer per
    step (int4 layer-compiled decode of the default model 46.0 -> 50.6 tok/s, every layer streamed from
    disk 1.55x -> 1.72x its eager decode, interleaved on a Zen 3), off otherwise (a whole step with it:
    74.5 against 63.4 tok/s at int4 there, but a 158 s cold compile against 27 s).
    scope "model" compiles the whole decode step (one graph, fastest, long cold compile); "layer" compiles
    one layer body that every layer reuses (~15 s cold compile; weights are inputs, so it never freezes);
    it is what compiles under offload, where the streamed weights arrive as those inputs.
    """

    fullgraph: bool = True
    dynamic: bool = False
    backend: str = "inductor"
    mode: str | None = None
    options: dict[str, Any] | None = None
    freezing: bool | None = None
    cpp_wrapper: bool | None = None
    scope: str = "model"

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise OptionError(f"CompileConfig.scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        for name in ("fullgraph", "dynamic", "freezing", "cpp_wrapper"):
            value, optional = (
                getattr(self, name),
                name != "fullgraph",
            )  # dynamic=None: torch.compile's default
            if not isinstance(value, bool) and not (value is None and optional):
                valid = "True or False" + (" or None" if optional else "")
                raise OptionError(f"CompileConfig.{name} must be {valid}, got {value!r}")
        _check_backend(self.backend)
        if self.mode is not None:
            _check_mode(self.mode)
        if self.options is not None:
            _check_options(self.options, self.backend)

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
        if device.startswith("cuda"):  # a layer body runs once per layer in a step: see LAYER_GRAPHS
            return "reduce-overhead" if self.scope == "model" else "default"
        return "max-autotune-no-cudagraphs" if self.scope == "model" else "default"

    def resolved_freezing(self, device: str) -> bool:
        """Whether inductor freezes the weights: on the CPU unless the config says otherwise, and only for
        the whole step (a shared layer body takes its weights as inputs)."""
        freezing = self.freezing if self.freezing is not None else not device.startswith("cuda")
        return freezing and self.scope == "model"

    def resolved_cpp_wrapper(self, device: str) -> bool:
        if self.cpp_wrapper is not None:
            return self.cpp_wrapper
        return self.scope == "layer" and device.startswith("cpu")

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
        freezing = self.resolved_freezing(device)
        options.update({"freezing": freezing, "cpp_wrapper": self.resolved_cpp_wrapper(device)})
        if device.startswith("cpu"):  # the options this torch's inductor has
            cpu_options = dict(CPU_WRAPPER_OPTIONS)
            if options["cpp_wrapper"] and self.scope == "model":
                cpu_options.update(CPU_WHOLE_STEP_CPP_OPTIONS)
            options.update({k: v for k, v in cpu_options.items() if hasattr(torch._inductor.config, k)})
        options.update(
            {k: v for k, v in QUIET_AUTOTUNE_OPTIONS.items() if hasattr(torch._inductor.config, k)}
        )
        options.update(self.options or {})
        kwargs["options"] = options
        return kwargs


def _check_backend(backend: Any) -> None:
    """A torch.compile backend: a name torch registers or a callable (names are checked here, not at the
    first compiled step after a load)."""
    if callable(backend) or backend == "inductor":
        return
    if not isinstance(backend, str):
        raise OptionError(f"CompileConfig.backend must be a backend name or a callable, got {backend!r}")
    import torch._dynamo

    names = torch._dynamo.list_backends(exclude_tags=())
    if backend not in names:
        close = difflib.get_close_matches(backend, names, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "e.g. 'inductor', 'eager', 'aot_eager'"
        raise OptionError(f"CompileConfig.backend {backend!r} is not a torch.compile backend ({hint})")


def _check_mode(mode: Any) -> None:
    if mode in KNOWN_MODES:
        return
    if not isinstance(mode, str):
        raise OptionError(f"CompileConfig.mode must be None or a torch.compile mode name, got {mode!r}")
    import torch._inductor

    try:
        torch._inductor.list_mode_options(mode)  # a mode a newer torch added passes
    except RuntimeError as e:
        raise OptionError(f"CompileConfig.mode: {e}") from None


def _check_options(options: Any, backend: Any) -> None:
    """inductor's options (torch.compile takes them only for inductor): a dict of its config names."""
    if backend != "inductor":
        raise OptionError(f"CompileConfig.options are inductor's; backend {backend!r} takes none")
    if not isinstance(options, Mapping):
        raise OptionError(f"CompileConfig.options must be a dict of inductor option names, got {options!r}")
    import torch._inductor.config

    known = torch._inductor.config.get_config_copy()
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise OptionError(f"CompileConfig.options: {key!r} is not an inductor option{hint}")


@dataclass(frozen=True)
class CompileDecision:
    """Whether the decode step is compiled, what is compiled, and every reason it is not.

    scope "model": the whole step is one graph; "layer": one layer body serves every layer, and what
    streams (`streamed`, e.g. "model.layers.9-29 stream from disk") stays outside it. config: the
    CompileConfig the step is built with (None: CompileConfig()); under offload it is the caller's with
    scope "layer". whole_step: why the whole step is not one graph when only the layer body compiles.
    """

    compile: bool
    reasons: tuple[str, ...] = ()
    device: str = "cpu"
    scope: str = "model"
    streamed: tuple[str, ...] = ()
    whole_step: tuple[str, ...] = ()
    layers: int | None = None
    config: CompileConfig | None = None

    def explain(self) -> str:
        if not self.compile:
            return "compile: no (" + "; ".join(self.reasons) + ")"
        if self.scope == "model":
            return f"compile: yes (decode step on {self.device})"
        what = ([f"{self.layers} layers"] if self.layers is not None else []) + list(self.streamed)
        line = f"compile: layer body on {self.device}" + (" (" + "; ".join(what) + ")" if what else "")
        line += "; whole step: no (" + "; ".join(self.whole_step) + ")"
        if self.streamed:
            line += "; eager: embedding, final norm, LM head, fetch/release"
        return line


FELL_BACK = "scope 'model' fell back to 'layer'"
# Modes that record CUDA graphs: a graph replays fixed weight addresses, streamed weights arrive at new ones.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
LAYER_GRAPHS = (
    "one layer body runs once per layer in a step, and each replay of a CUDA graph overwrites the output "
    "of the one before (the input of this layer); use mode='default' or 'max-autotune-no-cudagraphs'"
)


def decide(
    placement: Mapping[str, Any] | None,
    cache: Any,
    generation_config: Any,
    *,
    uncompilable: Sequence[str] = (),
    device: str | None = None,
    layers: int | None = None,
) -> CompileDecision:
    """Compile only if enabled, the cache is compilable and the device is supported; under offload, only
    with a compile_config, and then the layer body alone (the streamed weights are its inputs).

    placement: the resolved module -> device map (None: the whole model on the CPU). cache: a cache object
    or its kind ("static", "dynamic"). uncompilable: reasons the model itself cannot be compiled.
    device: the execution device the placement resolved to (it honours `execution_device=`); None
    derives it from the map. layers: how many layers the model has (for the explanation only).
    """
    placement = dict(placement) if placement else {"": "cpu"}
    device = str(device) if device is not None else execution_device(placement)
    cc = generation_config.compile_config
    offloaded = _offloaded(placement)
    reasons = _reasons_not_to(generation_config, cache, device, offloaded, uncompilable)
    if reasons:
        return CompileDecision(False, tuple(reasons), device, layers=layers, config=cc)
    if not offloaded:
        scope = (cc or CompileConfig()).scope
        whole = ("scope 'layer'",) if scope == "layer" else ()
        return CompileDecision(True, (), device, scope, (), whole, layers, cc)
    streamed = _where(offloaded, "streams from", "stream from")
    whole_step = ("offloaded",)
    if cc.scope == "model":  # the whole step was asked for: say why not, and what runs instead
        whole_step = (*_where(offloaded, "is offloaded to", "are offloaded to"), FELL_BACK)
    config = streamed_config(cc, device)
    return CompileDecision(True, (), device, "layer", streamed, whole_step, layers, config)


def _reasons_not_to(
    config: Any, cache: Any, device: str, offloaded: list[tuple[str, list[str]]], uncompilable: Sequence[str]
) -> list[str]:
    """Every reason not to compile: none means compile (the whole step, or under offload the layer body)."""
    cc = config.compile_config
    reasons: list[str] = []
    if config.disable_compile:
        reasons.append("disable_compile=True")
    kind = cache if isinstance(cache, str) else cache.kind
    compileable = cache == "static" if isinstance(cache, str) else cache.is_compileable
    if not compileable:
        reasons.append(f"cache {kind!r} is not compilable; use cache_implementation='static'")
    if not device.startswith("cuda") and cc is None:
        reasons.append(f"execution device {device!r} compiles only when compile_config is set")
    if cc is None:  # the seed's behaviour: offload without consent runs eagerly, silently
        reasons.extend(_where(offloaded, "is offloaded to", "are offloaded to"))
    reasons.extend(uncompilable)
    if cc is not None and device.startswith("cuda") and cc.mode in CUDA_GRAPH_MODES:
        if offloaded:
            reasons.append(
                f"mode {cc.mode!r} records CUDA graphs, which cannot take weights that stream in; "
                "use mode='default' or 'max-autotune-no-cudagraphs'"
            )
        elif cc.scope == "layer":
            reasons.append(f"mode {cc.mode!r} with scope 'layer': {LAYER_GRAPHS}")
    return reasons


def streamed_config(cc: CompileConfig, device: str) -> CompileConfig:
    """The config a model whose weights stream is compiled with: scope "layer" (weights are the body's
    inputs, never frozen) and, on CUDA unless a mode was given, no CUDA graphs."""
    cc = replace(cc, scope="layer")
    return replace(cc, mode="default") if cc.mode is None and device.startswith("cuda") else cc


def _offloaded(placement: Mapping[str, Any]) -> list[tuple[str, list[str]]]:
    offloaded = offloaded_modules(placement)
    return [(tier, offloaded[tier]) for tier in ("cpu", "disk") if offloaded.get(tier)]


def _where(offloaded: list[tuple[str, list[str]]], one: str, many: str) -> tuple[str, ...]:
    """ "model.layers.9-29 stream from disk" per tier (`one` / `many`: the verb for one name / several)."""
    return tuple(f"{format_modules(n)} {one if len(n) == 1 else many} {tier}" for tier, n in offloaded)


_warned: set[str] = set()  # causes already reported in this process


def warn_if_skipped(decision: CompileDecision, generation_config: Any) -> None:
    """Warn once per distinct cause when compile_config was set but the step will not be compiled, or
    (scope "model" under offload) will be compiled only as a layer body."""
    cc = generation_config.compile_config
    if cc is None:
        return
    if decision.compile:
        if decision.whole_step[-1:] != (FELL_BACK,):
            return
        offloaded = "; ".join(decision.whole_step[:-1])
        if offloaded in _warned:
            return
        _warned.add(offloaded)
        warnings.warn(
            f"compile_config has scope 'model', but the whole decode step cannot be compiled while weights "
            f"stream ({offloaded}); compiling the layer body instead, as CompileConfig(scope='layer') does "
            "under offload without this warning",
            CompileSkippedWarning,
            stacklevel=3,
        )
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
