"""Eager CPU decode steps without the module tree: each decoder layer as one plain function.

An eager decode step of a small model spends as long in Python as in its kernels: the default model's
30 layers make ~270 module calls and ~450 tensor ops a token, each module re-reading its parameters and
re-deciding its kernel (Zen 4, int4, batch 1: ~4 of ~10 ms a token). A layer program makes those choices
once, when a generation starts, and keeps the weights and the layer's static cache view at hand, so a step
runs only the products, norms and attention kernel the module path would run, in the same order on the
same tensors: its logits are bit for bit the module path's (tests/test_programs.py).

A layer gets a program where its decode step would run tierlm's fused rotary-attention kernel
(`layers.rope_attention`) over a static cache view (a sliding layer's ring too), each product has a plain
function (`product` of linear.Linear, linear.FusedProjections and the quantized linears) and no hook
watches it but a streamer's, where the streamer fetches and releases the layer's weights around its program
(memory-mapped disk pages on a CPU, used in place). Any other layer runs as a module, as before.

A layer whose products are all tierlm's int4, int8 or one-row bf16 kernel and whose norms are its norm kernel
(Llama, Mistral, Qwen 2 and 3, Gemma 3) runs its program as one call of the kernels' `layer_step` (`_native`),
which makes the same calls from C++: the same bits, without ~15 calls from Python a layer (Zen 3, 2 threads,
the default model in int4: 102-103 -> 110-119 tok/s, interleaved in one process).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.models.gemma3 import Gemma3DecoderLayer
from tierlm.models.layers import DecoderLayer, gelu_tanh, kernel_heads

Program = Callable[..., torch.Tensor]  # program(x [rows, 1, hidden], rope, mask, slots) -> x after the layer
Around = Callable[[nn.Module, Callable[[], "Program | None"]], "Program | None"]


class DecodePrograms:
    """Per layer of a decoder, its program for decode steps of `rows` rows over `cache` (a static cache), or
    None (the layer runs as a module)."""

    def __init__(self, layers: list[Program | None], rows: int, cache) -> None:
        self.by_layer, self.rows, self.cache = layers, rows, cache

    @property
    def layers(self) -> int:
        """How many layers run as programs."""
        return sum(p is not None for p in self.by_layer)


def decode_programs(decoder: nn.Module, cache, around: Around | None = None) -> DecodePrograms | None:
    """Programs for the eager decode steps of `decoder` over `cache` (a static cache: one view per layer), or
    None where no layer has one. around(layer, build): the layer's program from build() -> program or None,
    for a decoder whose layers may stream their weights (Streamer.around_program); None: build()."""
    views = getattr(cache, "views", None)
    rows = getattr(cache, "batch", None)
    if views is None or rows is None or _global_hooks():
        return None
    dtype = decoder.compute_dtype
    around = around or (lambda _layer, build: build())
    programs = [
        around(layer, lambda layer=layer, view=view: layer_program(layer, view, rows, dtype))
        for layer, view in zip(decoder.model.layers, views)
    ]
    return DecodePrograms(programs, rows, cache) if any(p is not None for p in programs) else None


def layer_program(layer: nn.Module, view, rows: int, dtype: torch.dtype) -> Program | None:
    """`layer`'s decode step over its cache view `view` for inputs of `rows` rows of `dtype`, or None."""
    attn, mlp = layer.self_attn, layer.mlp
    gemma = type(layer) is Gemma3DecoderLayer
    plain = gemma or type(layer) is DecoderLayer  # a subclass may run another forward
    if not plain or _hooked(layer) or not _attends_through_kernel(attn, view, dtype):
        return None
    heads, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    project = _projections(attn, rows, dtype, heads, kv, d)
    gate_up = _gate_up(mlp, rows, dtype)
    o_proj, down = _product(attn.o_proj, rows, dtype), _product(mlp.down_proj, rows, dtype)
    if None in (project, gate_up, o_proj, down):
        return None
    norm_in = layer.input_layernorm.plain(dtype)
    norm_mid = (layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm).plain(dtype)
    after_attn = layer.post_attention_layernorm.plain(dtype) if gemma else None
    after_mlp = layer.post_feedforward_layernorm.plain(dtype) if gemma else None
    q_norm = attn.q_norm.plain(dtype) if hasattr(attn, "q_norm") else None
    k_norm = attn.k_norm.plain(dtype) if hasattr(attn, "k_norm") else None
    hidden, act = layer.input_layernorm.weight.shape[0], mlp.act
    scale = d**-0.5 if attn.scale is None else attn.scale
    keys, values, decode_slots = view.keys, view.values, view.decode_slots
    native = _native(layer, view, rows, dtype, gemma)
    if native is not None:
        return native
    attend = torch.ops.tierlm_avx2.decode_rope_attention  # checks every input it is given

    def program(x: torch.Tensor, rope, mask: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        x = x.view(rows, hidden)
        q, k, v = project(norm_in(x))
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        at = decode_slots(slots)
        out = o_proj(attend(q, k, v, rope[0], rope[1], keys, values, at, mask, scale).view(rows, -1))
        x = x + (out if after_attn is None else after_attn(out))
        gate, up = gate_up(norm_mid(x))
        out = down(act(gate) * up)
        return (x + (out if after_mlp is None else after_mlp(out))).view(rows, 1, hidden)

    return program


def _native(layer: nn.Module, view, rows: int, dtype: torch.dtype, gemma: bool) -> Program | None:
    """The layer's program as one call of the kernels' layer_step, which runs the Python program's ops in its
    order from C++ (the same bits, without ~15 calls from Python a layer), where every product is tierlm's
    int4, int8 or one-row bf16 kernel (biases too), every norm its norm kernel with one eps and the activation
    SiLU or Gemma's tanh GELU; else None."""
    attn, mlp = layer.self_attn, layer.mlp
    mid = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
    qk = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    after = [layer.post_attention_layernorm, layer.post_feedforward_layernorm] if gemma else []
    norms = [layer.input_layernorm, mid, *(n for n in qk if n is not None), *after]
    one_of_qk = (qk[0] is None) != (qk[1] is None)
    if mlp.act not in (F.silu, gelu_tanh) or (gemma and None in qk) or one_of_qk:
        return None  # layer_step reads Gemma's norms after q and k's, and takes q and k norms together
    if len({(n.eps, n.gemma) for n in norms}) > 1:
        return None
    if attn.fused is None or mlp.fused is None or not all(n._kernel_takes(dtype) for n in norms):
        return None
    operands = [
        attn.fused.kernel_operands(rows, dtype, attn.vector),
        _kernel_operands(attn.o_proj, rows, dtype),
        mlp.fused.kernel_operands(rows, dtype, mlp.vector),
        _kernel_operands(mlp.down_proj, rows, dtype),
    ]
    linears = (attn.fused.packed, attn.o_proj, mlp.fused.packed, mlp.down_proj)
    blocks = {m.block for m, o in zip(linears, operands) if o is not None and o[2] > 0}
    if None in operands or len(blocks) > 1:
        return None
    weights, scales, groups, biases = (list(column) for column in zip(*operands))
    block, hidden = next(iter(blocks), 32), layer.input_layernorm.weight.shape[0]
    shape = [attn.num_heads, attn.num_kv_heads, attn.head_dim]
    scale = attn.head_dim**-0.5 if attn.scale is None else attn.scale
    # K/V written at the step's slot (a static cache), or at slot % ring (a sliding layer's ring)
    ring = 0 if getattr(view, "writes_at_slots", False) else getattr(view, "ring", None)
    if ring is None:
        return None
    norm_weights, eps, gelu = [n.weight for n in norms], norms[0].eps, mlp.act is gelu_tanh
    args = (norm_weights, eps, gemma, gelu, weights, scales, groups, biases, block, shape)
    keys, values, step = view.keys, view.values, torch.ops.tierlm_avx2.layer_step

    def program(x: torch.Tensor, rope, mask: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        x = step(x.view(rows, hidden), *args, rope[0], rope[1], keys, values, slots, ring, mask, scale)
        return x.view(rows, 1, hidden)

    return program


def _kernel_operands(module: nn.Module, rows: int, dtype: torch.dtype):
    operands = getattr(module, "kernel_operands", None)
    return None if operands is None else operands(rows, dtype)


def _projections(attn: nn.Module, rows: int, dtype: torch.dtype, heads: int, kv: int, d: int):
    """x [rows, hidden] -> q [rows, heads, d], k and v [rows, kv, d]: one fused product or three, or None."""
    if attn.fused is not None:
        qkv, split = attn.fused.product(rows, dtype, attn.widen, attn.vector), [heads, kv, kv]
        return None if qkv is None else lambda x: qkv(x).view(rows, heads + 2 * kv, d).split(split, 1)
    q, k, v = (_product(p, rows, dtype) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    if None in (q, k, v):
        return None
    return lambda x: (q(x).view(rows, heads, d), k(x).view(rows, kv, d), v(x).view(rows, kv, d))


def _gate_up(mlp: nn.Module, rows: int, dtype: torch.dtype):
    """x [rows, hidden] -> (gate, up): one fused product or two, or None."""
    if mlp.fused is not None:
        gate_up = mlp.fused.product(rows, dtype, mlp.widen, mlp.vector)
        return None if gate_up is None else lambda x: gate_up(x).chunk(2, dim=-1)
    gate, up = _product(mlp.gate_proj, rows, dtype), _product(mlp.up_proj, rows, dtype)
    return None if gate is None or up is None else lambda x: (gate(x), up(x))


def _attends_through_kernel(attn: nn.Module, view, dtype: torch.dtype) -> bool:
    """Whether `attn`'s decode step runs `layers.rope_attention`'s kernel over `view` (what Attention.forward
    checks each step, where it holds for every decode step of a static cache)."""
    keys, values = getattr(view, "keys", None), getattr(view, "values", None)
    d = attn.head_dim
    return (
        attn.kernel
        and attn.grouped_decode
        and attn.softcap is None
        and hasattr(view, "decode_slots")  # a static view or a sliding layer's ring (layers._static_view)
        and keys.device.type == "cpu"
        and keys.dtype == values.dtype == dtype
        and keys.shape == values.shape
        and keys.stride(-1) == values.stride(-1) == 1
        and keys.stride(2) == values.stride(2)
        and kernel_heads(attn.num_heads, attn.num_kv_heads, d, dtype)
        and d <= 512
    )


def _product(module: nn.Module, rows: int, dtype: torch.dtype):
    product = getattr(module, "product", None)
    return None if product is None else product(rows, dtype)


def _hooked(layer: nn.Module) -> bool:
    """Whether a forward hook watches the layer or a module it calls, fused products' own linears included
    (a FusedProjections is no module: its linear is not among the layer's modules)."""
    fused = (getattr(getattr(layer, part, None), "fused", None) for part in ("self_attn", "mlp"))
    packed = [f.packed for f in fused if f is not None and f.packed is not None]
    return any(m._forward_hooks or m._forward_pre_hooks for m in (*layer.modules(), *packed))


def _global_hooks() -> bool:
    """Whether hooks for every module are registered (torch.nn.modules.module.register_module_forward_hook)."""
    module = torch.nn.modules.module
    return bool(
        getattr(module, "_global_forward_hooks", None) or getattr(module, "_global_forward_pre_hooks", None)
    )
