"""What differs between the supported decoder families, as data keyed by HF architecture names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """Structural traits of one decoder family."""

    name: str
    qkv_bias: bool | None  # None: follow config.json's `attention_bias`
    o_bias: bool | None  # None: follow config.json's `attention_bias`
    qk_norm: bool  # RMSNorm over head_dim on q and k before rotary (Qwen3)
    gguf_permuted_qk: bool  # llama.cpp's converter permuted q/k rows for this family


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", None, None, qk_norm=False, gguf_permuted_qk=True),
    "MistralForCausalLM": Family("mistral", False, False, qk_norm=False, gguf_permuted_qk=True),
    "Qwen2ForCausalLM": Family("qwen2", True, False, qk_norm=False, gguf_permuted_qk=False),
    "Qwen3ForCausalLM": Family("qwen3", None, None, qk_norm=True, gguf_permuted_qk=False),
}

# HF `model_type` (config.json) and GGUF `general.architecture` -> HF architecture name.
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def family_for(architecture: str) -> Family:
    """The Family of an HF architecture name, or a clear error listing the supported ones."""
    try:
        return FAMILIES[architecture]
    except KeyError:
        supported = ", ".join(FAMILIES)
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported}") from None
