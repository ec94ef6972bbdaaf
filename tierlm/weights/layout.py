"""How fp32 weights are laid out for CPU matrix-vector products.

On the CPU, `F.linear` over an fp32 weight stored [out, in] reads a wide weight (out > in) at about half
the memory bandwidth it reaches when the same weight is stored transposed (a contiguous [in, out] seen
through `.T`): on this project's machine the fused gate/up weights of the default model go from ~12 to
~22 GB/s and the LM head from 12 to 24 GB/s, and fp32 decode from ~19 to ~23 tok/s. Narrow weights
(out <= in) and bf16 gain nothing, so they keep the checkpoint's layout.

The layout changes the order of the sums, so every placement of a model uses the same one: resident and
cpu-tier weights are transposed in RAM, disk-tier ones are read from an offload folder that stores them
transposed, and projections are not fused (in any tier).
"""

from __future__ import annotations

import torch
from torch import nn

from tierlm.weights.files import file_mappings, madvise_dontneed, page_span


def transposes_wide_weights(dtype: torch.dtype, device: torch.device, quantize: str | None) -> bool:
    return dtype == torch.float32 and device.type == "cpu" and quantize is None


def wide_weight_names(decoder: nn.Module, tied: list[tuple[str, str]]) -> set[str]:
    """Parameter names stored transposed: weights of linears with out_features > in_features, and the
    leader of a tied pair whose follower is one (a tied embedding shares the LM head's storage)."""
    wide = {
        f"{name}.weight"
        for name, module in decoder.named_modules()
        if isinstance(module, nn.Linear) and module.out_features > module.in_features
    }
    return wide | {leader for leader, follower in tied if follower in wide}


def transpose_resident(decoder: nn.Module, names: set[str]) -> None:
    """Store the named materialized weights transposed (same shape and values, seen through `.T`); weights
    still on the meta device (disk tier) are left to the offload folder."""
    params = dict(decoder.named_parameters(remove_duplicate=False))
    done: dict[int, nn.Parameter] = {}
    file_ranges = file_mappings()
    for name in sorted(names):
        old = params[name]
        if old.is_meta:
            continue
        new = done.get(id(old))
        if new is None:
            new = done[id(old)] = nn.Parameter(old.detach().T.contiguous().T, requires_grad=False)
            _drop_file_pages(old, file_ranges)
        owner, _, leaf = name.rpartition(".")
        setattr(decoder.get_submodule(owner), leaf, new)


def _drop_file_pages(t: torch.Tensor, file_ranges) -> None:
    """Unmap the pages of a tensor memory-mapped from its checkpoint once its transposed copy exists, so a
    load holds one copy in RAM, not two. Only file-backed pages: dropping them loses nothing (they re-read
    from the file if touched again), which is not true of anonymous memory."""
    addr, length = page_span(t)
    if any(start <= addr and addr + length <= end for start, end, _, _ in file_ranges):
        madvise_dontneed(addr, length)
