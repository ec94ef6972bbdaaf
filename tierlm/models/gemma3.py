"""Gemma 3's decoder layer: the code its family traits (config.Family) select.

What is data lives in the family table and ModelConfig (activation, embedding scale, query_pre_attn_scalar,
softcapping, per-layer kinds and rotary bases). What is code is here and in layers.GemmaRMSNorm: four
(1 + weight) norms per layer, a normalized output of attention and of the MLP before each residual add.
HF module names, so Gemma3ForCausalLM safetensors and device maps apply as they are.
"""

from __future__ import annotations

from torch import nn

from tierlm.config import ModelConfig
from tierlm.models.layers import MLP, Attention, GemmaRMSNorm


class Gemma3DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ffn_norm(mlp(pre_ffn_norm(x)))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, rope, mask, cache=None, slots=None, length=None):
        attn = self.self_attn(self.input_layernorm(x), rope, mask, cache, slots, length)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
