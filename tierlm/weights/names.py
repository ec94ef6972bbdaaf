"""GGUF tensor names -> Hugging Face names, and the fix-ups llama.cpp's converter applied (data)."""

from __future__ import annotations

import re

import torch

GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Gemma 3's four norms per layer (llama.cpp names): "ffn_norm" is the pre-MLP norm there, not Llama's
# post-attention one.
GEMMA3_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
LAYER_NAMES_BY_ARCHITECTURE = {"gemma3": GEMMA3_LAYER_NAMES}

_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL = re.compile(r"^(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, architecture: str | None = None) -> str | None:
    """The HF parameter name of a GGUF tensor (of a file whose general.architecture is `architecture`), or
    None for tensors tierlm does not use (e.g. rope_freqs)."""
    if m := _LAYER.match(name):
        module = LAYER_NAMES_BY_ARCHITECTURE.get(architecture or "", GGUF_LAYER_NAMES).get(m.group(2))
        return None if module is None else f"model.layers.{m.group(1)}.{module}.{m.group(3)}"
    if m := _GLOBAL.match(name):
        module = GGUF_GLOBAL_NAMES.get(m.group(1))
        return None if module is None else f"{module}.{m.group(2)}"
    return None


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs back to HF's rotate-half)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)
