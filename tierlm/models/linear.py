"""The decoder's linear products: `linear` (F.linear with its CPU choices: fp32-widened prefill, one-row
products as torch.mv or on tierlm's bf16 kernel), `Linear` (nn.Linear through it), the projections fused into
one product (`FusedProjections`), and `linear_product`, a decode step's product as a plain function with those
choices made once (tierlm.models.programs)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

WIDE_ROWS = 4  # an eager decode step of at least this many rows is a matrix-matrix product too
WIDE_FP32_BYTES = 8 * 2**20  # ... widened only where the weight's fp32 copy stays in the cache


# Where a one-row bf16 product (a batch-1 decode step) runs as torch.mv rather than F.linear: bit flags a
# module's `vector` holds (tierlm.cpu decides: CpuFeatures.eager_mv, compiled_layer_mv); VECTOR_KERNEL: an
# eager one runs on tierlm's bf16 kernel instead (`kernels.bf16_vector_product`, where it is built).
VECTOR_EAGER, VECTOR_COMPILED, VECTOR_KERNEL = 1, 2, 4


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, widen: bool, vector: int = VECTOR_EAGER
) -> torch.Tensor:
    """F.linear; with `widen`, a product of several tokens per row (prefill), or an eager decode step of
    WIDE_ROWS rows or more whose weight is small, runs in fp32 and returns x's dtype; a one-row bf16 product
    runs on tierlm's bf16 kernel or as torch.mv where `vector` says so.

    On CPUs without native bf16 a bf16 matrix-vector product (decode) is memory-bound and fast, but
    a bf16 matrix-matrix product has no fast kernel there: its time grows with the rows. Prefill of the
    default model measured 39-42 tok/s in bf16 against 113-251 widened; a 16-row decode product of a
    1536x576 weight 5.3 ms against 1.9 widened, but of the 49152x576 LM head 111 ms against 176 (its fp32
    copy, 113 MB, leaves the cache), hence WIDE_FP32_BYTES (Zen 3, tierlm.cpu decides). Compiled steps
    never widen a decode step (inductor has its own bf16 kernels, and freezing would fold fp32 copies)."""
    if widen and x.dim() > 2 and (x.shape[-2] > 1 or _wide_decode(x, weight)):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    if vector & VECTOR_KERNEL and x.numel() == x.shape[-1] and _kernel_product(x, weight, bias):
        y = torch.ops.tierlm_avx2.bf16_mv(x.reshape(1, -1), weight, bias)
        return y.reshape(*x.shape[:-1], weight.shape[0])
    if x.numel() == x.shape[-1] and _vector_product(x, weight, vector):
        v = x.reshape(-1)
        y = torch.mv(weight, v) if bias is None else torch.addmv(bias, weight, v)
        return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _vector_product(x: torch.Tensor, weight: torch.Tensor, vector: int) -> bool:
    """Whether a one-row bf16 product runs as torch.mv: in eager steps where `vector` has VECTOR_EAGER, in
    compiled ones where it has VECTOR_COMPILED. Eager: torch's bf16 matrix-vector kernel reads the weight
    faster than F.linear's with AMX (a Xeon, 2 threads: the 262144x640 Gemma 3 LM head 13.5 against 21.1 ms,
    a 2048x640 projection 43 against 82 us) and without native bf16 (Zen 3: 1.03-1.14x), slower on a Zen 4
    (AVX-512 BF16, no AMX: 0.57-0.85x; the 49152x576 head 5.7 against 3.3 ms). Compiled (layer scope, where
    matmuls stay aten's): inductor turns torch.mv into a reduction fused with its neighbours, which on that
    Zen 4 reads the head in 1.7 ms and doubles a bf16 layer-scope decode (24 -> 46-48 tok/s)."""
    where = VECTOR_COMPILED if torch.compiler.is_compiling() else VECTOR_EAGER
    return (
        bool(vector & where)
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
    )


def _kernel_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether an eager one-row product runs on tierlm's bf16 kernel (where `vector` has VECTOR_KERNEL):
    bf16 x, weight and bias on the CPU, x and the weight contiguous, the weight [N, K] with K a multiple of 32
    and N of 4."""
    return (
        x.dtype == torch.bfloat16
        and x.is_contiguous()
        and _kernel_weight(weight, bias)
        and x.device.type == "cpu"
        and not torch.compiler.is_compiling()
    )


def _kernel_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    n, k = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and k % 32 == 0
        and n % 4 == 0
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
    )


def _wide_decode(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // x.shape[-1]
    small = weight.numel() * 4 <= WIDE_FP32_BYTES
    return rows >= WIDE_ROWS and small and not torch.compiler.is_compiling()


Product = Callable[[torch.Tensor], torch.Tensor]  # x [rows, in] -> y [rows, out]


def linear_product(
    weight: torch.Tensor, bias: torch.Tensor | None, widen: bool, vector: int, rows: int, dtype: torch.dtype
) -> Product:
    """`linear` for an eager decode step of `rows` rows of `dtype` (one position each) on the CPU, as a plain
    function of x [rows, in], its choices made now (an eager decode step's layer program,
    tierlm.models.programs). The same products as `linear` on x [rows, 1, in]."""
    if widen and rows >= WIDE_ROWS and weight.numel() * 4 <= WIDE_FP32_BYTES:  # `_wide_decode`
        # widened per call, as `linear` does
        return lambda x: F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(dtype)
    on_cpu = weight.device.type == "cpu"
    if _takes_bf16_kernel(weight, bias, vector, rows, dtype):
        kernel = torch.ops.tierlm_avx2.bf16_mv
        return lambda x: kernel(x, weight, bias)
    bf16 = dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
    if rows == 1 and vector & VECTOR_EAGER and bf16 and on_cpu:  # `_vector_product`
        if bias is None:
            return lambda x: torch.mv(weight, x.reshape(-1)).unsqueeze(0)
        return lambda x: torch.addmv(bias, weight, x.reshape(-1)).unsqueeze(0)
    return lambda x: F.linear(x, weight, bias)


def _takes_bf16_kernel(weight, bias, vector: int, rows: int, dtype: torch.dtype) -> bool:
    """Whether `linear_product` runs tierlm's one-row bf16 kernel (bf16_mv); one row is never widened
    (WIDE_ROWS > 1)."""
    cpu_weight = weight.device.type == "cpu"
    return (
        rows == 1
        and bool(vector & VECTOR_KERNEL)
        and dtype == torch.bfloat16
        and cpu_weight
        and _kernel_weight(weight, bias)
    )


def linear_kernel_operands(weight, bias, vector: int, rows: int, dtype: torch.dtype):
    """(weight, weight, -1, bias) where `linear_product` is tierlm's one-row bf16 kernel, for a layer step that
    calls the kernels from C++ (kernels' layer_step: group -1 means bf16_mv); else None."""
    takes = _takes_bf16_kernel(weight, bias, vector, rows, dtype)
    return (weight, weight, -1, bias) if takes else None


class Linear(nn.Linear):
    """nn.Linear whose prefill products may run widened to fp32 (see `linear`; off by default)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.widen = False
        # where one-row bf16 products run as torch.mv or on tierlm's bf16 kernel (Decoder.vector_products)
        self.vector = VECTOR_EAGER

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.widen, self.vector)

    def product(self, rows: int, dtype: torch.dtype) -> Product:
        """`forward` for a decode step's CPU input [rows, in_features] as a plain function (`linear_product`)."""
        return linear_product(self.weight, self.bias, self.widen, self.vector, rows, dtype)

    def kernel_operands(self, rows: int, dtype: torch.dtype):
        """`linear_kernel_operands` of this linear's product."""
        return linear_kernel_operands(self.weight, self.bias, self.vector, rows, dtype)


# Which projections fuse into one matmul, as data (nano-vllm's packed-modules mapping): under each layer's
# module (key), its projections (in the order of the fused weight's rows) become one weight, `fused`, of
# which each projection keeps a view under its HF name. Applied at load time (tierlm.loading, `fuse`).
FUSED_PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


class FusedProjections:
    """Several projections of one input (q/k/v, gate/up) as one product: a float weight (and bias), or
    `packed`, a quantized linear (tierlm.quant) holding the projections' packed rows one after another.

    Each projection keeps a view of its rows under its Hugging Face name. Deliberately not an nn.Module: the
    HF names keep owning the parameters (device maps, state dicts and exported steps see those only).
    """

    def __init__(self, weight=None, bias=None, packed: nn.Module | None = None) -> None:
        self.weight, self.bias, self.packed = weight, bias, packed

    def __call__(self, x: torch.Tensor, widen: bool, vector: int = VECTOR_EAGER) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return linear(x, self.weight, self.bias, widen, vector)

    def product(
        self, rows: int, dtype: torch.dtype, widen: bool, vector: int = VECTOR_EAGER
    ) -> Product | None:
        """`__call__` for a decode step's CPU input [rows, in] as a plain function, or None (`product` of the
        packed linear, or `linear_product`)."""
        if self.packed is not None:
            product = getattr(self.packed, "product", None)
            return None if product is None else product(rows, dtype)
        return linear_product(self.weight, self.bias, widen, vector, rows, dtype)

    def kernel_operands(self, rows: int, dtype: torch.dtype, vector: int = VECTOR_EAGER):
        """The packed linear's `kernel_operands`, or `linear_kernel_operands` of the float weight."""
        if self.packed is not None:
            operands = getattr(self.packed, "kernel_operands", None)
            return None if operands is None else operands(rows, dtype)
        return linear_kernel_operands(self.weight, self.bias, vector, rows, dtype)


def fuse_projections(*projections: nn.Module) -> FusedProjections | None:
    """One product for several projections with the same input, or None where they cannot share one.

    Fewer, larger matmuls cut per-op overhead on the decode path. Float linears concatenate their weights
    (`fuse_linears`); quantized linears of one kind concatenate their packed rows through their own
    `fuse` classmethod (tierlm.quant), which returns None where its kernel's layout does not allow it.
    """
    kind = type(projections[0])
    if any(type(p) is not kind for p in projections):
        return None
    if kind in (nn.Linear, Linear):
        return FusedProjections(*fuse_linears(*projections))
    fuse = getattr(kind, "fuse", None)
    packed = None if fuse is None else fuse(projections)
    return None if packed is None else FusedProjections(packed=packed)


def fuse_linears(*linears: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several float nn.Linear with the same input; each keeps a view of its rows."""
    weight = torch.cat([lin.weight for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias for lin in linears]) if has_bias else None
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if has_bias:
            lin.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias
