"""tierlm's own CPU kernels: int4 and int8 weight-only products, a decode step's attention (alone, or with
its rotary and static-cache write: decode_rope_attention), its RMSNorm, the copy of an eager continuous
step's scratch column to each row's slot (copy_column), and a one-row bf16 product (`bf16_vector_product`:
AVX-512 BF16's dot products where the CPU has them, else AVX2's), for x86 CPUs (`avx2_quant.cpp`).

torch's `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` have no fast path without AVX-512, and
inductor has no AVX2 int4 template, so on an AVX2 CPU decode spends most of its time widening weights to
float. These kernels quantize the activations to int16 in blocks of 32 and multiply with 16-bit integer dot
products (llama.cpp quantizes them to int8 on the same CPUs, which cost +0.6% perplexity on the default
model here; int16 keeps aten's); they read the weights in torch's own packed layouts, so a
model quantized for aten's kernels runs on them unchanged. They are used where
`cpu.detect().int_kernels` says so (AVX2 and AVX512 CPUs, unless `TIERLM_CPU_KERNELS=aten`), for decode
and prefill alike (measured against aten's, 2 threads, on a Zen 3: 1.5-2.4x faster at 1 row; at 743 rows
1.3x faster for 3072 x 576, 0.85x for 576 x 1536). On an AVX512 CPU the file is built with AVX-512 flags,
which gives the int8 product a 512-bit loop (on an AMX Xeon, Gemma 3's five product shapes, 2 threads: at 1
row 1.4-2.4x aten's int8 and 2.5-3.8x torch.mv in bf16; at 8 rows 0.85-2.3x aten's, 0.8-1.8x bf16's, the
LM head the 2.3x / 1.4x); its int4 product reads torch's own int4 packing,
in blocks of 32 rows on AVX2 and, in the AVX-512 build, of 64 rows on AVX512 (`int4_block`).

The C++ is compiled once per machine with torch's extension builder (the C++ compiler inductor already
needs, and ninja, a dependency) into `<cache>/kernels/<digest>` ($TIERLM_KERNELS_DIR instead of
`<cache>/kernels` if set), ~20 s; a machine where that fails keeps aten's kernels and says why once.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import warnings
from pathlib import Path

from tierlm import cpu
from tierlm.config import cache_root

SOURCE = Path(__file__).with_name("avx2_quant.cpp")
LIBRARY = "tierlm_avx2"


def wanted() -> bool:
    """Whether this process should run tierlm's kernels (`cpu.CpuFeatures.int_kernels`)."""
    return cpu.detect().int_kernels


def _folder(flags: list[str]) -> Path:
    """Where this source, torch version and flags are built: <cache>/kernels/<digest>, or under
    $TIERLM_KERNELS_DIR."""
    import torch

    digest = hashlib.sha256(
        SOURCE.read_bytes() + torch.__version__.encode() + " ".join(flags).encode()
    ).hexdigest()[:16]
    return Path(os.environ.get("TIERLM_KERNELS_DIR") or cache_root() / "kernels") / digest


def _flags() -> list[str]:
    import torch

    flags = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # torch's AVX512: F, BW, DQ and VL
        flags[4:4] = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]  # the int8 AVX-512 loop
        # the one-row bf16 product (bf16_mv), where the compiler knows the flag: a compiler that does not
        # (GCC < 10) would fail the whole build, and every kernel with it
        if torch.cpu._is_avx512_bf16_supported() and _compiler_takes("-mavx512bf16"):
            flags.insert(8, "-mavx512bf16")
        # the int4 products' int16 dot products as one instruction (vpdpwssd), where the CPU has AVX-512 VNNI
        if torch.cpu._is_vnni_supported() and _compiler_takes("-mavx512vnni"):
            flags.insert(8, "-mavx512vnni")
    return flags


@functools.cache
def _compiler_takes(flag: str) -> bool:
    """Whether the C++ compiler torch's extension builder runs ($CXX, else c++) accepts `flag`."""
    import subprocess

    command = [os.environ.get("CXX", "c++"), flag, "-x", "c++", "-E", "-", "-o", os.devnull]
    try:
        return subprocess.run(command, input=b"", capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def _build():
    """Load the built library, building it first if this machine has none. A build runs in a folder of this
    process's own and moves the library into place in one rename, so concurrent or killed builds never
    leave a half-written library or a lock that later processes would wait on."""
    import torch

    flags = _flags()
    folder = _folder(flags)
    library = folder / f"{LIBRARY}.so"
    if not _intact(library):  # never built, or cut short on disk (loading that one dies of SIGBUS)
        from torch.utils.cpp_extension import load

        try:  # the ninja of the `ninja` package (a dependency), where the system has none on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        print("tierlm: building the int4/int8 CPU kernels (once per machine, ~20 s)", file=sys.stderr)
        folder.mkdir(parents=True, exist_ok=True)
        _remove_dead_builds(folder.parent)
        build = folder.parent / f"{folder.name}.build-{os.getpid()}"
        shutil.rmtree(build, ignore_errors=True)
        build.mkdir()
        try:
            load(
                LIBRARY,
                sources=[str(SOURCE)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                is_python_module=False,  # loads it into this process
                verbose=False,
            )
            built = build / f"{LIBRARY}.so"
            # the digest first: a crash between the two writes leaves a mismatch, which rebuilds
            _digest_file(library).write_text(_sha256(built))
            os.replace(built, library)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    else:
        torch.ops.load_library(str(library))
    ops = getattr(torch.ops, LIBRARY)

    @torch.library.register_fake(f"{LIBRARY}::int4_mm")
    def _(x, packed, group_size, scales_and_zeros, block=32):
        return x.new_empty(x.shape[0], scales_and_zeros.shape[1])

    @torch.library.register_fake(f"{LIBRARY}::int8_mm")
    def _(x, weight, scales):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake(f"{LIBRARY}::decode_attention")
    def _(q, keys, values, mask, scale):
        return q.new_empty(q.shape)

    if hasattr(ops, "bf16_mv"):

        @torch.library.register_fake(f"{LIBRARY}::bf16_mv")
        def _(x, weight, bias):
            return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake(f"{LIBRARY}::rms_norm")
    def _(x, weight, eps, gemma):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{LIBRARY}::decode_rope_attention")
    def _(q, k, v, cos, sin, keys, values, slots, mask, scale):
        return q.new_empty(q.shape)

    return ops


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest_file(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _intact(library: Path) -> bool:
    """The library is there and has the bytes its build wrote (its digest, written beside it)."""
    try:
        return _digest_file(library).read_text().strip() == _sha256(library)
    except OSError:
        return False


def _remove_dead_builds(root: Path) -> None:
    """Build folders (<digest>.build-<pid>) of processes that are gone."""
    for path in root.glob("*.build-*"):
        pid = path.name.rpartition("-")[2]
        if not (pid.isascii() and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive, another user's
            pass


def selected():
    """torch.ops.tierlm_avx2 (int8_mm; int4_mm where `int4_block` finds a layout) when this process uses them, else
    None."""
    return loaded() if wanted() else None


@functools.cache
def loaded():
    """torch.ops.tierlm_avx2 built and loaded (on any x86 CPU with AVX2 and FMA), or None, with one warning
    saying why, where it cannot be built."""
    try:
        return _build()
    except Exception as e:  # no compiler, no ninja, a failed build: aten's kernels still work
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        warnings.warn(f"tierlm: CPU kernels unavailable ({reason}); using aten's", stacklevel=2)
        return None


def bf16_vector_product():
    """torch.ops.tierlm_avx2.bf16_mv, tierlm's one-row bf16 product, where this process uses tierlm's kernels
    (built with AVX-512 BF16's dot products where torch runs at AVX512 with native bf16, else with AVX2's
    widening and FMA), else None."""
    ops = selected()
    return None if ops is None else getattr(ops, "bf16_mv", None)


@functools.cache
def int4_block() -> int | None:
    """The rows in a block of torch's CPU int4 packing here, where the int4 kernel reads it: 32 (torch's
    AVX2 packing, row 16 + j in a byte's high nibble) or 64 (its AVX-512 packing, row 32 + j; read by the
    kernel's AVX-512 build); else None. Random codes, so that every row and column differs, through torch's
    product and the kernel's."""
    import torch

    ops = loaded()
    if ops is None:
        return None
    n, k = 128, 64
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    except RuntimeError:
        return None
    if packed.numel() * 2 != n * k:
        return None
    sz = torch.stack([torch.ones(k // 32, n), torch.zeros(k // 32, n)], dim=-1)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(1))
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    for block in (32, 64):
        try:
            got = ops.int4_mm(x, packed, 32, sz, block)
        except RuntimeError:  # 64 in a build without AVX-512
            continue
        # a misread row or nibble is off by whole codes times |x|; the kernel's int16 activations by ~1e-4
        if torch.allclose(got, want, rtol=1e-3, atol=1e-2):
            return block
    return None
