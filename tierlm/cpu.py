"""What this CPU can do, asked once, in one place: the instruction set torch dispatches to, native bf16.

Everything that depends on the CPU (how bf16 prefill runs, the benchmarks' headers, `tierlm plan`,
`generate --explain`, the server's /stats) reads `detect()`; tests replace it to simulate another CPU.
torch is asked wherever it knows (x86 features); only the CPU's name and Arm's BF16 flag come from
/proc/cpuinfo, and a machine without that file degrades to "no native bf16".
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU as tierlm sees it: its name, torch's dispatch level and whether bf16 math is native."""

    name: str
    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", "SVE256", ...
    native_bf16: bool  # AVX-512 BF16 or AMX on x86, BF16 on Arm
    amx: bool = False
    vnni: bool = False

    @property
    def widens_bf16_prefill(self) -> bool:
        """Whether bf16 prefill products run in fp32 here (no fast bf16 matrix-matrix kernel without
        native bf16; decode stays bf16, which is memory-bound and fast everywhere)."""
        return not self.native_bf16

    @property
    def eager_mv(self) -> bool:
        """Whether an eager one-row bf16 product (batch-1 decode) runs as torch.mv rather than F.linear:
        faster with AMX (a Xeon: 1.5-2x) and without native bf16 (a Zen 3: 1.03-1.14x); slower with AVX-512
        BF16 and no AMX (a Zen 4: 0.57-0.85x, the same products; layers._vector_product)."""
        return self.amx or not self.native_bf16

    @property
    def compiled_layer_mv(self) -> bool:
        """Whether a layer-scope compiled body writes one-row bf16 products as torch.mv, which inductor turns
        into reductions fused with their neighbours (with `steps.LAYER_REALIZE_OPCOUNT`, so the normalized
        input each reduction reads is computed once, not once per output row): on a Zen 4 (AVX-512 BF16, no
        AMX) a bf16 layer-scope decode of the default model 24 -> 46-48 tok/s (before the realize threshold,
        which was measured on the Xeon only); on an AMX Xeon 32.6 -> 36.3 tok/s, 39.1 with the threshold (aten's
        one-row bf16 product reads ~10 GB/s inside a layer there, the fused reductions ~15). On AVX2 (no native
        bf16) faster too (docs/decisions.md, "AVX2 and the fused layer reductions"). Other CPUs
        without native bf16 (AVX512 without BF16, Arm) are not measured, so not chosen."""
        return self.capability == "AVX2" or (self.native_bf16 and self.capability == "AVX512")

    @property
    def compiled_wide_attention(self) -> bool:
        """Whether compiled bf16 steps whose matmuls stay aten's (a layer-scope body; mode "default") attend
        in fp32, as eager decode does: faster on every x86 CPU measured. Without native bf16
        (`widens_bf16_prefill`: 31.1 against 26.8 tok/s on a Zen 3); with AMX, where aten's bf16 batched
        products of a decode step's attention cost 45-54 us each inside the layer body against 17-19 in fp32
        (an AMX Xeon, the default model: int4 layer-scope decode 68.5 -> 84.4 tok/s, bf16 31.1 -> 32.6,
        separate runs in one hour); with AVX-512 BF16 and no AMX (a Zen 4: int4 layer-scope decode 97.7 ->
        112.3 tok/s, bf16 49.3 -> 50.1, interleaved in one process, 5 runs). On Arm with native bf16 not
        measured, so not chosen."""
        return not self.native_bf16 or self.capability == "AVX512"

    @property
    def keeps_q4_packed(self) -> bool:
        """Whether a GGUF's 4-bit projections (Q4_0, Q4_1, Q4_K) stay packed by default (int4, the file's own
        codes in its 32-wide blocks or sub-blocks; the LM head int8) rather than widen to bf16. Measured on the default model, eager, batch 1: on a Zen 3
        (AVX2) 1.06x bf16's decode and 1.46x its prefill; on a Xeon with AMX (AVX512) 1.9x the decode and
        0.78x the prefill; perplexity +0.4% over fp32 (bf16: +0.2%). Elsewhere (Arm, no AVX2) not measured,
        so not chosen."""
        return self.capability in ("AVX2", "AVX512")

    @property
    def keeps_quantized_as_int8(self) -> bool:
        """Whether a GGUF's other quantized projections (K-quants, Q5_0, Q8_0 ...) load as int8 per row by
        default rather than widen to bf16: where tierlm's int8 kernel runs them. Measured on Gemma 3 270M
        Q4_K_M, eager: on a Zen 3 (AVX2) 1.45x bf16's decode and 1.7x its prefill at batch 1, 2.9x its decode
        at batch 8; perplexity +0.35% over fp32 (bf16 -0.34%, llama.cpp on the file +1.05%). aten's int8
        product is slower than bf16 at batch 8 on both kinds measured (AVX2; an AVX-512 Xeon), which is why
        it takes tierlm's kernel (docs/decisions.md, "int8 for a GGUF's other quantized projections")."""
        return self.int_kernels

    @property
    def int_kernels(self) -> bool:
        """Whether quantized products run on tierlm's kernels (tierlm.kernels) rather than aten's: on AVX2
        and AVX512 CPUs (int4 where tierlm's kernel reads torch's packing, and int8), unless
        TIERLM_CPU_KERNELS=aten. Elsewhere (Arm) aten's."""
        return (
            self.capability in ("AVX2", "AVX512")
            and os.environ.get("TIERLM_CPU_KERNELS", "").lower() != "aten"
        )

    @property
    def vector_kernel(self) -> bool:
        """Whether eager one-row bf16 products (batch-1 decode) run on tierlm's one-row bf16 kernel
        (`kernels.bf16_vector_product`, where it is built) rather than F.linear or torch.mv: with native bf16
        at AVX512 and no AMX, and at AVX2. Measured on a Zen 4, 2 threads: the default model's bf16 eager
        decode 40.6 -> 67.4 tok/s, the same 128 greedy tokens (1.4-1.7x F.linear's read of weights from
        memory). On a Zen 3 (AVX2) faster too
        (docs/decisions.md, "AVX2 and the one-row bf16 kernel"). With AMX (where torch.mv is 1.5-2x F.linear) and at
        AVX512 without native bf16 not measured, so not chosen."""
        return self.int_kernels and (
            self.capability == "AVX2" or (self.capability == "AVX512" and self.native_bf16 and not self.amx)
        )

    def kernels(self) -> str:
        """What this CPU selects, in words."""
        packed = (
            "; GGUF Q4_0/Q4_1/Q4_K projections stay packed (int4, the file's codes; LM head int8)"
            if self.keeps_q4_packed
            else ""
        )
        if self.keeps_quantized_as_int8:
            packed += "; other quantized GGUF projections int8"
        if self.int_kernels and self.capability == "AVX2":
            packed += "; int4/int8 products by tierlm's AVX2 kernels (int16 activations)"
        elif self.int_kernels:
            packed += "; int4/int8 products by tierlm's AVX-512 kernels (int16 activations)"
        if self.vector_kernel:
            isa = "AVX2" if self.capability == "AVX2" else "AVX-512 BF16"
            one_row = f"eager one-row ones by tierlm's {isa} kernel"
        else:
            one_row = "one-row ones by torch.mv" if self.eager_mv else "one-row ones by F.linear"
        if self.compiled_layer_mv:
            one_row += ", by inductor's reductions in layer-scope steps"
        if self.int_kernels:
            attention = "decode attention by tierlm's kernel (fp32)"
        elif self.compiled_wide_attention:
            attention = "its attention in fp32"
        else:
            attention = "its eager attention in fp32"
        if self.widens_bf16_prefill:
            return (
                f"GGUF default dtype bfloat16; bf16 decode products in bf16 ({one_row}), "
                f"{attention}; prefill in fp32 (bf16 weights widened per product){packed}"
            )
        return (
            f"GGUF default dtype bfloat16; bf16 decode products in bf16 ({one_row}), {attention}; "
            f"prefill in bf16{packed}"
        )

    def describe(self) -> str:
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        extras = "".join(f", {f}" for f, on in (("AMX", self.amx), ("VNNI", self.vnni)) if on)
        return f"{self.name} ({self.capability}, {bf16}{extras}): {self.kernels()}"

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "capability": self.capability,
            "native_bf16": self.native_bf16,
            "amx": self.amx,
            "vnni": self.vnni,
            "kernels": self.kernels(),
        }


@functools.cache
def detect() -> CpuFeatures:
    """This machine's CPU (computed once per process)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        # AVX-512 BF16, AMX and VNNI count only where torch dispatches at AVX512: below it (an AVX2-only CPU, or
        # ATEN_CPU_CAPABILITY=avx2 on any other) torch's kernels do not use them, so neither does tierlm
        extras = capability == "AVX512"
        amx = extras and torch.cpu._is_amx_tile_supported()
        native = extras and (torch.cpu._is_avx512_bf16_supported() or amx)
        vnni = extras and torch.cpu._is_vnni_supported()
    else:  # torch does not say for Arm: its BF16 extension is the "bf16" feature in /proc/cpuinfo
        native, amx, vnni = "bf16" in _cpuinfo_field("Features").split(), False, False
    name = _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"
    return CpuFeatures(name, capability, bool(native), bool(amx), bool(vnni))


def _cpuinfo_field(field: str) -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == field:
            return value.strip()
    return ""
