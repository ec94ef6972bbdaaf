"""The decoder: embed -> layers -> norm -> lm_head, with Hugging Face module names."""

from __future__ import annotations

import torch
from torch import nn

from tierlm import kernels
from tierlm.config import ModelConfig, RopeScaling
from tierlm.models.gemma3 import Gemma3DecoderLayer
from tierlm.models.layers import DecoderLayer, GemmaRMSNorm, RMSNorm, kernel_heads
from tierlm.models.linear import VECTOR_COMPILED, VECTOR_EAGER, VECTOR_KERNEL, Linear, fuse_projections
from tierlm.models.masks import attention_mask_4d
from tierlm.models.rotary import rope_tables

ROPE_CHUNK = 4096  # rotary tables grow in steps of this many positions


def _embedding(vocab: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without its random init on the meta device (where load and plan build the decoder):
    normal_ on a meta tensor imports torch._dynamo and torch._inductor, ~1.7 s of every load; a checkpoint
    overwrites the weight anyway."""
    weight = torch.empty(vocab, dim)  # on the device of the surrounding `with torch.device(...)`
    return nn.Embedding(vocab, dim, _weight=weight) if weight.is_meta else nn.Embedding(vocab, dim)


class DecoderBody(nn.Module):
    """`model.*` in HF naming: embed_tokens, layers, norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        gemma = cfg.family.gemma_norms
        layer = Gemma3DecoderLayer if gemma else DecoderLayer
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = (GemmaRMSNorm if gemma else RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """A decoder-only causal LM. forward(input_ids) returns logits [batch, seq, vocab]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.compute_dtype = torch.float32  # set by the loader
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        # Sliding layers (Gemma 3): their own rotary base, a windowed mask.
        self.sliding = [cfg.is_sliding(i) for i in range(cfg.num_layers)]
        self.local_cos: torch.Tensor | None = None
        self.local_sin: torch.Tensor | None = None
        # Gemma scales embeddings by sqrt(hidden_size) rounded to the activations' dtype; computed here, as
        # plain floats per dtype, so a compiled forward reads a constant and never traces the rounding.
        self.embed_scales = {dt: embed_scale(cfg.hidden_size, dt) for dt in FLOAT_DTYPES}

    def fuse(self, table: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
        """Fuse, for each (module, projections) of `table` (a LoadPlan's `fusion`, from FUSED_PROJECTIONS),
        those projections into one weight the module multiplies by; the projections become views of it."""
        for module, parts in table:
            owner = self.get_submodule(module)
            owner.fused = fuse_projections(*(getattr(owner, p) for p in parts))

    def uniformly_fused(self) -> bool:
        """Whether every layer has the same projections fused (so one compiled layer body serves them all)."""
        kinds = {(layer.self_attn.fused is None, layer.mlp.fused is None) for layer in self.model.layers}
        return len(kinds) == 1

    def unfuse_projections(self) -> None:
        """Run every layer on its separate projections (views of the fused weights), as streamed layers that
        could not fuse do (a cpu-tier unit, a CUDA forward, a group split between units)."""
        for layer in self.model.layers:
            layer.self_attn.fused = None
            layer.mlp.fused = None

    def widen_prefill(self, on: bool = True) -> None:
        """Run multi-token products of the float linears in fp32 (linear.linear): for bf16 weights on a
        CPU without native bf16 (tierlm.cpu); decode steps keep the weights' own dtype."""
        for module in self.modules():
            if hasattr(module, "widen"):
                module.widen = on

    def vector_products(
        self, eager: bool | None = None, compiled: bool | None = None, kernel: bool | None = None
    ) -> None:
        """Where one-row bf16 products run as torch.mv (linear.linear): in eager steps, in compiled ones;
        kernel: eager ones on tierlm's bf16 kernel instead (ValueError where it is not built). None keeps that
        flag as it is."""
        if kernel and kernels.bf16_vector_product() is None:
            raise ValueError("tierlm's one-row bf16 kernel is not built on this machine")
        halves = ((VECTOR_EAGER, eager), (VECTOR_COMPILED, compiled), (VECTOR_KERNEL, kernel))
        kept = ~sum(flag for flag, on in halves if on is not None)
        set_ = sum(flag for flag, on in halves if on)
        for module in self.modules():
            if hasattr(module, "vector"):
                module.vector = module.vector & kept | set_

    def widen_compiled_attention(self, on: bool, bf16_too: bool = False) -> None:
        """Whether compiled steps attend in fp32 where eager ones do (`widen_prefill`): for a compile mode
        whose matmuls stay aten's, which are slow in bf16 without native bf16 (a layer-scope decode of the
        default model: 31.1 tok/s widened against 26.8, interleaved in one process on a Zen 3). A max-autotune step's own C++ GEMM templates
        multiply bf16 faster than widening does (76-86 tok/s against 69), so it leaves this off. bf16_too:
        also where bf16 is native, for the CPUs whose aten bf16 attention products are slower than fp32 ones
        there too (tierlm.cpu: `compiled_wide_attention`, every AVX512 CPU)."""
        for module in self.modules():
            if hasattr(module, "widen_compiled"):
                module.widen_compiled = on and (module.widen or bf16_too)

    def attention_regions(self, on: bool) -> None:
        """Whether a compiled whole step runs each layer's decode attention through one nested compile region
        (`layers.decode_attention_region`), compiled once for every layer that fits it."""
        for module in self.modules():
            if hasattr(module, "region"):
                module.region = on

    def attention_kernels(self, on: bool) -> None:
        """Whether decode steps attend through tierlm's CPU kernel (`layers.attention_kernel`), and eager bf16
        RMSNorms run on its norm kernel (`layers.RMSNorm`); set by `load()` for a model whose forward runs on
        the CPU."""
        for module in self.modules():
            if hasattr(module, "kernel") and (hasattr(module, "region") or isinstance(module, RMSNorm)):
                module.kernel = on

    def attends_through_kernel(self) -> bool:
        """Whether the layers' decode steps attend through tierlm's CPU kernel (`attention_kernels`), and its
        shapes and dtype fit it (`layers.rope_attention`: fp32 or bf16, up to 8 query heads per K/V head, a
        head size a multiple of 8 up to 512): where they do not, every layer falls back to the unfused ops."""
        cfg = self.config
        fits = (
            kernel_heads(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.compute_dtype)
            and cfg.head_dim <= 512
        )
        return fits and any(getattr(m, "kernel", False) for m in self.modules() if hasattr(m, "region"))

    def ensure_rope(self, length: int, device: torch.device | str) -> None:
        """Make the rotary tables cover positions < length (called outside any compiled region)."""
        device = torch.device(device)
        dtype = self.compute_dtype
        cos = self.rope_cos
        if cos is not None and cos.shape[0] >= length and cos.device == device and cos.dtype == dtype:
            return
        size = -(-max(length, 1) // ROPE_CHUNK) * ROPE_CHUNK
        cfg = self.config
        cos, sin = rope_tables(cfg, size, device)  # computed in fp32, stored in the model dtype
        tables = {"rope_cos": cos.to(dtype), "rope_sin": sin.to(dtype)}
        if any(self.sliding) and cfg.family.layer_kinds:  # Gemma 3: sliding layers have their own base
            cos, sin = rope_tables(cfg, size, device, cfg.rope_local_theta, RopeScaling())
            tables.update(local_cos=cos.to(dtype), local_sin=sin.to(dtype))
        elif any(self.sliding):  # Mistral, Qwen: one rotary table for every layer
            tables.update(local_cos=tables["rope_cos"], local_sin=tables["rope_sin"])
        for name, table in tables.items():  # all or none (an allocation may fail for a huge length)
            setattr(self, name, table)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache=None,
        slots: torch.Tensor | None = None,
        last_only: bool = False,
        layer_fn=None,
        length: int | None = None,
        programs=None,
    ) -> torch.Tensor:
        """Logits for input_ids [b, s].

        attention_mask [b, s] marks real tokens (0 = left padding). With a cache, `slots` [s] are the
        cache positions written by this call and `positions` [b, s] the rotary positions. layer_fn, with a
        static cache, runs each layer as layer_fn(layer, x, cos, sin, mask, cache.views[i], slots).
        length: the cache slots attention reads, the first `length` (None: the whole cache); a Python int,
        so a compiled step that passes its cache's full length keeps fixed shapes. programs: the layers'
        eager decode programs over `cache` (tierlm.models.programs), run for a step of one position of as
        many rows as they were made for.
        """
        b, s = input_ids.shape
        device = input_ids.device
        cfg = self.config
        if attention_mask is None:
            attention_mask = torch.ones(b, s, dtype=torch.bool, device=device)
        attention_mask = attention_mask.to(torch.bool)
        if positions is None:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if slots is None:
            slots = torch.arange(s, device=device)
        if cache is not None:
            key_valid = cache.mark_valid(slots, attention_mask, length)
        else:
            self.ensure_rope(s, device)  # without a cache, the caller has not sized the tables
            key_valid = attention_mask
        masks, ropes = self._masks_and_ropes(key_valid, attention_mask, positions, slots, cache)
        x = self.model.embed_tokens(input_ids)
        if cfg.family.embed_scale:
            x = x * self.embed_scales[x.dtype]
        if programs is not None and (programs.cache is not cache or layer_fn is not None):
            raise ValueError("layer programs run over the cache they were made for, without a layer_fn")
        by_layer = programs.by_layer if programs is not None and s == 1 and b == programs.rows else None
        for i, layer in enumerate(self.model.layers):
            kind = 1 if self.sliding[i] else 0  # an int: dynamo (torch 2.11) rejects a bool index
            r, m = ropes[kind], masks[kind]
            if by_layer is not None and by_layer[i] is not None:
                x = by_layer[i](x, r, m, slots)
            elif layer_fn is None:
                x = layer(x, r, m, cache, slots, length)
            else:  # one compiled layer body for every layer; each gets its own view of the cache
                x = layer_fn(layer, x, r[0], r[1], m, cache.views[i], slots)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.model.norm(x))
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _masks_and_ropes(self, key_valid, attention_mask, positions, slots, cache):
        """(masks, rotary tables), each a pair indexed by "is this layer sliding" (0: full attention)."""
        mask = attention_mask_4d(key_valid, slots)
        rope = (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))
        if not any(self.sliding):
            return (mask, mask), (rope, rope)
        window = self.config.sliding_window
        by_mask = getattr(cache, "sliding_mask", None)  # sliding layers as long as the full ones
        local = by_mask(key_valid, slots, window) if by_mask is not None else None
        if local is None:
            if cache is not None:  # the keys a sliding layer sees in its ring: their columns and validity
                key_cols, window_valid = cache.sliding_keys(slots, attention_mask)
            else:
                key_cols, window_valid = slots, attention_mask
            local = attention_mask_4d(window_valid, slots, key_cols, window)
        local_rope = (self.local_cos[positions].unsqueeze(1), self.local_sin[positions].unsqueeze(1))
        return (mask, local), (rope, local_rope)


def run_layer(layer: nn.Module, x, cos, sin, mask, cache_view, slots) -> torch.Tensor:
    """One decoder layer as a plain function of its inputs, so a single compiled body serves all layers."""
    return layer(x, (cos, sin), mask, cache_view, slots)


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to `dtype`, as HF Gemma scales embeddings (55.4256 -> 55.5 in bf16)."""
    return float(torch.tensor(hidden_size**0.5, device="cpu").to(dtype))  # also under a meta device
