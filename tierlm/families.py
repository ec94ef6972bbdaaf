"""The supported decoder families: what differs between them, as data keyed by HF architecture names.
No torch here, and nothing from tierlm."""

from __future__ import annotations

from dataclasses import dataclass

from tierlm.errors import ModelFileError


@dataclass(frozen=True)
class Family:
    """Structural traits of one decoder family."""

    name: str
    qkv_bias: bool | None  # None: follow config.json's `attention_bias`
    o_bias: bool | None  # None: follow config.json's `attention_bias`
    qk_norm: bool  # RMSNorm over head_dim on q and k before rotary (Qwen3)
    gguf_permuted_qk: bool  # llama.cpp's converter permuted q/k rows for this family
    # Gemma 3 traits (models/gemma3.py holds the code they select):
    gemma_norms: bool = False  # RMSNorm scales by (1 + weight) in fp32; four norms per layer
    activation: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (GeGLU)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) (rounded to the weights' dtype)
    layer_kinds: bool = False  # per-layer sliding/full attention (`layer_types`), two rotary bases


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", None, None, qk_norm=False, gguf_permuted_qk=True),
    "MistralForCausalLM": Family("mistral", False, False, qk_norm=False, gguf_permuted_qk=True),
    "Qwen2ForCausalLM": Family("qwen2", True, False, qk_norm=False, gguf_permuted_qk=False),
    "Qwen3ForCausalLM": Family("qwen3", None, None, qk_norm=True, gguf_permuted_qk=False),
    "Gemma3ForCausalLM": Family(
        "gemma3",
        None,
        None,
        qk_norm=True,
        gguf_permuted_qk=False,
        gemma_norms=True,
        activation="gelu_tanh",
        embed_scale=True,
        layer_kinds=True,
    ),
}

# HF `model_type` (config.json) and GGUF `general.architecture` -> HF architecture name.
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # GGUF general.architecture
}

SLIDING, FULL = "sliding_attention", "full_attention"  # HF `layer_types` values
GGUF_SLIDING_PATTERN = 6  # Gemma 3 GGUFs list no layer types: every sixth layer is global (llama.cpp, HF)


def family_for(architecture: str) -> Family:
    """The Family of an HF architecture name, or a clear error listing the supported ones."""
    try:
        return FAMILIES[architecture]
    except KeyError:
        supported = ", ".join(FAMILIES)
        raise ModelFileError(f"unsupported architecture {architecture!r}; supported: {supported}") from None
