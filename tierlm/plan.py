"""The load plan: everything `load()` will do, from the checkpoint's header and the arguments (no weight is
read). `load()` executes one (tierlm.loading); `tierlm plan` prints one (`describe_plan`)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from tierlm import cpu
from tierlm.compile import CompileConfig, CompileDecision, decide
from tierlm.config import ModelConfig
from tierlm.errors import OptionError, PlacementError
from tierlm.generation.config import GenerationConfig
from tierlm.gguf_read import is_gguf
from tierlm.models.decoder import Decoder
from tierlm.models.linear import FUSED_PROJECTIONS
from tierlm.module_names import under
from tierlm.placement.device_map import execution_device as executor_of
from tierlm.placement.device_map import format_bytes, format_modules
from tierlm.placement.limits import memory_limit
from tierlm.placement.placer import Placement, kv_bytes_per_token, parameter_table, resolve, single_device_map
from tierlm.weights import gguf_cache
from tierlm.weights.gguf import GGUFCheckpoint
from tierlm.weights.gguf_blocks import INT4_TYPES
from tierlm.weights.layout import transposes_wide_weights, wide_weight_names
from tierlm.weights.load import (
    check_tensors,
    default_gguf_dtype,
    default_model_path,
    open_checkpoint,
    resolve_dtype,
)

_LAYER = re.compile(r"^model\.layers\.(\d+)$")

# The load steps in the order they run (a plan lists those that apply); why each is where it is:
STEP_ORDER = (
    "open",  # the checkpoint reader and tokenizer (a GGUF file is dequantized into its cache here)
    "build",  # every resident and cpu-tier tensor read once, to its device; disk-tier ones stay on meta
    "widen_prefill",  # bf16 on a CPU without native bf16: prefill products widen to fp32 (tierlm.cpu)
    "quantize",  # resident linears; before `stream`, which packs offloaded ones the same way
    "transpose",  # fp32 CPU layout; before `stream`, whose disk sources are stored in the same layout
    "stream",  # offloaded units hooked to a Streamer
    "fuse",  # last: quantize and transpose replace the weights that fusion would make views of
)


class Quantization(NamedTuple):
    mode: str  # "int8" or "int4"
    group: int  # int4 group size
    # modules int8 under int4: by default, a GGUF's projections not stored as 4-bit blocks (Q5_0, Q6_K, Q8_0 ...)
    int8: tuple[str, ...] = ()

    def of(self, module: str) -> str:
        """The quantization of this module: "int8" or "int4" (a module quantizes: tierlm.quant.quantizes)."""
        from tierlm.quant import mode_of

        return "int8" if module in self.int8 else mode_of(module, self.mode)


@dataclass(frozen=True)
class LoadPlan:
    """What `load()` does with a checkpoint: the settings it resolves, where each weight goes, what it
    streams and costs, and the steps it runs, in order. Two plans of the same inputs compare equal."""

    path: Path
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device  # the device asked for; placement.device is where the forward runs
    quantization: Quantization | None
    placement: Placement
    tied: tuple[tuple[str, str], ...]  # (leader, follower) parameter names sharing one tensor
    module_bytes: dict[str, int]  # per module of the placement's map, at the planned dtype / packing
    streamed_bytes: dict[str, int]  # per decoded token, by tier ("cpu", "disk")
    kv_bytes_per_token: int  # K/V of one token of one sequence
    widen_prefill: bool
    transposed: frozenset[str]  # weights stored transposed (weights.layout)
    fusion: tuple[tuple[str, tuple[str, ...]], ...]  # (module, its projections fused into one weight)
    offload_folder: Path
    decision: CompileDecision  # for a generate call with `cache` and `compile` as planned
    steps: tuple[str, ...]  # from STEP_ORDER, in that order
    # groups of `fusion`'s kind inside disk units run in place on a CPU: fused by the `stream` step, the fused
    # weights written to a file (tierlm.placement.fused)
    streamed_fusion: tuple[tuple[str, tuple[str, ...]], ...] = ()


def plan(
    path: str | Path | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    device_map=None,
    max_memory=None,
    offload_folder: str | Path | None = None,
    execution_device: str | None = None,
    quantize: str | None = "auto",
    group_size: int | None = None,
    cache: str = "static",
    compile: bool = False,
) -> LoadPlan:
    """The LoadPlan of `load(path, ...)` with these arguments, from metadata only; `cache` and `compile`
    choose the generate call its compile decision is for."""
    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    dev = _device(device)
    if execution_device is not None:
        execution_device = str(_device(execution_device, "execution_device"))
    checkpoint, target = _header(path, dtype, dev)
    cfg = checkpoint.config
    device_map = single_device_map(device_map)  # before the quantization default reads where it runs
    quant = _quantization(quantize, group_size, dtype, path, dev, device_map, max_memory, execution_device)
    names, sizes, tied = parameter_table(cfg, target, quant)
    kv = kv_bytes_per_token(cfg, target)
    placement = resolve(names, sizes, device_map, max_memory, str(dev), tied, kv, execution_device)
    module_bytes = {m: sum(b for n, b in sizes.items() if under(n, m)) for m in placement.module_map}
    with torch.device("meta"):
        probe = Decoder(cfg)  # module shapes, no storage
    check_tensors(checkpoint, probe)  # as load() checks them, before anything is read
    transposed = frozenset()
    if transposes_wide_weights(target, placement.device, quant.mode if quant else None):
        transposed = frozenset(wide_weight_names(probe, tied))
    fusion = _fusion(probe, placement, quant, target, transposed)
    streamed_fusion = _fusion(probe, placement, quant, target, transposed, streamed=True)
    widen = target == torch.bfloat16 and placement.device.type == "cpu" and cpu.detect().widens_bf16_prefill
    return LoadPlan(
        path=path,
        config=cfg,
        dtype=target,
        device=dev,
        quantization=quant,
        placement=placement,
        tied=tuple(tied),
        module_bytes=module_bytes,
        streamed_bytes={t: sum(module_bytes[m] for m in placement.offloaded[t]) for t in ("cpu", "disk")},
        kv_bytes_per_token=kv_bytes_per_token(cfg, target, 1),
        widen_prefill=widen,
        transposed=transposed,
        fusion=fusion,
        offload_folder=Path(offload_folder) if offload_folder else gguf_cache.cache_root() / "offload",
        decision=_decision(placement, cache, compile, cfg.num_layers),
        steps=_steps(widen, quant is not None, bool(transposed), not placement.resident, bool(fusion)),
        streamed_fusion=streamed_fusion,
    )


def _device(device, name: str = "device") -> torch.device:
    """`device` as a torch.device tierlm runs on (cpu, cuda, cuda:N, mps), else one ValueError naming it."""
    valid = "'cpu', 'cuda', 'cuda:N' or 'mps'"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps"):
        tier = " ('disk' is a tier of a device map, not a device)" if device == "disk" else ""
        raise PlacementError(f"{name} must be {valid}, got {device!r}{tier}")
    return dev


def _decision(placement: Placement, cache: str, compile: bool, layers: int) -> CompileDecision:
    """decide() for a generate call with this cache kind, and a default CompileConfig if `compile`."""
    generation = GenerationConfig(
        cache_implementation=cache, compile_config=CompileConfig() if compile else None
    )
    return decide(placement.module_map, cache, generation, device=str(placement.device), layers=layers)


def _steps(*applies: bool) -> tuple[str, ...]:
    """The steps of STEP_ORDER that run: "open" and "build" always, the others when they apply (in order)."""
    return STEP_ORDER[:2] + tuple(s for s, on in zip(STEP_ORDER[2:], applies, strict=True) if on)


def _quantization(
    quantize, group_size, dtype, path: Path, device: torch.device, device_map, max_memory, execution_device
) -> Quantization | None:
    """What `quantize` makes of the projections. "auto" (the default), when the dtype is left to tierlm and
    the forward runs on the CPU: a GGUF's 4-bit projections (Q4_0, Q4_1, Q4_K) stay packed (int4 with the
    file's own codes in its groups of 32, the LM head int8) where this CPU decodes them faster packed
    (`cpu.keeps_q4_packed`); its other quantized projections (Q5_0, Q6_K, Q8_0 ...) become int8 where this
    CPU decodes those faster (`cpu.keeps_quantized_as_int8`), beside int4 ones too; otherwise every weight
    is float. None: float; "int8" / "int4": as asked (int4 keeps 4-bit blocks' codes at group 32, and
    requantizes the other projections)."""
    kinds = functools.cache(lambda: gguf_cache.projection_kinds(path))  # at most one read of the header

    def types() -> list[str]:
        return list(kinds().values())

    if group_size is not None and (
        isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
    ):
        raise OptionError(f"group_size must be a positive int (or None: the default), got {group_size!r}")
    if group_size is not None and quantize in (None, "int8"):
        what = (
            "int8 weights are quantized per output channel"
            if quantize
            else "quantize=None keeps float weights"
        )
        raise OptionError(f"group_size is int4's (quantize='int4' or 'auto'); {what}")
    int8: tuple[str, ...] = ()
    if quantize == "auto":
        quantize = None
        if dtype == "auto" and _runs_on_cpu(device, device_map, max_memory, execution_device):
            features = cpu.detect()
            mixed = features.keeps_quantized_as_int8 and gguf_cache.quantized_blocks(types())
            four_bit = [t in INT4_TYPES for t in types()]
            if features.keeps_q4_packed and any(four_bit) and (all(four_bit) or mixed):
                quantize = "int4"
                int8 = tuple(m for m, t in kinds().items() if t not in INT4_TYPES)
            elif mixed:
                quantize = "int8"
    if quantize is None:
        return None
    group = group_size if group_size is not None else gguf_cache.default_int4_group(types())
    return Quantization(quantize, group, int8)


def _runs_on_cpu(device: torch.device, device_map, max_memory, execution_device) -> bool:
    """Whether the forward runs on the CPU, from the arguments alone (no accelerator in the map or budget)."""
    if execution_device is not None:
        return torch.device(execution_device).type == "cpu"
    if device.type != "cpu":
        return False
    devices = device_map if isinstance(device_map, dict) else {d: d for d in max_memory or {}}
    try:
        return executor_of(devices) == "cpu"
    except ValueError:  # a device it cannot read: `resolve` names the entry, after this
        return False


def _header(path: Path, dtype, device: torch.device):
    """The checkpoint (its header read, no tensor) and the compute dtype (a GGUF's cached copy, if any)."""
    if is_gguf(path):
        target = default_gguf_dtype(device) if dtype == "auto" else resolve_dtype(dtype, None, device)
        checkpoint = gguf_cache.open_cached(path, target) or GGUFCheckpoint.open(path)
        return checkpoint, target
    checkpoint = open_checkpoint(path)
    return checkpoint, resolve_dtype(dtype, checkpoint, device)


def _fusion(
    probe: Decoder, placement: Placement, quant, dtype, transposed, streamed: bool = False
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Per resident layer, each FUSED_PROJECTIONS group whose projections all get the same kernel: all float,
    all int8, or all int4 on the CPU with rows in multiples of 64 (tierlm.quant's `fuse`). None at all with
    a transposed layout (fusing would change its sums between placements). streamed: instead the groups
    wholly inside one disk unit of a CPU forward (used in place from memory-mapped files, so a fused weight
    can be one more file); other offloaded units never fuse."""
    if transposed or (streamed and placement.device.type != "cpu"):
        return ()
    offloaded = placement.offloaded["cpu"] + placement.offloaded["disk"]
    table = []
    for i in range(len(probe.model.layers)):
        layer = f"model.layers.{i}"
        touched = any(under(layer, u) or under(u, layer) for u in offloaded)
        for parent, parts in FUSED_PROJECTIONS.items():
            module = f"{layer}.{parent}"
            names = [f"{module}.{p}" for p in parts]
            if streamed and not _in_one_disk_unit(names, placement):
                continue
            if not streamed and touched:
                continue
            kinds = {_kernel(probe, n, quant, dtype, placement.device) for n in names}
            rows = [probe.get_submodule(n).weight.shape[0] for n in names]
            if len(kinds) == 1 and (
                kinds != {"int4"} or (placement.device.type == "cpu" and not any(r % 64 for r in rows))
            ):
                table.append((module, parts))
    return tuple(table)


def _in_one_disk_unit(names: list[str], placement: Placement) -> bool:
    """Whether the weights of the projections `names` all stream from disk in one unit (the most specific
    offloaded module holding each is the same disk unit)."""
    offloaded = placement.offloaded["cpu"] + placement.offloaded["disk"]
    units = set()
    for name in names:
        weight = f"{name}.weight"
        owners = [u for u in offloaded if under(weight, u)]
        if placement.tier_of(weight) != "disk" or not owners:
            return False
        units.add(max(owners, key=len))
    return len(units) == 1 and units <= set(placement.offloaded["disk"])


def _kernel(probe: Decoder, name: str, quant: Quantization | None, dtype, device: torch.device) -> str:
    """ "float", "int8" or "int4": what quantization makes of this linear, as tierlm.quant.quantize_decoder
    does (an int4 shape or dtype its kernel cannot take stays in float)."""
    from tierlm.quant import check_int4_shape, quantizes

    if quant is None or not quantizes(name):
        return "float"
    if quant.of(name) == "int8":
        return "int8"
    if device.type == "cuda" and dtype != torch.bfloat16:
        return "float"
    out_features, in_features = probe.get_submodule(name).weight.shape
    try:
        check_int4_shape(out_features, in_features, quant.group, device)
    except ValueError:
        return "float"
    return "int4"


def describe_plan(path=None, **kwargs) -> str:
    """The plan as the text `tierlm plan` prints."""
    p = plan(path, **kwargs)
    cfg, quant, placement = p.config, p.quantization, p.placement
    weights = (
        f", {quant.mode} weights" + (f" (group {quant.group})" if quant.mode == "int4" else "")
        if quant
        else ""
    )
    if quant and kwargs.get("quantize", "auto") == "auto":
        kept = (
            "the GGUF's 4-bit blocks kept as int4 (their own codes)"
            if quant.mode == "int4"
            else "the GGUF's quantized blocks"
        )
        if quant.int8:
            kept += f", its {len(quant.int8)} other projections int8"
        weights += f": {kept}, this CPU's default (--quantize none: float)"
    lines = [
        f"model: {path or default_model_path()} ({cfg.architecture}, {cfg.num_layers} layers, {str(p.dtype)[6:]}{weights})",
        f"execution device: {placement.device}",
        f"cpu: {cpu.detect().describe()}",
        "",
        f"{'module':<28} {'tier':<8} {'bytes':>12}",
    ]
    for names, tier, size in _runs(placement, p.module_bytes):
        tied = names == ["lm_head"] and cfg.tie_word_embeddings and not quant
        shown = "(tied to model.embed_tokens)" if tied else format_bytes(size)
        lines.append(f"{format_modules(names):<28} {tier:<8} {shown:>12}")
    totals: dict[str, int] = {}
    for module, size in p.module_bytes.items():
        tier = _tier(placement, module)
        totals[tier] = totals.get(tier, 0) + size
    lines += ["", "totals: " + ", ".join(f"{t} {format_bytes(b)}" for t, b in totals.items())]
    per_4k = kv_bytes_per_token(cfg, p.dtype, 4096) * 4096
    window = f" (sliding layers keep {cfg.sliding_window} tokens)" if cfg.sliding_layers else ""
    lines.append(
        f"kv cache per sequence: {format_bytes(p.kv_bytes_per_token)} per token, "
        f"{format_bytes(per_4k)} per 4k tokens{window}"
    )
    streamed = [f"{format_bytes(b)} from {t}" for t, b in p.streamed_bytes.items() if b]
    lines.append("streamed per token: " + (", ".join(streamed) or "nothing (all weights resident)"))
    read = read_per_token(p)
    lines.append("read per token: " + ", ".join(f"{format_bytes(b)} from {t}" for t, b in read.items() if b))
    lines.append(f"memory of this process: {memory_limit().describe()}")
    lines.append(p.decision.explain())
    return "\n".join(lines)


def read_per_token(p: LoadPlan) -> dict[str, int]:
    """Weight bytes one decoded token reads, by tier: "memory" (resident on the executing device), "cpu"
    (offloaded to RAM, copied to the device), "disk". The embedding table gives one row a token, unless
    the LM head is tied to it (then the head reads it whole)."""
    tied_head = p.module_bytes.get("lm_head", 0) == 0 and p.config.tie_word_embeddings
    read = dict.fromkeys(("memory", "cpu", "disk"), 0)
    for module, size in p.module_bytes.items():
        if module == "model.embed_tokens" and not tied_head:
            size = size // max(1, p.config.vocab_size)
        read[{"disk": "disk", "cpu (offloaded)": "cpu"}.get(_tier(p.placement, module), "memory")] += size
    return read


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
