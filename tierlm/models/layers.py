"""Decoder building blocks: RMSNorm (and Gemma's), rotary tables, gated MLP, grouped-query attention."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tierlm import kernels
from tierlm.config import ModelConfig
from tierlm.models.linear import VECTOR_EAGER, FusedProjections, Linear
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
