"""Decoder building blocks: RMSNorm (and Gemma's), rotary tables, gated MLP, grouped-query attention."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tierlm import kernels
from tierlm.config import ModelConfig
from tierlm.models.rotary import apply_rope


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in fp32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    initial = 1.0  # the weight a new norm starts from (checkpoints overwrite it)
    gemma = False  # Gemma's: scales by (1 + weight) in fp32 (GemmaRMSNorm)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), self.initial))
        self.eps = eps
        # eager bf16 norms run as one call of tierlm's CPU kernel (`Decoder.attention_kernels` sets it)
        self.kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_takes(x.dtype) and _kernel_norm(x):
            return torch.ops.tierlm_avx2.rms_norm(x.contiguous(), self.weight, self.eps, self.gemma)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32, scale in the input dtype (as Hugging Face does, for identical rounding).
        return self.weight * _normalized(x, self.eps).to(x.dtype)

    def _kernel_takes(self, dtype: torch.dtype) -> bool:
        """Whether inputs of `dtype` run on tierlm's norm kernel (eager CPU rows: `_kernel_norm`): bf16, and a
        weight of the same dtype (Gemma's: fp32 too)."""
        weight = self.weight.dtype
        same = self.gemma or weight == dtype
        return self.kernel and dtype == torch.bfloat16 and weight in _KERNEL_DTYPES and same

    def plain(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` for eager CPU inputs of `dtype` whose rows are contiguous, as a plain function with the
        kernel chosen now (an eager decode step's layer program, tierlm.models.programs)."""
        if not self._kernel_takes(dtype):
            return self.reference
        norm, weight, eps, gemma = torch.ops.tierlm_avx2.rms_norm, self.weight, self.eps, self.gemma
        return lambda x: norm(x.contiguous(), weight, eps, gemma)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), in fp32, then rounds to the input dtype (as HF does)."""

    initial = 0.0
    gemma = True

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def _kernel_norm(x: torch.Tensor) -> bool:
    """Whether an RMSNorm whose kernel takes x's dtype (`RMSNorm._kernel_takes`: bf16) runs x as tierlm's kernel
    (rms_norm): eager (a compiled step fuses the norm into its neighbours anyway), on the CPU, rows contiguous
    (the kernel gets x.contiguous()). One call instead
    of ~8 small ops (~20 against 3.5 us for the default model's 576 wide norm, 2 threads of a Zen 4 at AVX2;
    an eager decode step runs 61 of them; int4 eager decode 92.5 -> 111.6 tok/s, interleaved). The same formula in fp32, the sum of
    squares in another order: a few elements a step may round to the neighbouring bf16 value (greedy logits
    within bf16's tolerance of aten's: tests/test_attention.py); fp32 keeps aten's (the exact reference)."""
    return x.device.type == "cpu" and x.stride(-1) == 1 and not torch.compiler.is_compiling()


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
    if (
        rows == 1
        and vector & VECTOR_KERNEL
        and dtype == torch.bfloat16
        and on_cpu
        and _kernel_weight(weight, bias)
    ):
        kernel = torch.ops.tierlm_avx2.bf16_mv
        return lambda x: kernel(x, weight, bias)
    bf16 = dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
    if rows == 1 and vector & VECTOR_EAGER and bf16 and on_cpu:  # `_vector_product`
        if bias is None:
            return lambda x: torch.mv(weight, x.reshape(-1)).unsqueeze(0)
        return lambda x: torch.addmv(bias, weight, x.reshape(-1)).unsqueeze(0)
    return lambda x: F.linear(x, weight, bias)


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


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's GeGLU; HF's "gelu_pytorch_tanh")."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.family.activation]
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused: FusedProjections | None = None
        self.widen = False  # the fused product's prefill in fp32, like Linear.widen
        self.vector = VECTOR_EAGER  # like Linear.vector

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            gate, up = self.fused(x, self.widen, self.vector).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    wide: bool = False,
    kernel: bool = False,
) -> torch.Tensor:
    """Attention for grouped-query heads without expanding K/V.

    q [b, H, s, d]; k, v [b, KV, L, d]; mask [b, 1, s, L] bool (True = attend). Each KV head serves its
    H/KV query heads as one matmul, so the cache is read once per group. scale: on the scores (default
    d ** -0.5); softcap: scores become softcap * tanh(scores / softcap) before the mask (Gemma). wide: in
    fp32, returning q's dtype (bf16 on a CPU without native bf16, whose bf16 matmuls of these shapes are 2-3x
    slower than widening q, K and V and multiplying in fp32: `Attention.widen`). kernel: a decode step (s == 1)
    attends through tierlm's CPU kernel where it fits (`fits_attention_kernel`), in fp32 whatever `wide`.
    """
    if kernel and softcap is None and fits_attention_kernel(q, k, v, mask):
        d = q.shape[-1]
        out = torch.ops.tierlm_avx2.decode_attention(
            q[:, :, 0], k, v, mask, d**-0.5 if scale is None else scale
        )
        return out.unsqueeze(2)
    dtype = q.dtype
    if wide:
        q, k, v = q.float(), k.float(), v.float()
    b, h, s, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, (h // kv) * s, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, kv, h // kv, s, -1).float()
    scores = torch.where(mask.unsqueeze(1), scores, float("-inf"))  # one op, not ~mask then masked_fill
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, kv, (h // kv) * s, -1)
    out = torch.matmul(probs, v).view(b, h, s, d)
    return out.to(dtype) if wide else out  # no dtype round trip on the narrow path (a decode hot path)


def attention_kernel() -> bool:
    """Whether this process's CPU decode steps attend through tierlm's kernel (`tierlm.kernels`,
    decode_attention): where it runs tierlm's kernels (`cpu.CpuFeatures.int_kernels`) and they are built
    (on first use, once per machine). One kernel call replaces two batched products and a softmax, reads each K/V head once for
    its query heads, in fp32 (SmolLM2's 9 heads of 64 over 256 bf16 slots, 2 threads of a Zen 4 at AVX2: 12
    against 76 us eager widened), and leaves inductor no GEMM template to render per layer."""
    return kernels.selected() is not None


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernel_heads(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether tierlm's decode attention kernels take this head layout and dtype: fp32 or bf16, up to 8
    query heads per K/V head, a head size a multiple of 8 (decode_rope_attention: up to 512 too)."""
    return (
        dtype in _KERNEL_DTYPES
        and kv_heads > 0
        and heads % kv_heads == 0
        and heads // kv_heads <= 8
        and head_dim % 8 == 0
    )


def fits_attention_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, length: int | None = None
) -> bool:
    """Whether tierlm's decode attention kernel takes these: one query position, CPU tensors of fp32 or bf16,
    up to 8 query heads per K/V head, a head size a multiple of 8, K and V rows contiguous and alike.
    length: the slots attended (the first `length` of k and v; None: all)."""
    b, h, s, d = q.shape
    length = k.shape[2] if length is None else length
    return (
        s == 1
        and k.shape == v.shape
        and k.shape[0] == b
        and 0 < length <= k.shape[2]
        and k.shape[3] == d
        and mask.shape[0] == b
        and q.device.type == "cpu"
        and kernel_heads(h, k.shape[1], d, q.dtype)
        and k.dtype == v.dtype
        and k.dtype in _KERNEL_DTYPES
        and mask.dtype == torch.bool
        and mask.shape[-1] == length
        and mask.numel() == b * length
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and k.stride(2) == v.stride(2)
    )


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor | None:
    """A decode step's rotary, K/V write and attention in one call of tierlm's CPU kernel
    (decode_rope_attention), for a static cache written at `slots` (a StaticLayerView's; a RingLayerView's
    `decode_slots`): q [b, 1, H, d], k and v
    [b, 1, KV, d] before rotary, the layer's whole keys and values [b, KV, L, d]; it attends over the first
    mask.shape[-1] slots. Returns [b, H, 1, d], or None where the kernel does not take these (the caller
    runs apply_rope, index_copy_ and `grouped_attention` instead). The rotary runs in fp32 and rounds once to
    the dtype: in fp32 aten's ops bit for bit; in bf16 as a compiled step's fused rotary does, where eager
    aten rounds each product too (a difference within bf16's tolerance). Then `decode_attention`. One call
    instead of ~8 small ops: on the default model, 2 threads of a Zen 4 at AVX2, 20 against 51 us a layer
    eager."""
    b, s, h, d = q.shape
    kv, length = keys.shape[1], mask.shape[-1]
    fits = (
        s == 1
        and k.shape == v.shape == (b, 1, kv, d)
        and d <= 512
        and cos.shape == sin.shape
        and cos.shape[-1] == d
        and cos.shape[0] in (1, b)
        and cos.numel() == cos.shape[0] * d
        and cos.dtype == sin.dtype
        and cos.dtype in _KERNEL_DTYPES
        and k.dtype == v.dtype == q.dtype
        and slots.numel() == 1
        and slots.dtype == torch.long
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and fits_attention_kernel(q.transpose(1, 2), keys, values, mask, length)
    )
    if not fits:
        return None
    out = torch.ops.tierlm_avx2.decode_rope_attention(
        q[:, 0], k[:, 0], v[:, 0], cos, sin, keys, values, slots, mask, d**-0.5 if scale is None else scale
    )
    return out.unsqueeze(2)


def _static_view(cache, layer: int):
    """The layer's static K/V where a decode step writes its token at one slot for every row and may attend
    through `rope_attention` (a StaticLayerView, or a sliding layer's RingLayerView: their `decode_slots` and
    `attended`; not a continuous batch's per-row slots), else None."""
    if hasattr(cache, "decode_slots"):  # a compiled layer body's own view
        return cache
    views = getattr(cache, "views", None)
    view = None if views is None else views[layer]
    return view if hasattr(view, "decode_slots") else None


def wide_decode_attention(q: torch.Tensor) -> bool:
    """Whether an eager bf16 decode step attends in fp32 on a CPU that has native bf16 too (without it,
    `Attention.widen` already does): the tiny matmuls of a decode step, with a fresh shape every step, run
    1.2-2x faster widened there as well (AMX Xeon, 2 threads: Gemma 3's 4 heads of 256 over 512 slots 82
    against 163 us, SmolLM2's 9 of 64 over 512 slots 75 against 86 us)."""
    return q.dtype == torch.bfloat16 and q.device.type == "cpu"


# torch.compiler.nested_compile_region is newer than the oldest torch tierlm accepts; without it the region
# functions are plain ones, which a compiled step inlines per layer as before
_nested_region = getattr(torch.compiler, "nested_compile_region", lambda fn: fn)


def _decode_attention(q, k, v, cos, sin, mask, keys, values, slots, wide: bool, kernel: bool) -> torch.Tensor:
    """One layer's compiled decode attention from q [b, s, H, d], k and v [b, s, KV, d]: rotary, this step's
    K/V written into the layer's static cache in place, grouped attention over the whole cache."""
    q = apply_rope(q.transpose(1, 2), cos, sin)
    k = apply_rope(k.transpose(1, 2), cos, sin)
    keys.index_copy_(2, slots, k)
    values.index_copy_(2, slots, v.transpose(1, 2))
    return grouped_attention(q, keys, values, mask, wide=wide, kernel=kernel)


@_nested_region
def decode_attention_region(
    qkv, cos, sin, mask, keys, values, slots, wide: bool, kernel: bool
) -> torch.Tensor:
    """A whole compiled decode step's attention for one layer, from its fused q/k/v product to the attention
    output [b, H, 1, d] (`_decode_attention`). A nested compile region: inductor compiles it once and every
    layer calls that code, where it would otherwise lower, fuse and generate the same attention once per layer
    (and render its two C++ bmm templates per layer). Measured on a Zen 3, int8 weights, fresh inductor cache:
    the first call of the whole step 113.6 s against 201.4, decode within 2% (59.4 against 60.5 tok/s,
    interleaved in one process), the same greedy tokens. The weight products stay outside, in the step's own
    graph, where they are frozen constants that inductor prepacks: a region's weights would be its inputs,
    and inductor's C++ GEMM templates take only constant weights (a whole layer as one region compiled in
    52.7 s but decoded 35% slower). Outside torch.compile it is a plain function. q, k and v are split here,
    from one input, because a region cannot take inputs that alias each other."""
    b, s, _ = qkv.shape
    kv, d = keys.shape[1], keys.shape[3]
    h = qkv.shape[-1] // d - 2 * kv
    q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
    return _decode_attention(
        q.view(b, s, h, d),
        k.view(b, s, kv, d),
        v.view(b, s, kv, d),
        cos,
        sin,
        mask,
        keys,
        values,
        slots,
        wide,
        kernel,
    )


@_nested_region
def split_decode_attention_region(
    q, k, v, cos, sin, mask, keys, values, slots, wide: bool, kernel: bool
) -> torch.Tensor:
    """`decode_attention_region` for separate q/k/v products (a layer whose projections are not fused)."""
    b, s, _ = q.shape
    kv, d = keys.shape[1], keys.shape[3]
    q, k, v = q.view(b, s, -1, d), k.view(b, s, kv, d), v.view(b, s, kv, d)
    return _decode_attention(q, k, v, cos, sin, mask, keys, values, slots, wide, kernel)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, grouped_decode: bool = True) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.grouped_decode = grouped_decode  # single-token steps use grouped_attention; False: SDPA
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hd = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.family.qk_norm:
            norm = GemmaRMSNorm if cfg.family.gemma_norms else RMSNorm
            self.q_norm = norm(hd, cfg.rms_norm_eps)
            self.k_norm = norm(hd, cfg.rms_norm_eps)
        # Gemma: query_pre_attn_scalar and score softcapping; None keeps SDPA's own 1/sqrt(head_dim).
        self.scale = cfg.attn_scale if cfg.query_pre_attn_scalar is not None else None
        self.softcap = cfg.attn_logit_softcapping
        self.sliding = cfg.is_sliding(layer_idx)
        self.fused: FusedProjections | None = None
        self.widen = False  # prefill products and the attention matmuls in fp32 (bf16 without native bf16)
        # ... and the attention matmuls of a compiled step whose matmuls are aten's (tierlm.steps.build sets
        # it: a max-autotune step's C++ GEMM templates are faster on bf16 itself)
        self.widen_compiled = False
        self.vector = VECTOR_EAGER  # like Linear.vector, for the fused q/k/v product
        # A whole compiled step's decode attention as one region compiled once for all layers
        # (`decode_attention_region`; tierlm.steps.build sets it for CPU whole steps)
        self.region = False
        # decode steps attend through tierlm's CPU kernel where it fits (Decoder.attention_kernels)
        self.kernel = False

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.fused is not None:
            kv = self.num_kv_heads * self.head_dim
            qkv = self.fused(x, self.widen, self.vector)
            return qkv.split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache,
        slots,
        length: int | None = None,
    ):
        """length: the cache slots attended over (the first `length`; None: the whole cache)."""
        b, s, _ = x.shape
        if s == 1 and self.region and torch.compiler.is_compiling() and self._regular(cache, length):
            view = cache.views[self.layer_idx]
            state = (*rope, mask, view.keys, view.values, slots, self.widen_compiled, self.kernel)
            if self.fused is not None:
                out = decode_attention_region(self.fused(x, self.widen, self.vector), *state)
            else:
                out = split_decode_attention_region(self.q_proj(x), self.k_proj(x), self.v_proj(x), *state)
            return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        q, k, v = self.project(x)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        if s == 1 and self.kernel and self.grouped_decode and self.softcap is None:
            view = _static_view(cache, self.layer_idx)
            if view is not None and mask.shape[-1] == view.attended(length):
                at = view.decode_slots(slots)
                out = rope_attention(q, k, v, cos, sin, view.keys, view.values, at, mask, self.scale)
                if out is not None:
                    return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        v = v.transpose(1, 2)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v, slots, length)
        if (s == 1 and self.grouped_decode) or self.softcap is not None:  # SDPA has no softcap
            if torch.compiler.is_compiling():
                wide = self.widen_compiled
            else:  # eager decode on the CPU attends in fp32 whatever the CPU (`wide_decode_attention`)
                wide = self.widen or (s == 1 and wide_decode_attention(q))
            # decode: never expand K/V
            out = grouped_attention(q, k, v, mask, self.scale, self.softcap, wide, self.kernel)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def _regular(self, cache, length: int | None) -> bool:
        """Whether this layer's decode attention fits `decode_attention_region`: no q/k norms, scale or
        softcap, and a static cache view of its own read whole (`writes_at_slots`: not a sliding
        ring, not a continuous batch's per-row slots)."""
        views = getattr(cache, "views", None)
        view = None if views is None else views[self.layer_idx]
        return (
            self.grouped_decode
            and not hasattr(self, "q_norm")
            and self.scale is None
            and self.softcap is None
            and getattr(view, "writes_at_slots", False)
            and length in (None, view.keys.shape[2])
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, mask, cache=None, slots=None, length=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache, slots, length)
        return x + self.mlp(self.post_attention_layernorm(x))
