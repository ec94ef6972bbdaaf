"""Weight-only int8 (per output channel) and int4 (group-wise) quantization of the decoder's linears.

Quantized modules replace `nn.Linear` at the same Hugging Face names, so device maps still address them.
Int4 codes q in 0..15 dequantize as w = (q - 8) * scale + zero (the tinygemm convention of the aten
int4 kernels, checked against a plain-torch reference in tests/test_quant.py).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tierlm import cpu, kernels
from tierlm.errors import OptionError

MODES = ("int8", "int4")
# Rows (tokens x sequences) from which an eager int4 or int8 product of bf16 activations on a CPU with AMX
# widens the weight to bf16 and multiplies on AMX tiles instead: measured on an AMX Xeon, 2 threads, a
# [1536, 576] weight at group 32: the int4 kernel 1.24 ms at 128 rows and 3.17 ms at 328, dequantize + bf16
# product 1.18 and 1.26 ms; Gemma 3's [1536, 640] int8 at 128 rows: tierlm's kernel 1.66 ms, widen + bf16
# product 0.47-0.60 ms (at 38 rows 0.49 against 0.66 ms).
DEQUANTIZE_ROWS = 128
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the aten int4 kernels accept
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def quantizes(module_name: str) -> bool:
    """Whether quantization replaces the linear of this name: attention/MLP projections and the LM head."""
    return module_name == "lm_head" or module_name.endswith(PROJECTIONS)


def mode_of(module_name: str, mode: str) -> str:
    """The quantization a module gets under `mode`: int4 keeps the LM head at int8.

    The head's error reaches every logit directly: on the default model an int4 head costs +6.2% of
    perplexity, an int8 head +0.4% (its GGUF source is Q8_0; llama.cpp keeps the output tensor at 6-8 bits
    in its 4-bit mixes for the same reason)."""
    return "int8" if mode == "int4" and module_name == "lm_head" else mode


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise OptionError(f"quantize must be one of {', '.join(MODES)}, got {mode!r}")


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KERNEL_X_DTYPES = (torch.bfloat16, torch.float32)  # what tierlm's own kernels take (tierlm.kernels)
_CUDA_INNER_K_TILES = 8  # tinygemm on CUDA: K must be a multiple of 16 * inner_k_tiles
aten = torch.ops.aten


QUANTIZE_ROWS = 4096  # rows quantized at a time: fp32 temporaries stay ~10 MB, not 4x the weight (a
# 262k-row tied LM head would otherwise peak at ~2.7 GB of them)


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (codes int8 [N, K], scales [N] in `dtype`), w ~ codes * scales[:, None]."""
    weight = weight.detach()
    codes = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=dtype, device=weight.device)
    for start in range(0, weight.shape[0], QUANTIZE_ROWS):
        rows = slice(start, start + QUANTIZE_ROWS)
        w = weight[rows].to(torch.float32, copy=True)  # written in place below
        lo, hi = torch.aminmax(w, dim=1)
        s = (torch.maximum(hi, -lo) / 127).clamp(min=torch.finfo(dtype).tiny).to(dtype)
        # Round against the stored (rounded) scales so dequantization is exactly codes * scales; in place on
        # the fp32 rows (1.7-2x the speed of new temporaries at each op)
        codes[rows] = w.div_(s.float()[:, None]).round_().clamp_(-128, 127)
        scales[rows] = s
    return codes, scales


def quantize_int4(
    weight: torch.Tensor, group_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise uint4: (codes int32 [N, K] in 0..15, scales_and_zeros [K/g, N, 2] in `dtype`)."""
    n, k = weight.shape
    weight = weight.detach()
    codes = torch.empty((n, k), dtype=torch.int32, device=weight.device)
    scales_and_zeros = torch.empty((k // group_size, n, 2), dtype=dtype, device=weight.device)
    for start in range(0, n, QUANTIZE_ROWS):
        rows = slice(start, start + QUANTIZE_ROWS)
        w = weight[rows].float().reshape(-1, k // group_size, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((hi - lo) / 15).clamp(min=torch.finfo(dtype).tiny).to(dtype)
        zeros = (lo + 8 * scales.float()).to(dtype)  # the value of code 8, the middle of the range
        q = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None]) + 8
        codes[rows] = q.clamp(0, 15).to(torch.int32).reshape(-1, k)
        scales_and_zeros[:, rows] = torch.stack([scales, zeros], dim=-1).transpose(0, 1)
    return codes, scales_and_zeros


def dequantize_int4(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weight [N, K] that int4 codes and scales_and_zeros stand for: (q - 8) * scale + zero."""
    n, k = codes.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, K/g, 2]
    q = codes.float().reshape(n, k // group_size, group_size) - 8
    return (q * sz[..., :1] + sz[..., 1:]).reshape(n, k)


def check_int4_shape(out_features: int, in_features: int, group_size: int, device: torch.device) -> None:
    """Raise ValueError if the int4 kernel cannot take a [out_features, in_features] weight."""
    if group_size not in INT4_GROUP_SIZES:
        raise OptionError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    k_multiple = group_size if device.type == "cpu" else max(group_size, 16 * _CUDA_INNER_K_TILES)
    n_multiple = 16 if device.type == "cpu" else 8
    if in_features % k_multiple or out_features % n_multiple:
        raise OptionError(
            f"int4 cannot quantize a linear of shape [out={out_features}, in={in_features}] on "
            f"{device.type}: in_features must be a multiple of {k_multiple} (group size {group_size}) "
            f"and out_features a multiple of {n_multiple}"
        )


class Int8Linear(nn.Module):
    """y = x @ (weight_int8 * scales[:, None]).T + bias, through aten._weight_int8pack_mm on CPU (tierlm's
    kernel on AVX2 and AVX512 CPUs, see tierlm.kernels; many bf16 rows on AMX: the widened weight)."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # tierlm's kernel (kernels.py) where this CPU wants it and the shape suits it
        self.kernel = (
            self.in_features % 32 == 0
            and self.out_features % 4 == 0
            and weight_int8.device.type in ("cpu", "meta")  # meta: a shell the streamed weights fill
            and scales.dtype in KERNEL_X_DTYPES
            and _kernels()
        )
        # many bf16 rows (prefill) on AMX: the codes widened to bf16 (exactly) on AMX tiles, then the scales
        self.widens = weight_int8.device.type in ("cpu", "meta") and cpu.detect().amx

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
        codes, scales = quantize_int8(linear.weight, dtype)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype).clone()
        return cls(codes, scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if (
            self.widens
            and not torch.compiler.is_compiling()  # before the row count: no guard on it in a graph
            and x.dtype == torch.bfloat16
            and x2d.shape[0] >= DEQUANTIZE_ROWS
            and x.device.type == "cpu"
        ):
            y = F.linear(x2d, self.weight_int8.to(x.dtype)) * self.scales.to(x.dtype)
        elif self.kernel and x.device.type == "cpu" and x.dtype in KERNEL_X_DTYPES:
            y = torch.ops.tierlm_avx2.int8_mm(x2d.contiguous(), self.weight_int8, self.scales)
        elif x.device.type == "cpu" and x.dtype == self.scales.dtype and x.dtype in KERNEL_DTYPES:
            y = aten._weight_int8pack_mm(x2d.contiguous(), self.weight_int8, self.scales)
        else:
            # Other dtypes, and CUDA (whose aten kernel is a naive fp32 loop): the scales factor out of
            # the matmul, so this is exact; under torch.compile the int8 -> float cast fuses.
            y = F.linear(x2d, self.weight_int8.to(x.dtype)) * self.scales.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def product(self, rows: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`forward` for a contiguous CPU input [rows, in_features] of `dtype`, eagerly, as one plain function
        with this module's choices made for that shape (an eager decode step's layer program:
        tierlm.models.programs); None where forward runs a path that has no such function."""
        w, scales = self.weight_int8, self.scales
        if w.device.type != "cpu" or (self.widens and dtype == torch.bfloat16 and rows >= DEQUANTIZE_ROWS):
            return None
        if self.kernel and dtype in KERNEL_X_DTYPES:
            op = torch.ops.tierlm_avx2.int8_mm
        elif dtype == scales.dtype and dtype in KERNEL_DTYPES:
            op = aten._weight_int8pack_mm
        else:
            return None
        return _plus_bias(lambda x: op(x, w, scales), self.bias, dtype)

    def kernel_operands(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """(weight, scales, 0, bias in `dtype` or None) where `product` is tierlm's int8 kernel, for a layer step
        that calls the kernels from C++ (kernels' layer_step: group 0 means int8); else None."""
        if self.product(rows, dtype) is None or not self.kernel or dtype not in KERNEL_X_DTYPES:
            return None
        return self.weight_int8, self.scales, 0, None if self.bias is None else self.bias.to(dtype)

    @classmethod
    def fuse(cls, parts) -> Int8Linear | None:
        """One Int8Linear for several of the same input (q/k/v, gate/up): codes and scales concatenated by
        rows, each part left with views of its rows. Per-row scales make every output the same as its part's
        (the kernel reduces each row alone: tests/test_quant.py checks they are equal)."""
        if len({(p.in_features, p.scales.dtype, p.bias is None) for p in parts}) != 1:
            return None
        fused = cls(
            torch.cat([p.weight_int8 for p in parts]),
            torch.cat([p.scales for p in parts]),
            None if parts[0].bias is None else torch.cat([p.bias for p in parts]),
        )
        row = 0
        for p in parts:
            rows = slice(row, row + p.out_features)
            p.weight_int8, p.scales = fused.weight_int8[rows], fused.scales[rows]
            if p.bias is not None:
                p.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
            row += p.out_features
        return fused

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] the kernel multiplies by."""
        return self.weight_int8.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class Int4Linear(nn.Module):
    """y = x @ W.T + bias with W group-wise uint4, through aten._weight_int4pack_mm(_for_cpu), or tierlm's
    kernel where it reads torch's packing (AVX2 and AVX512 CPUs; see tierlm.kernels). Measured on a Zen 5
    (AVX-512 VNNI), 2 threads, bf16, the default model's four product shapes: tierlm's kernel runs 1.5-2.1x
    aten's speed at 1 row, 1.1-1.7x from 4 to 128 rows (tiles of 3 activation rows, each row's sums in the
    one-row order, so a row's result does not depend on its batch); simulated AVX2 there (tiles of 2),
    2.4-3.8x at 1 row, 1.2-1.4x at 8 to 128. Not measured since on an AMX Xeon, where products of
    DEQUANTIZE_ROWS rows or more multiply a dequantized bf16 weight (that bound was set against aten's
    int4, which ran every product of more than 2 rows there before)."""

    def __init__(
        self,
        weight_int4: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        in_features: int,
        out_features: int,
        group_size: int,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("weight_int4", weight_int4)  # kernel-specific packed layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K/g, N, 2]: scale, zero
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # Many rows (prefill) on AMX: dequantize to bf16 and multiply there (DEQUANTIZE_ROWS); the CPU layout
        # is known in whole 64-row blocks
        self.dequantizes = (
            weight_int4.device.type == "cpu"
            and scales_and_zeros.dtype == torch.bfloat16
            and out_features % 64 == 0
            and cpu.detect().amx
            and unpacks_cpu_int4()
        )
        # tierlm's kernel (kernels.py) where this CPU wants it, it reads torch's packing here and the shape
        # suits it
        self.block = kernels.int4_block() if _kernels() else None  # rows per block of torch's packing
        self.kernel = (
            self.block is not None
            and in_features % 32 == 0
            and group_size % 32 == 0
            and out_features % self.block == 0
            and scales_and_zeros.dtype in KERNEL_X_DTYPES
            and weight_int4.device.type in ("cpu", "meta")
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 64, dtype: torch.dtype = torch.bfloat16):
        """Quantize `linear`; ValueError if its shape does not suit the int4 kernel."""
        n, k = linear.weight.shape
        device = linear.weight.device
        check_int4_shape(n, k, group_size, device)
        if device.type == "cuda" and dtype != torch.bfloat16:
            raise OptionError(f"int4 on cuda needs bfloat16 activations, got {dtype}")
        codes, scales_and_zeros = quantize_int4(linear.weight, group_size, dtype)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype).clone()
        return cls(_pack_int4(codes), scales_and_zeros, k, n, group_size, bias)

    @classmethod
    def from_parts(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        dtype: torch.dtype = torch.bfloat16,
        bias: torch.Tensor | None = None,
        packed: bool = False,
    ) -> Int4Linear:
        """A CPU Int4Linear of codes given as they are (uint8 [N, K] in 0..15; packed: already in torch's CPU
        layout, uint8 [N, K/2]), with a scale and a zero ([N, K/g] each) per group: a GGUF's 4-bit blocks
        (tierlm.weights.gguf_blocks), never requantized. ValueError if the kernel cannot take the shape."""
        n, k = codes.shape[0], codes.shape[1] * (2 if packed else 1)
        group = k // scales.shape[1]
        check_int4_shape(n, k, group, torch.device("cpu"))
        packed = codes if packed else _pack_cpu_codes(codes)
        scales_and_zeros = (
            torch.stack([scales.to(dtype), zeros.to(dtype)], dim=-1).transpose(0, 1).contiguous()
        )
        bias = None if bias is None else bias.detach().to(dtype).clone()
        return cls(packed, scales_and_zeros, k, n, group, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.scales_and_zeros.dtype
        x2d = x.reshape(-1, self.in_features).to(dtype).contiguous()  # the kernel needs matching dtypes
        if self.dequantizes and not torch.compiler.is_compiling() and x2d.shape[0] >= DEQUANTIZE_ROWS:
            y = (x2d @ self.dequantized_t()).to(x.dtype)
        elif self.kernel and x2d.device.type == "cpu":
            y = torch.ops.tierlm_avx2.int4_mm(
                x2d, self.weight_int4, self.group_size, self.scales_and_zeros, self.block
            )
            y = y.to(x.dtype)  # x2d is in the scales' dtype
        else:
            y = _int4_mm(x2d, self.weight_int4, self.group_size, self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def product(self, rows: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`forward` for a contiguous CPU input [rows, in_features] of `dtype`, as Int8Linear.product does."""
        w, group, sz = self.weight_int4, self.group_size, self.scales_and_zeros
        if w.device.type != "cpu" or dtype != sz.dtype:
            return None
        if self.dequantizes and rows >= DEQUANTIZE_ROWS:
            return None
        if self.kernel:
            kernel, block = torch.ops.tierlm_avx2.int4_mm, self.block
            return _plus_bias(lambda x: kernel(x, w, group, sz, block), self.bias, dtype)
        op = aten._weight_int4pack_mm_for_cpu
        return _plus_bias(lambda x: op(x, w, group, sz), self.bias, dtype)

    def kernel_operands(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """(packed weight, scales and zeros, group size, bias in `dtype` or None) where `product` is tierlm's int4
        kernel, for a layer step that calls the kernels from C++ (kernels' layer_step); else None."""
        if self.product(rows, dtype) is None or not self.kernel:
            return None
        bias = None if self.bias is None else self.bias.to(dtype)
        return self.weight_int4, self.scales_and_zeros, self.group_size, bias

    @classmethod
    def fuse(cls, parts) -> Int4Linear | None:
        """One Int4Linear for several of the same input, or None. Only on the CPU, whose packed layout is
        row-major [N, K/2] (CUDA's tinygemm tiles rows and columns together), and only for parts of a
        multiple of 64 rows, so that a layout packed in blocks of rows would concatenate too. Each part keeps a
        view of its packed rows; the scales and zeros ([K/g, N, 2], whose row slices are not contiguous) are
        concatenated, and each part keeps its own (8/g of the packed bytes: 1/4 at group 32, in bf16)."""
        first = parts[0]
        same = {(p.in_features, p.group_size, p.scales_and_zeros.dtype, p.bias is None) for p in parts}
        if (
            len(same) != 1
            or first.weight_int4.device.type != "cpu"
            or any(p.out_features % 64 for p in parts)
        ):
            return None
        weight = torch.cat([p.weight_int4 for p in parts])
        scales_and_zeros = torch.cat([p.scales_and_zeros for p in parts], dim=1)
        bias = None if first.bias is None else torch.cat([p.bias for p in parts])
        out_features = sum(p.out_features for p in parts)
        fused = cls(weight, scales_and_zeros, first.in_features, out_features, first.group_size, bias)
        row = 0
        for p in parts:
            rows = slice(row, row + p.out_features)
            p.weight_int4 = fused.weight_int4[rows]
            if p.bias is not None:
                p.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
            row += p.out_features
        return fused

    def dequantized_t(self) -> torch.Tensor:
        """W.T [K, N] in the scales' dtype, unpacked from the CPU kernel's layout: in each block of 64 rows,
        byte (k, j) holds column k of row j in its low nibble and of row 32 + j in its high one (checked
        against `dequantize()` in tests/test_quant.py)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        codes = (
            _unpack_cpu_int4_t(self.weight_int4, n, k).reshape(k // g, g, n).to(self.scales_and_zeros.dtype)
        )
        scales, zeros = self.scales_and_zeros.unbind(-1)  # [K/g, N] each
        scales, zeros = scales.unsqueeze(1), zeros.unsqueeze(1)
        return torch.addcmul(zeros - 8 * scales, codes, scales).reshape(k, n)  # (q - 8) * scale + zero

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] the kernel multiplies by (read back through the kernel: the packed
        layout is kernel-private)."""
        sz = self.scales_and_zeros
        dtype = torch.float32 if sz.device.type == "cpu" else sz.dtype
        eye = torch.eye(self.in_features, dtype=dtype, device=sz.device)
        return _int4_mm(eye, self.weight_int4, self.group_size, sz.to(dtype)).float().T.contiguous()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
        )


def _plus_bias(product: Callable, bias: torch.Tensor | None, dtype: torch.dtype) -> Callable:
    """`product`, then + bias in `dtype` (as forward adds it), when there is a bias."""
    if bias is None:
        return product
    bias = bias.to(dtype)
    return lambda x: product(x) + bias


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    if codes.device.type == "cpu":
        return aten._convert_weight_to_int4pack_for_cpu(codes, 1)  # int32 [N, K] -> uint8 [N, K/2]
    if codes.device.type == "cuda":  # UNTESTED here (no GPU): uint8 [N, K/2], even column in the high nibble
        packed = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
        return aten._convert_weight_to_int4pack(packed, _CUDA_INNER_K_TILES)
    raise OptionError(f"int4 on {codes.device.type} is not supported by this torch build (cpu and cuda are)")


def _pack_cpu_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in torch's CPU int4 packing (uint8 [N, K/2]), by tensor ops where this torch's layout
    is known (`_cpu_pack_block`: ~3x faster than its int32 packing, which also needs an int32 copy), else
    QUANTIZE_ROWS rows at a time through aten (its blocks of rows concatenate)."""
    n, k = codes.shape
    block = _cpu_pack_block()
    if block is None or n % block:
        return torch.cat(
            [_pack_int4(codes[r : r + QUANTIZE_ROWS].to(torch.int32)) for r in range(0, n, QUANTIZE_ROWS)]
        )
    return _pack_blocks(codes, block)


def _pack_blocks(codes: torch.Tensor, block: int) -> torch.Tensor:
    """In each block of `block` rows, byte (k, j) = column k of row j (low nibble) and of row block/2 + j."""
    n, k = codes.shape
    halves = codes.view(n // block, 2, block // 2, k).transpose(2, 3)  # [blocks, 2, K, block/2]
    out = torch.empty((n // block, k, block // 2), dtype=torch.uint8)
    torch.bitwise_left_shift(halves[:, 1], 4, out=out)
    return out.bitwise_or_(halves[:, 0]).view(n, k // 2)


@functools.cache
def _cpu_pack_block() -> int | None:
    """The rows per block of this torch's CPU int4 packing (32 on AVX2, 64 on AVX-512), or None if it is
    neither layout `_pack_blocks` writes: a probe of random codes packed by aten, compared."""
    codes = torch.randint(0, 16, (128, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    try:
        packed = _pack_int4(codes.to(torch.int32))
    except RuntimeError:
        return None
    for block in (32, 64):
        if packed.shape == (128, 32) and torch.equal(_pack_blocks(codes, block), packed):
            return block
    return None


def _unpack_cpu_int4_t(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The codes [K, N] (uint8) of a CPU-packed int4 weight [N, K]: in each block of 64 rows, byte (k, j) holds
    column k of row j in its low nibble and of row 32 + j in its high one (torch's AVX-512 packing;
    `unpacks_cpu_int4` checks it on this process's torch)."""
    blocks = packed.view(n // 64, k, 32)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=2)  # [N/64, K, 2, 32]: rows j, then 32 + j
    return codes.permute(1, 0, 2, 3).reshape(k, n)


@functools.cache
def unpacks_cpu_int4() -> bool:
    """Whether `_unpack_cpu_int4_t` reads the layout this torch packs in (it depends on the kernel torch
    dispatches to): packs a probe of distinct codes once and unpacks it."""
    codes = (torch.arange(128 * 64, dtype=torch.int32) * 7 % 16).reshape(128, 64)
    try:
        return torch.equal(_unpack_cpu_int4_t(_pack_int4(codes), 128, 64).T.int(), codes)
    except RuntimeError:  # another layout, whose size does not even match
        return False


def _kernels() -> bool:
    """Whether quantized linears built now run tierlm's kernels (built on first use)."""
    return kernels.selected() is not None


def _int4_mm(x2d: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    if x2d.device.type == "cpu":
        return aten._weight_int4pack_mm_for_cpu(x2d, packed, group_size, sz)
    return aten._weight_int4pack_mm(x2d, packed, group_size, sz)  # cuda, UNTESTED here


def quantize_decoder(
    decoder: nn.Module,
    mode: str,
    group_size: int = 64,
    skip: tuple[str, ...] = (),
    int8: tuple[str, ...] = (),
    source=None,
) -> list[str]:
    """Replace every attention/MLP projection and lm_head with Int8Linear or Int4Linear, in place.

    Returns the names quantized. A tied embedding stays exact: lm_head quantizes its own copy. Int4
    layers whose shape the kernel cannot take stay in float (with one warning naming them). Modules under
    a `skip` prefix (offloaded units, quantized as they stream: placement/quantized.py) are left alone;
    modules named in `int8` are int8 whatever `mode` is. source: the checkpoint the weights the build step
    left unread (on the meta device) come from, one at a time; int4 ones stored as 4-bit codes in groups of
    `group_size` (a GGUF's Q4_0, Q4_1 and Q4_K blocks: its `int4_parts`) keep those codes.
    """
    check_mode(mode)
    if mode == "int4" and group_size not in INT4_GROUP_SIZES:
        raise OptionError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    dtype = getattr(decoder, "compute_dtype", torch.bfloat16)
    if dtype not in KERNEL_DTYPES:
        raise OptionError(f"quantized kernels need a compute dtype in {KERNEL_DTYPES}, got {dtype}")
    targets = [
        name
        for name, module in decoder.named_modules()
        if isinstance(module, nn.Linear)
        and quantizes(name)
        and not any(name == p or name.startswith(p + ".") for p in skip)
    ]
    offloaded = [n for n in targets if decoder.get_submodule(n).weight.device.type == "meta"]
    if offloaded and source is None:
        raise OptionError(
            f"cannot quantize offloaded layers (weights not resident): {', '.join(offloaded[:3])}"
        )
    quantized: list[str] = []
    skipped: dict[str, list[str]] = {}  # reason (one per shape) -> layer names
    with torch.no_grad():
        for name in targets:
            linear = decoder.get_submodule(name)
            kind = "int8" if name in int8 else mode_of(name, mode)
            try:
                new = quantized_linear(linear, name, kind, group_size, dtype, source)
            except ValueError as e:
                skipped.setdefault(str(e), []).append(name)
                if linear.weight.device.type == "meta":  # it stays float: read it now
                    linear.weight = nn.Parameter(source.load(f"{name}.weight").to(dtype), requires_grad=False)
                continue
            parent_name, _, child = name.rpartition(".")
            parent = decoder.get_submodule(parent_name)
            setattr(parent, child, new)
            if getattr(parent, "fused", None) is not None:
                parent.fused = None  # the fused float copy of q/k/v or gate/up would bypass `new` (the
                # loader fuses after quantizing: tierlm.plan)
            quantized.append(name)
    if skipped:
        detail = "; ".join(f"{len(names)} layers like {names[0]}: {why}" for why, names in skipped.items())
        warnings.warn(f"left {sum(map(len, skipped.values()))} layers unquantized: {detail}", stacklevel=2)
    return quantized


def quantized_linear(
    linear: nn.Linear, name: str, kind: str, group_size: int, dtype: torch.dtype, source=None
) -> nn.Module:
    """The Int8Linear or Int4Linear (`kind`) of `linear` (named `name`): int4 from a source's own 4-bit codes
    where it stores them in groups of `group_size`, else quantized from the float weight (linear's own, or
    the source's when linear's is on the meta device). ValueError if int4 cannot take the shape."""
    device = linear.weight.device
    if kind == "int4":
        check_int4_shape(
            linear.out_features,
            linear.in_features,
            group_size,
            torch.device("cpu") if device.type == "meta" else device,
        )
    bias = linear.bias
    if bias is not None and bias.device.type == "meta":
        bias = source.load(f"{name}.bias")
    parts = None
    if (
        kind == "int4"
        and source is not None
        and hasattr(source, "int4_parts")
        and device.type in ("cpu", "meta")
    ):
        block = _cpu_pack_block()  # the codes come in torch's packing, straight from the blocks' bytes
        block = block if block is not None and linear.out_features % block == 0 else None
        parts = source.int4_parts(f"{name}.weight", block=block)
        if parts is not None and parts[1].shape[1] * group_size != linear.in_features:
            parts = None  # stored in groups of another size: requantized from the float weight
    if parts is not None:
        return Int4Linear.from_parts(*parts, dtype=dtype, bias=bias, packed=block is not None)
    weight = linear.weight
    if weight.device.type == "meta":
        weight = source.load(f"{name}.weight").to(dtype)
    float_linear = nn.Linear(linear.in_features, linear.out_features, bias=bias is not None, device="meta")
    float_linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        float_linear.bias = nn.Parameter(bias.to(dtype) if bias.dtype != dtype else bias, requires_grad=False)
    if kind == "int8":
        return Int8Linear.from_linear(float_linear, dtype)
    return Int4Linear.from_linear(float_linear, group_size, dtype)
