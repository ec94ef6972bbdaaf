"""Streamed units whose projections are fused as resident layers' are (q/k/v, gate/up as one product).

On a CPU a disk unit's weights are used in place, memory-mapped, so a fused weight has to be one tensor in
a file. For each group of a plan's `streamed_fusion` the projections are fused as `Decoder.fuse` fuses a
resident layer's (`models.linear.fuse_projections`: float weights concatenated, packed int8/int4 rows by
their own `fuse`), the fused tensors are written once, 64-byte aligned, to a folder beside the offload
folders (one file per unit; atomically; reused while the checkpoint, dtype, quantization and groups
match) and memory-mapped back, and each projection's tensors become views of its rows there; the pages
of the tensors they replace are dropped. A unit's streamed bytes are then the fused file's (its `extra`
holds what no projection views, e.g. int4's concatenated scales and zeros). Where the folder cannot be
written, the layers stay unfused (a warning says why). A reused folder still costs one pass over the
projections at load: they are fused in RAM to find each view, then the file's tensors replace them.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from tierlm.models.linear import fuse_projections
from tierlm.module_names import under
from tierlm.placement.offload import Unit, _assign
from tierlm.placement.quantized import _join, _mmap_all, _tensors_of, write_aligned
from tierlm.weights.files import (
    commit_folder,
    filling,
    folder_matches,
    fresh_tmp_folder,
    identity_key,
    madvise_dontneed,
    page_span,
)


def fuse_units(decoder: nn.Module, units: list[Unit], table: tuple, root: Path, identity: dict) -> list[Unit]:
    """`units` with each group of `table` inside a disk unit fused, its fused tensors memory-mapped from
    <root>/<key>-fused/<unit>.safetensors (written when missing or stale). Where that folder cannot be
    written (read-only, full), `units` unchanged and unfused, with a warning: the load still works."""
    want = {**identity, "groups": [[m, list(p)] for m, p in table]}
    folder = root / f"{identity_key([json.dumps(want, sort_keys=True)])}-fused"
    done: list[tuple[Unit, list[nn.Module]]] = []  # units fused so far, and their owners (to undo)
    tmp = None
    try:
        reuse = folder_matches(folder, want)
        tmp = None if reuse else fresh_tmp_folder(folder)
        out = []
        with filling(tmp, folder):
            for unit in units:
                fused = _fuse_unit(
                    decoder, unit, table, tmp if tmp is not None else folder, write=tmp is not None, done=done
                )
                out.append(fused or unit)
        if tmp is not None:
            commit_folder(tmp, folder, want)
    except (OSError, ValueError) as e:
        for unit, owners in done:
            for owner in owners:
                owner.fused = None
            _assign(decoder.get_submodule(unit.name), unit.sources)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        warnings.warn(f"tierlm: streamed layers stay unfused ({e})", stacklevel=2)
        return units
    return out


def _fuse_unit(decoder, unit: Unit, table: tuple, folder: Path, write: bool, done: list) -> Unit | None:
    """`unit` with its groups fused from <folder>/<unit>.safetensors (written first if `write`), or None if
    none of `table`'s groups lies in it. The replaced sources' pages are dropped: the fused file's rows
    are what streams now."""
    groups = [(m, p) for m, p in table if unit.tier == "disk" and under(m, unit.name)]
    if not groups:
        return None
    module = decoder.get_submodule(unit.name)
    _assign(module, unit.sources)
    fused = {}  # relative owner name -> (owner module, FusedProjections with tensors in RAM)
    for name, parts in groups:
        owner = decoder.get_submodule(name)
        projection = fuse_projections(*(getattr(owner, p) for p in parts))
        if projection is not None:  # a kind whose `fuse` declines stays separate, as when resident
            fused[name[len(unit.name) + 1 :] if name != unit.name else ""] = (owner, projection)
    if not fused:
        return None
    done.append((unit, [owner for owner, _ in fused.values()]))
    tensors = {f"{_join(rel, 'fused')}.{n}": t for rel, (_, f) in fused.items() for n, t in _held(f)}
    file = folder / f"{unit.name}.safetensors"
    if write:
        write_aligned(file, {k: t.contiguous() for k, t in tensors.items()})
    mapped = _mmap_all(file)
    sources = dict(unit.sources)
    for rel, (owner, f) in fused.items():
        prefix = f"{_join(rel, 'fused')}."
        own = {n[len(prefix) :]: mapped[n] for n in mapped if n.startswith(prefix)}
        _rebind(owner, f, own, rel, sources)
        owner.fused = f
    for key, old in unit.sources.items():
        if sources[key] is not old:  # file-backed pages the forward no longer reads
            madvise_dontneed(*page_span(old))
    return Unit(unit.name, unit.tier, sources, tuple(mapped.values()))


def _held(f) -> list[tuple[str, torch.Tensor]]:
    """The tensors a FusedProjections multiplies by, by name: float weight and bias, or a packed module's."""
    if f.packed is not None:
        return list(_tensors_of(f.packed, "").items())
    return [(n, t) for n, t in (("weight", f.weight), ("bias", f.bias)) if t is not None]


def _rebind(owner: nn.Module, f, mapped: dict[str, torch.Tensor], rel: str, sources: dict) -> None:
    """Point `f` at its memory-mapped tensors, and every tensor of `owner`'s projections that is a view of one
    of f's in-RAM tensors at the same view of the mapped one (in `sources` too, under its name there)."""
    held = dict(_held(f))
    by_storage = {t.untyped_storage().data_ptr(): (t, mapped[n]) for n, t in held.items()}
    for child_name, child in owner.named_children():
        for leaf, t in [*child.named_buffers(recurse=False), *child.named_parameters(recurse=False)]:
            hit = by_storage.get(t.untyped_storage().data_ptr())
            if hit is None:
                continue
            base, target = hit
            view = target.as_strided(
                t.shape, t.stride(), target.storage_offset() + t.storage_offset() - base.storage_offset()
            )
            _assign(child, {leaf: view})
            key = _join(_join(rel, child_name), leaf)
            if key in sources:
                sources[key] = view
    if f.packed is not None:
        _assign(f.packed, mapped)
    else:
        f.weight, f.bias = mapped["weight"], mapped.get("bias")
