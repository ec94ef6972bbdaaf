"""tierlm's own CPU kernels: int4 and int8 weight-only products for AVX2 CPUs (`avx2_quant.cpp`).

torch's `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` have no fast path without AVX-512, and
inductor has no AVX2 int4 template, so on an AVX2 CPU decode spends most of its time widening weights to
float. These kernels quantize the activations to int8 in blocks of 32 and multiply with 8-bit integer dot
products, as llama.cpp does on the same CPUs; they read the weights in torch's own packed layouts, so a
model quantized for aten's kernels runs on them unchanged. They are used where
`cpu.detect().avx2_int_kernels` says so (AVX2 CPUs, the ones they are measured on, unless
`TIERLM_CPU_KERNELS=aten`), for decode and prefill alike (faster than aten's at every row count measured,
1 to 743 rows).

The C++ is compiled once per machine with torch's extension builder (the compiler inductor already needs)
into `<cache>/kernels/<digest>` ($TIERLM_KERNELS_DIR instead of `<cache>/kernels` if set), ~20 s; a machine where
that fails keeps aten's kernels and says why once.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path

from tierlm import cpu
from tierlm.config import cache_root

SOURCE = Path(__file__).with_name("avx2_quant.cpp")
LIBRARY = "tierlm_avx2"


def wanted() -> bool:
    """Whether this process should run tierlm's AVX2 kernels (`cpu.CpuFeatures.avx2_int_kernels`)."""
    return cpu.detect().avx2_int_kernels


@functools.cache
def _build():
    import torch
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
    digest = hashlib.sha256(
        SOURCE.read_bytes() + torch.__version__.encode() + " ".join(flags).encode()
    ).hexdigest()[:16]
    folder = Path(os.environ.get("TIERLM_KERNELS_DIR") or cache_root() / "kernels") / digest
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / f"{LIBRARY}.so").exists():
        print("tierlm: building the AVX2 int4/int8 kernels (once per machine, ~20 s)", file=sys.stderr)
    load(
        LIBRARY,
        sources=[str(SOURCE)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )
    ops = getattr(torch.ops, LIBRARY)

    @torch.library.register_fake(f"{LIBRARY}::int4_mm")
    def _(x, packed, group_size, scales_and_zeros):
        return x.new_empty(x.shape[0], scales_and_zeros.shape[1])

    @torch.library.register_fake(f"{LIBRARY}::int8_mm")
    def _(x, weight, scales):
        return x.new_empty(x.shape[0], weight.shape[0])

    return ops


def avx2():
    """torch.ops.tierlm_avx2 (int4_mm, int8_mm) when this process uses them, else None."""
    return loaded() if wanted() else None


@functools.cache
def loaded():
    """torch.ops.tierlm_avx2 built and loaded (on any x86 CPU with AVX2 and FMA), or None, with one warning
    saying why, where it cannot be built or torch packs int4 in another layout."""
    try:
        ops = _build()
    except Exception as e:  # no compiler, no ninja, a failed build: aten's kernels still work
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        warnings.warn(f"tierlm: AVX2 kernels unavailable ({reason}); using aten's", stacklevel=2)
        return None
    if not _reads_int4_layout(ops):
        warnings.warn(
            "tierlm: torch packs int4 in a layout the AVX2 kernels do not read; using aten's", stacklevel=2
        )
        return None
    return ops


def _reads_int4_layout(ops) -> bool:
    """Whether torch packs int4 in the layout the kernel reads (blocks of 32 rows, row 16 + j in the high
    nibble): a probe of distinct codes through both kernels."""
    import torch

    n, k = 64, 64
    codes = (torch.arange(n * k, dtype=torch.int32) * 7 % 16).reshape(n, k)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    except RuntimeError:
        return False
    if packed.numel() * 2 != n * k:
        return False
    sz = torch.stack([torch.ones(k // 32, n), torch.zeros(k // 32, n)], dim=-1)
    x = torch.eye(k)[:8] * 127  # rows of the identity: the kernel's quantization of them is exact
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    return torch.equal(ops.int4_mm(x, packed, 32, sz), want)
