"""Offloaded units that stream packed int8 / int4 weights instead of float ones.

Each projection of an offloaded unit is quantized once, layer by layer, from its float source. For the
"cpu" tier the packed tensors stay in (pinned) CPU RAM. For the "disk" tier they are written once to a
folder beside the float offload folders, one safetensors file per unit, atomically (temporary folder,
manifest last, rename), reused while the checkpoint, dtype, mode, group size and packing device match,
and memory-mapped from there, so the streamed bytes are the packed ones.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tierlm.placement.offload import Unit, _assign
from tierlm.quant import Int4Linear, Int8Linear, check_int4_shape, mode_of, quantized_linear, quantizes
from tierlm.weights.files import commit_folder, filling, folder_matches, fresh_tmp_folder
from tierlm.weights.safetensors import DTYPES, header
from tierlm.weights.safetensors_write import write_safetensors

ALIGN = 64


def _targets(module: nn.Module, unit_name: str) -> list[str]:
    """Names, relative to the unit, of the linears that quantize (projections and the LM head)."""
    out = []
    for rel, child in module.named_modules():
        full = f"{unit_name}.{rel}" if rel else unit_name
        if isinstance(child, nn.Linear) and quantizes(full):
            out.append(rel)
    return out


def _join(prefix: str, leaf: str) -> str:
    return f"{prefix}.{leaf}" if prefix else leaf


def _quantize_linear(linear: nn.Linear, weight, bias, mode, group_size, dtype, device, full, blocks):
    """A quantized module for a float weight source, packed for `device` (ValueError if int4 cannot); int4
    from `blocks`' own 4-bit codes where it stores them (a GGUF's Q4_0, Q4_1, Q4_K: tierlm.quant)."""
    tmp = nn.Linear(linear.in_features, linear.out_features, bias=bias is not None, device="meta")
    tmp.weight = nn.Parameter(weight.to(device=device, dtype=dtype, copy=True), requires_grad=False)
    if bias is not None:
        tmp.bias = nn.Parameter(bias.to(device=device, dtype=dtype, copy=True), requires_grad=False)
    return quantized_linear(tmp, full, mode, group_size, dtype, blocks)


def _shell(linear: nn.Linear, tensors: dict[str, torch.Tensor], rel: str, mode: str, group_size: int):
    """The quantized module for tensors already packed (read back from a quantized offload folder)."""
    bias = tensors.get(_join(rel, "bias"))
    if mode == "int8":
        return Int8Linear(tensors[_join(rel, "weight_int8")], tensors[_join(rel, "scales")], bias)
    return Int4Linear(
        tensors[_join(rel, "weight_int4")],
        tensors[_join(rel, "scales_and_zeros")],
        linear.in_features,
        linear.out_features,
        group_size,
        bias,
    )


def _swap(decoder: nn.Module, full: str, new: nn.Module) -> None:
    parent_name, _, child = full.rpartition(".")
    setattr(decoder.get_submodule(parent_name) if parent_name else decoder, child, new)


def _tensors_of(module: nn.Module, rel: str) -> dict[str, torch.Tensor]:
    named = [*module.named_buffers(), *module.named_parameters()]
    return {_join(rel, n): t.detach() for n, t in named}


def write_aligned(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file whose every tensor starts at a multiple of ALIGN bytes in the file: the int8 / int4
    CPU kernels crash on weights that are not 64-byte aligned."""
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    write_safetensors(file, specs, tensors.items(), align=ALIGN)


def _mmap_all(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a packed unit file, as views of one copy-on-write mapping of the whole file (so a
    tensor is exactly as aligned as its file offset)."""
    import numpy as np

    start, head = header(file)
    whole = torch.from_numpy(np.memmap(file, dtype=np.uint8, mode="c"))
    out = {}
    for name, info in head.items():
        if name == "__metadata__" or name.startswith("~pad."):
            continue
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        out[name] = whole[start + begin : start + end].view(dtype).view(info["shape"])
    return out


def quantize_units(
    decoder: nn.Module,
    units: list[Unit],
    mode: str,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device,
    folder: Path,
    identity: dict,
    int8: tuple[str, ...] = (),
    blocks=None,
) -> list[Unit]:
    """Units whose projections are quantized modules fed from packed sources (see the module docstring).

    `folder`: where the packed disk tier lives (written here when missing or stale); `identity`: what it
    must match (checkpoint key, dtype). Linears the int4 kernel cannot take stay float, as when resident;
    those named in `int8` are int8; `blocks`: a GGUF whose 4-bit codes int4 keeps (as quantize_decoder).
    """
    want = {**identity, "mode": mode, "group_size": group_size, "packed_for": device.type, "head": "int8"}
    want["units"] = [u.name for u in units if u.tier == "disk"]
    reuse = folder_matches(folder, want)
    tmp = fresh_tmp_folder(folder) if want["units"] and not reuse else None
    out = []
    with filling(tmp, folder):
        for unit in units:
            stored = _mmap_all(folder / f"{unit.name}.safetensors") if unit.tier == "disk" and reuse else None
            sources, packed = _quantize_unit(
                decoder, unit, mode, group_size, dtype, device, stored, int8, blocks
            )
            sources.update(_stage(packed, unit, tmp, device))
            _assign(decoder.get_submodule(unit.name), sources)  # drop the in-RAM copies now
            out.append(Unit(unit.name, unit.tier, sources))
    if tmp is not None:
        commit_folder(tmp, folder, want)
    return out


def _quantize_unit(
    decoder: nn.Module,
    unit: Unit,
    mode: str,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device,
    stored: dict[str, torch.Tensor] | None,
    int8: tuple[str, ...] = (),
    blocks=None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Swap the unit's linears for quantized ones, quantized now or shells over `stored` (a packed disk
    tier's tensors): (its float sources left, its packed tensors)."""
    module = decoder.get_submodule(unit.name)
    sources = dict(unit.sources)
    packed: dict[str, torch.Tensor] = {}
    for rel in _targets(module, unit.name):
        linear = module.get_submodule(rel)
        full = _join(unit.name, rel) if rel else unit.name
        kind = "int8" if full in int8 else mode_of(full, mode)
        try:
            if kind == "int4":  # the same shapes fail every time: those linears stay float
                check_int4_shape(linear.out_features, linear.in_features, group_size, device)
            if stored is not None:
                new = _shell(linear, stored, rel, kind, group_size)
            else:
                weight, bias = sources[_join(rel, "weight")], sources.get(_join(rel, "bias"))
                new = _quantize_linear(linear, weight, bias, kind, group_size, dtype, device, full, blocks)
        except ValueError:
            continue
        for name in (_join(rel, "weight"), _join(rel, "bias")):
            sources.pop(name, None)
        _swap(decoder, full, new)
        packed.update(_tensors_of(new, rel))
    return sources, packed


def _stage(
    packed: dict[str, torch.Tensor], unit: Unit, tmp: Path | None, device: torch.device
) -> dict[str, torch.Tensor]:
    """Packed tensors where the unit's tier keeps them: a disk unit's written to `tmp` (when the folder is being
    written) and streamed from the file, a cpu unit's in (pinned, for CUDA) host memory."""
    if tmp is not None and unit.tier == "disk":
        file = tmp / f"{unit.name}.safetensors"
        write_aligned(file, {k: t.cpu().contiguous() for k, t in packed.items()})
        return _mmap_all(file)  # the mapping outlives the folder's rename
    if unit.tier == "cpu":
        pin = device.type == "cuda"
        return {k: (t.cpu().pin_memory() if pin else t.cpu()) for k, t in packed.items()}
    return packed
