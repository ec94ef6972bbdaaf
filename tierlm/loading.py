"""A LoadPlan executed: each name in `plan.steps` is a small function of (plan, Loading) run in that order;
the order and why it holds are tierlm.plan.STEP_ORDER, not the order of the functions here."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tierlm import cpu, kernels
from tierlm.errors import PlacementError
from tierlm.gguf_read import is_gguf
from tierlm.models import layers
from tierlm.models.decoder import Decoder
from tierlm.module_names import under
from tierlm.placement.offload import Streamer, Unit
from tierlm.placement.placer import Placement, disk_sources, offload_key, source_paths
from tierlm.plan import LoadPlan
from tierlm.tokenizer import Tokenizer
from tierlm.weights import gguf_cache
from tierlm.weights.gguf import GGUFCheckpoint
from tierlm.weights.layout import transpose_resident
from tierlm.weights.load import build_decoder, open_checkpoint
from tierlm.weights.safetensors import SafetensorsCheckpoint


@dataclass
class Loading:
    """What the steps have made so far."""

    progress: Callable[[int, int], None] | None = None
    checkpoint: object = None
    tokenizer: Tokenizer | None = None
    decoder: Decoder | None = None
    streamer: Streamer | None = None
    blocks: GGUFCheckpoint | None = None  # a GGUF's own blocks, whose 4-bit codes int4 keeps as they are


class _Source:
    """The checkpoint's tensors, and the 4-bit blocks of the GGUF it was dequantized from (its cache)."""

    def __init__(self, checkpoint, blocks: GGUFCheckpoint) -> None:
        self.checkpoint, self.blocks = checkpoint, blocks

    def load(self, name: str) -> torch.Tensor:
        return self.checkpoint.load(name)

    def int4_parts(self, name: str, block: int | None = None):
        return self.blocks.int4_parts(name, block)


def execute(plan: LoadPlan, progress: Callable[[int, int], None] | None = None) -> Loading:
    """Run the plan's steps in order (progress: called with (tensors read, tensors) while building)."""
    check_device(plan.placement)
    loading = Loading(progress)
    for name in plan.steps:
        STEPS[name](plan, loading)
    _trim_heap()
    return loading


def _trim_heap() -> None:
    """Hand the freed temporaries of a load (dequantized rows, int32 codes) back to the OS: glibc keeps freed
    heap memory in this process otherwise (~30-60 MB of RSS on the default model)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: glibc's where it is linked
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to trim
        pass


def check_device(placement: Placement) -> None:
    """The device the forward runs on exists in this process, else one ValueError naming it (a plan may
    describe another machine; a load happens on this one). Resident weights go there and offloaded ones to
    the CPU or disk (`_param_device`), so no other device of the map is touched (`execution_device`)."""
    device = str(placement.device)
    if device != "cpu":
        kind, _, index = device.partition(":")
        if kind == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise PlacementError(
                    f"device {device} is not available: this torch ({torch.__version__}) sees no CUDA GPU"
                )
            if int(index or 0) >= count:
                raise PlacementError(
                    f"device {device} is not available: this machine has {count} CUDA GPU(s)"
                )
        elif kind == "mps" and not torch.backends.mps.is_available():
            raise PlacementError(f"device {device} is not available on this machine")


def open_step(plan: LoadPlan, loading: Loading) -> None:
    """The checkpoint reader and the tokenizer. A GGUF whose weights all stay in memory, quantized, is read
    from the file itself (its 4-bit blocks as they are, the rest dequantized in memory); otherwise its
    weights are dequantized once into a disk cache (float loads and offloaded units read that)."""
    path = plan.path
    if not is_gguf(path):
        loading.checkpoint = open_checkpoint(path)
        loading.tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
        return
    loading.tokenizer = gguf_cache.open_cached_tokenizer(path)
    if loading.tokenizer is None:  # first: a file without one fails before minutes of dequantizing
        loading.tokenizer = Tokenizer.from_gguf(path)
        gguf_cache.store_tokenizer(path, loading.tokenizer)
    if plan.quantization is not None:  # int4 keeps the file's 4-bit codes
        loading.blocks = GGUFCheckpoint.open(path)
    if reads_file(plan):
        loading.checkpoint = loading.blocks
        return
    try:
        loading.checkpoint = gguf_cache.ensure(path, plan.dtype, loading.progress)
    except OSError as e:
        warnings.warn(
            f"cannot cache dequantized GGUF weights ({e}); loading from the GGUF file", stacklevel=5
        )
        loading.checkpoint = loading.blocks or GGUFCheckpoint(path)


def reads_file(plan: LoadPlan) -> bool:
    """Whether a GGUF load reads its weights from the file, with no dequantized copy on disk: every weight
    resident on the CPU and the projections quantized (those the quantize step reads one at a time)."""
    return plan.quantization is not None and plan.placement.resident and plan.placement.device.type == "cpu"


def build_step(plan: LoadPlan, loading: Loading) -> None:
    placement = plan.placement
    devices = {n: _param_device(placement, n) for n in placement.param_devices}
    if plan.quantization is not None and placement.device.type == "cpu":
        for name in _read_by_quantize(plan):  # read one at a time by the quantize step, never as float
            devices[name] = "meta"
    pin = placement.device.type == "cuda"
    loading.decoder = build_decoder(loading.checkpoint, plan.dtype, devices, loading.progress, pin_cpu=pin)
    if placement.device.type == "cpu":
        loading.decoder.attention_kernels(layers.attention_kernel())  # built here on first use
        # one-row bf16 products: tierlm's bf16 kernel where built, else torch.mv or F.linear, as this CPU is
        # faster
        kernel = cpu.detect().vector_kernel and kernels.bf16_vector_product() is not None
        loading.decoder.vector_products(eager=cpu.detect().eager_mv, kernel=kernel)


def _read_by_quantize(plan: LoadPlan) -> list[str]:
    """The resident projection weights the quantize step reads from the checkpoint itself (not tied
    followers, which share their leader's tensor)."""
    from tierlm.quant import quantizes

    followers = {f for _, f in plan.tied}
    offloaded = plan.placement.offloaded["cpu"] + plan.placement.offloaded["disk"]
    return [
        n
        for n in plan.placement.param_devices
        if n.endswith(".weight")
        and quantizes(n.removesuffix(".weight"))
        and n not in followers
        and not any(under(n, u) for u in offloaded)
    ]


def _param_device(placement: Placement, name: str):
    tier = placement.tier_of(name)
    if tier == "disk":
        return "disk"
    if tier == "cpu":
        return torch.device("cpu")
    return placement.device


def widen_prefill_step(plan: LoadPlan, loading: Loading) -> None:
    loading.decoder.widen_prefill()


def quantize_step(plan: LoadPlan, loading: Loading) -> None:
    """Resident linears; offloaded ones are quantized as the `stream` step builds their units."""
    from tierlm.quant import quantize_decoder

    offloaded = tuple(plan.placement.offloaded["cpu"] + plan.placement.offloaded["disk"])
    q = plan.quantization
    quantize_decoder(loading.decoder, q.mode, q.group, skip=offloaded, int8=q.int8, source=_source(loading))


def _source(loading: Loading):
    """Where the quantize steps read weights: the checkpoint, with a GGUF's own 4-bit blocks."""
    if loading.blocks is None or loading.checkpoint is loading.blocks:
        return loading.checkpoint
    return _Source(loading.checkpoint, loading.blocks)


def transpose_step(plan: LoadPlan, loading: Loading) -> None:
    transpose_resident(loading.decoder, plan.transposed)


def fuse_step(plan: LoadPlan, loading: Loading) -> None:
    loading.decoder.fuse(plan.fusion)


def stream_step(plan: LoadPlan, loading: Loading) -> None:
    """Hooks that stream every offloaded unit's weights (packed ones when the plan quantizes)."""
    decoder, checkpoint, placement = loading.decoder, loading.checkpoint, plan.placement
    params = dict(decoder.named_parameters(remove_duplicate=False))
    disk = _disk_sources(plan, checkpoint, params)
    units = []
    for tier in ("cpu", "disk"):
        for unit in placement.offloaded[tier]:
            members = [n for n in params if under(n, unit)]
            sources = {n[len(unit) + 1 :]: (disk[n] if tier == "disk" else params[n]) for n in members}
            units.append(Unit(unit, tier, sources))
    order = {name: i for i, name in enumerate(placement.module_map)}
    units.sort(key=lambda u: order[u.name])
    if plan.quantization is not None:
        units = _packed_units(plan, decoder, checkpoint, units, params, loading.blocks)
    if plan.streamed_fusion:
        units = _fused_units(plan, decoder, checkpoint, units, params)
    loading.streamer = Streamer(decoder, units, placement.device, placement.drop_disk_pages)


def _disk_sources(plan: LoadPlan, checkpoint, params: dict) -> dict[str, torch.Tensor]:
    """Memory-mapped sources of the disk tier's parameters (a tied follower shares its leader's)."""
    followers = {f: leader for leader, f in plan.tied}
    names = [n for n in params if plan.placement.tier_of(n) == "disk" and n not in followers]
    if not names:
        return {}
    if not isinstance(checkpoint, SafetensorsCheckpoint):
        raise PlacementError(
            "disk offload needs a safetensors checkpoint or a cached GGUF (cache not writable?)"
        )
    disk = disk_sources(checkpoint, names, plan.dtype, plan.offload_folder, plan.transposed)
    for follower, leader in followers.items():
        if leader in disk:
            disk[follower] = disk[leader]
    return disk


def _packed_units(
    plan: LoadPlan, decoder: Decoder, checkpoint, units: list[Unit], params: dict, blocks
) -> list[Unit]:
    from tierlm.placement.quantized import quantize_units

    placement, q = plan.placement, plan.quantization
    names = sorted(n for n in params if placement.tier_of(n) == "disk")
    key = offload_key(checkpoint, names) if isinstance(checkpoint, SafetensorsCheckpoint) else "resident"
    identity = {"checkpoint": key, "dtype": str(plan.dtype), "sources": source_paths(checkpoint)}
    if q.int8:
        identity["int8"] = sorted(q.int8)
    if blocks is not None:
        identity["int4_from"] = "gguf blocks"  # streamed, they keep their own codes too (resident's tokens)
    packed: Path = plan.offload_folder / f"{key}-{q.mode}-g{q.group}-{placement.device.type}"
    return quantize_units(
        decoder, units, q.mode, q.group, plan.dtype, placement.device, packed, identity, q.int8, blocks
    )


def _fused_units(plan: LoadPlan, decoder: Decoder, checkpoint, units: list[Unit], params: dict) -> list[Unit]:
    from tierlm.placement.fused import fuse_units

    names = sorted(n for n in params if plan.placement.tier_of(n) == "disk")
    identity = {
        "checkpoint": offload_key(checkpoint, names),
        "dtype": str(plan.dtype),
        "quantization": _quantization_identity(plan),
        "sources": source_paths(checkpoint),
    }
    return fuse_units(decoder, units, plan.streamed_fusion, plan.offload_folder, identity)


def _quantization_identity(plan: LoadPlan) -> list | None:
    """The plan's quantization as JSON keeps it (mode, group, then the int8 modules when there are any)."""
    q = plan.quantization
    if q is None:
        return None
    return [q.mode, q.group] + ([sorted(q.int8)] if q.int8 else [])


STEPS: dict[str, Callable[[LoadPlan, Loading], None]] = {
    "open": open_step,
    "build": build_step,
    "widen_prefill": widen_prefill_step,
    "quantize": quantize_step,
    "transpose": transpose_step,
    "stream": stream_step,
    "fuse": fuse_step,
}
