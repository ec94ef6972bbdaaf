"""ModelConfig: the shape of a decoder, from an HF config.json or GGUF metadata, and the table of
supported families. No torch here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")


# --- families: what differs between the supported decoders, as data keyed by HF architecture names ---


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
    def from_hf_dict(cls, raw: Any, source: str = "config.json") -> ModelConfig:
        """Build from the contents of a Hugging Face config.json; errors name `source` and the field."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source} must hold a JSON object, got {type(raw).__name__}")
        try:
            return cls._from_hf(raw)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def _from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = _architecture(raw)
        hidden = positive_int(raw, "hidden_size")
        num_heads = positive_int(raw, "num_attention_heads")
        theta, scaling = _rope(raw)
        return cls(
            architecture=arch,
            vocab_size=positive_int(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=positive_int(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=positive_int(raw, "num_key_value_heads", num_heads),
            head_dim=positive_int(raw, "head_dim", hidden // num_heads),
            intermediate_size=positive_int(raw, "intermediate_size"),
            rms_norm_eps=positive_float(raw, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            max_position_embeddings=positive_int(raw, "max_position_embeddings", 2048),
            bos_token_id=token_id(raw, "bos_token_id"),
            eos_token_ids=token_ids(raw, "eos_token_id"),
            pad_token_id=token_id(raw, "pad_token_id"),
            torch_dtype=_dtype_name(raw),
        )

    @classmethod
    def from_hf_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        source = f"config.json at {path}"
        try:
            raw = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{source} is not valid JSON: {e}") from None
        return cls.from_hf_dict(raw, source)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], n_vocab_tensor: int | None = None) -> ModelConfig:
        """Build from GGUF key/values (`general.architecture` = llama, mistral, qwen2, qwen3)."""
        arch_name = meta.get("general.architecture")
        if arch_name not in MODEL_TYPES:
            supported = ", ".join(MODEL_TYPES)
            raise ValueError(f"unsupported GGUF architecture {arch_name!r}; supported: {supported}")
        keys = {k.removeprefix(f"{arch_name}."): v for k, v in meta.items() if k.startswith(f"{arch_name}.")}
        prefix = f"{arch_name}."

        def count(key: str, default: int = _REQUIRED) -> int:
            return positive_int(keys, key, default, prefix)

        hidden = count("embedding_length")
        num_heads = count("attention.head_count")
        vocab = keys.get("vocab_size") or n_vocab_tensor or len(meta.get("tokenizer.ggml.tokens", ()))
        scaling = RopeScaling()
        if keys.get("rope.scaling.type") == "linear":
            scaling = RopeScaling("linear", factor=positive_float(keys, "rope.scaling.factor", 1.0, prefix))
        return cls(
            architecture=MODEL_TYPES[arch_name],
            vocab_size=positive_int({"vocab_size": vocab}, "vocab_size", prefix=prefix),
            hidden_size=hidden,
            num_layers=count("block_count"),
            num_heads=num_heads,
            num_kv_heads=count("attention.head_count_kv", num_heads),
            head_dim=count("attention.key_length", count("rope.dimension_count", hidden // num_heads)),
            intermediate_size=count("feed_forward_length"),
            rms_norm_eps=positive_float(keys, "attention.layer_norm_rms_epsilon", 1e-6, prefix),
            rope_theta=positive_float(keys, "rope.freq_base", 10000.0, prefix),
            rope_scaling=scaling,
            tie_word_embeddings=bool(meta.get("tierlm.tied_embeddings", False)),
            attention_bias=arch_name == "qwen2",
            max_position_embeddings=count("context_length", 2048),
            bos_token_id=token_id(meta, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=token_ids(meta, "tokenizer.ggml.eos_token_id"),
            pad_token_id=token_id(meta, "tokenizer.ggml.padding_token_id"),
            torch_dtype=None,
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f'field "architectures" must be a list of names, got {_shown(archs)}')
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
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(raw.get(key) or {}, dict):
            raise ValueError(f'field "{key}" must be an object, got {_shown(raw[key])}')
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    theta = positive_float(params, "rope_theta", positive_float(raw, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=positive_float(params, "factor", 1.0, "rope_scaling."),
        low_freq_factor=positive_float(params, "low_freq_factor", 1.0, "rope_scaling."),
        high_freq_factor=positive_float(params, "high_freq_factor", 4.0, "rope_scaling."),
        original_max_position_embeddings=positive_int(
            params, "original_max_position_embeddings", 8192, "rope_scaling."
        ),
    )


_REQUIRED: Any = object()


def positive_int(raw: dict[str, Any], key: str, default: int = _REQUIRED, prefix: str = "") -> int:
    """raw[key] as a positive integer (an integral float too); `default` when absent or null, else required."""
    value = raw.get(key)
    if value is None and default is not _REQUIRED:
        return default
    if key not in raw:
        raise ValueError(f'missing required field "{prefix}{key}"')
    integral = isinstance(value, float) and value.is_integer()
    if not (_is_int(value) or integral) or value <= 0:
        raise ValueError(f'field "{prefix}{key}" must be a positive integer, got {_shown(value)}')
    return int(value)


def positive_float(raw: dict[str, Any], key: str, default: float, prefix: str = "") -> float:
    """raw[key] as a positive finite number; `default` when absent or null."""
    value = raw.get(key)
    if value is None:
        return default
    if not (_is_int(value) or isinstance(value, float)) or not 0 < value < float("inf"):
        raise ValueError(f'field "{prefix}{key}" must be a positive number, got {_shown(value)}')
    return float(value)


def token_id(raw: dict[str, Any], key: str) -> int | None:
    """A token id field; None when absent, null or negative (some configs write -1 for "none")."""
    value = raw.get(key)
    if value is not None and not _is_int(value):
        raise ValueError(f'field "{key}" must be a token id (an integer) or null, got {_shown(value)}')
    return value if value is not None and value >= 0 else None


def token_ids(raw: dict[str, Any], key: str) -> tuple[int, ...]:
    """A field holding one token id or a list of them; () when absent or null; negative ids are dropped."""
    value = raw.get(key)
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(_is_int(v) for v in values):
        raise ValueError(f'field "{key}" must be a token id or a list of token ids, got {_shown(value)}')
    return tuple(v for v in values if v >= 0)


def _dtype_name(raw: dict[str, Any]) -> str | None:
    """The checkpoint's own dtype: `dtype` (transformers v5) or `torch_dtype` (v4), e.g. "bfloat16"."""
    key = "dtype" if raw.get("dtype") else "torch_dtype"
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f'field "{key}" must be a dtype name such as "bfloat16", got {_shown(value)}')
    return value or None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A field's value as JSON, cut short: "576x", null, [1, 2]."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
