"""ModelConfig: the shape of a decoder, from an HF config.json or GGUF metadata. No torch here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierlm.models.families import MODEL_TYPES, Family, family_for

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling: "default" (none), "linear" or "llama3"."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about a checkpoint's shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = None  # the checkpoint's own dtype name, e.g. "bfloat16"

    def __post_init__(self) -> None:
        family_for(self.architecture)  # raises on unsupported architectures
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def family(self) -> Family:
        return family_for(self.architecture)

    @property
    def qkv_bias(self) -> bool:
        fam = self.family
        return self.attention_bias if fam.qkv_bias is None else fam.qkv_bias

    @property
    def o_bias(self) -> bool:
        fam = self.family
        return self.attention_bias if fam.o_bias is None else fam.o_bias

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the contents of a Hugging Face config.json."""
        arch = _architecture(raw)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        theta, scaling = _rope(raw)
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_id_tuple(raw.get("eos_token_id")),
            pad_token_id=raw.get("pad_token_id"),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )

    @classmethod
    def from_hf_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(raw)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], n_vocab_tensor: int | None = None) -> ModelConfig:
        """Build from GGUF key/values (`general.architecture` = llama, mistral, qwen2, qwen3)."""
        arch_name = meta.get("general.architecture")
        if arch_name not in MODEL_TYPES:
            supported = ", ".join(MODEL_TYPES)
            raise ValueError(f"unsupported GGUF architecture {arch_name!r}; supported: {supported}")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch_name}.{key}", default)

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        vocab = get("vocab_size") or n_vocab_tensor or len(meta.get("tokenizer.ggml.tokens", ()))
        scaling = RopeScaling()
        if get("rope.scaling.type") == "linear":
            scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor", 1.0)))
        return cls(
            architecture=MODEL_TYPES[arch_name],
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv") or num_heads),
            head_dim=int(get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads),
            intermediate_size=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings=bool(meta.get("tierlm.tied_embeddings", False)),
            attention_bias=arch_name == "qwen2",
            max_position_embeddings=int(get("context_length", 2048)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_id_tuple(meta.get("tokenizer.ggml.eos_token_id")),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            torch_dtype=None,
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if archs:
        arch = archs[0]
    elif raw.get("model_type") in MODEL_TYPES:
        arch = MODEL_TYPES[raw["model_type"]]
    else:
        arch = str(raw.get("model_type"))
    family_for(arch)  # clear error for unsupported ones
    return arch


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Rope theta and scaling from either transformers v4 (rope_scaling) or v5 (rope_parameters) keys."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
