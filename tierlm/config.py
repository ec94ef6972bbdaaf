"""ModelConfig: the shape of a decoder, from an HF config.json or GGUF metadata. No torch here.

The table of supported families is tierlm.families."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierlm.errors import ModelFileError
from tierlm.families import FULL, GGUF_SLIDING_PATTERN, MODEL_TYPES, SLIDING, Family, family_for


def cache_root() -> Path:
    """Where tierlm keeps derived files (GGUF conversions, compiled packages, built kernels):
    $TIERLM_CACHE_DIR, else ~/.cache/tierlm."""
    env = os.environ.get("TIERLM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tierlm"


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling: "default" (none), "linear", "llama3" or "yarn" (YaRN: frequencies blended between
    interpolated and original by a ramp over [beta_fast, beta_slow] rotations, cos and sin scaled by
    `attention_factor`); or "freq_factors", a GGUF's `rope_freqs` tensor (llama.cpp's converter writes
    llama3 scaling so): each inverse frequency divided by its factor."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: round the ramp's ends outwards to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by it

    def __post_init__(self) -> None:
        if self.rope_type not in (*ROPE_TYPES, "freq_factors"):
            raise ModelFileError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))  # JSON: a list
        if (self.rope_type == "freq_factors") != bool(self.freq_factors) or not all(
            0 < f < float("inf") for f in self.freq_factors
        ):
            raise ModelFileError(
                "rope frequency factors must be positive and finite, given with type freq_factors"
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
    # Per-layer attention (Gemma 3): () means every layer is full attention.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    rope_local_theta: float = 10000.0  # rotary base of the sliding layers (no scaling)
    query_pre_attn_scalar: float | None = None  # scores scale by its -1/2 power; None: head_dim's
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        family_for(self.architecture)  # raises on unsupported architectures
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ModelFileError(
                    f"layer_types lists {len(self.layer_types)} layers, the model has {self.num_layers}"
                )
            odd = sorted(set(self.layer_types) - {SLIDING, FULL})
            if odd:
                raise ModelFileError(f"unsupported layer type(s) {odd}; supported: {SLIDING}, {FULL}")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ModelFileError("layer_types has sliding layers but sliding_window is not set")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelFileError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelFileError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def family(self) -> Family:
        return family_for(self.architecture)

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends over a sliding window (Gemma 3's local layers, Mistral's and Qwen's window)."""
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sliding(i))

    def kv_slots(self, tokens: int) -> int:
        """K/V slots, summed over layers, that a cache of `tokens` tokens holds: a sliding layer keeps at
        most its window (a ring buffer), a full layer every token."""
        window = min(tokens, self.sliding_window or tokens)
        return sum(window if self.is_sliding(i) else tokens for i in range(self.num_layers))

    @property
    def attn_scale(self) -> float:
        """The factor on q.k scores: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
            raise ModelFileError(f"{source} must hold a JSON object, got {type(raw).__name__}")
        try:
            return cls._from_hf(raw)
        except ValueError as e:
            raise ModelFileError(f"{source}: {e}") from None

    @classmethod
    def _from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = _architecture(raw)
        hidden = positive_int(raw, "hidden_size")
        num_heads = positive_int(raw, "num_attention_heads")
        num_layers = positive_int(raw, "num_hidden_layers")
        kinds: dict[str, Any] = {}
        if family_for(arch).layer_kinds:
            theta, scaling, kinds = _layer_kinds(raw, num_layers)
        else:
            theta, scaling = _rope(raw)
            kinds = _window_kinds(raw, family_for(arch).name, num_layers)
        return cls(
            architecture=arch,
            vocab_size=positive_int(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
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
            **kinds,
        )

    @classmethod
    def from_hf_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        source = f"config.json at {path}"
        try:
            raw = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{source} is not valid JSON: {e}") from None
        return cls.from_hf_dict(raw, source)

    @classmethod
    def from_gguf_metadata(
        cls, meta: dict[str, Any], n_vocab_tensor: int | None = None, rope_freqs: list[float] | None = None
    ) -> ModelConfig:
        """Build from GGUF key/values (`general.architecture` = llama, mistral, qwen2, qwen3, gemma3) and the
        file's `rope_freqs` tensor, if it has one (one factor per rotary frequency, head_dim / 2)."""
        arch_name = meta.get("general.architecture")
        if arch_name not in MODEL_TYPES:
            supported = ", ".join(MODEL_TYPES)
            raise ModelFileError(f"unsupported GGUF architecture {arch_name!r}; supported: {supported}")
        prefix = f"{arch_name}."
        keys = {k.removeprefix(prefix): v for k, v in meta.items() if k.startswith(prefix)}

        def count(key: str, default: int = _REQUIRED) -> int:
            return positive_int(keys, key, default, prefix)

        hidden = count("embedding_length")
        num_heads = count("attention.head_count")
        vocab = keys.get("vocab_size") or n_vocab_tensor or len(meta.get("tokenizer.ggml.tokens", ()))
        head_dim = count("attention.key_length", hidden // num_heads)  # as llama.cpp reads it
        scaling = _gguf_rotary(keys, prefix, head_dim, rope_freqs)
        kinds = (
            _gguf_layer_kinds(keys, prefix, head_dim)
            if family_for(MODEL_TYPES[arch_name]).layer_kinds
            else {}
        )
        return cls(
            architecture=MODEL_TYPES[arch_name],
            vocab_size=positive_int({"vocab_size": vocab}, "vocab_size", prefix=prefix),
            hidden_size=hidden,
            num_layers=count("block_count"),
            num_heads=num_heads,
            num_kv_heads=count("attention.head_count_kv", num_heads),
            head_dim=head_dim,
            intermediate_size=count("feed_forward_length"),
            # required, as llama.cpp requires them (it refuses such a file: "key not found in model")
            rms_norm_eps=positive_float(keys, "attention.layer_norm_rms_epsilon", prefix=prefix),
            rope_theta=positive_float(keys, "rope.freq_base", 10000.0, prefix),
            rope_scaling=scaling,
            tie_word_embeddings=bool(meta.get("tierlm.tied_embeddings", False)),
            attention_bias=arch_name == "qwen2",
            max_position_embeddings=count("context_length"),
            bos_token_id=token_id(meta, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=token_ids(meta, "tokenizer.ggml.eos_token_id"),
            pad_token_id=token_id(meta, "tokenizer.ggml.padding_token_id"),
            torch_dtype=None,
            **kinds,
        )


def _gguf_rotary(
    keys: dict[str, Any], prefix: str, head_dim: int, rope_freqs: list[float] | None
) -> RopeScaling:
    """The rotary scaling of a GGUF's keys, or of its `rope_freqs` tensor (one factor per frequency), over
    whole heads: llama.cpp refuses partial rotary for these architectures too."""
    scaling = _gguf_rope_scaling(keys, prefix)
    rotated = positive_int(keys, "rope.dimension_count", head_dim, prefix)
    if rotated != head_dim:
        raise ModelFileError(
            f"{prefix}rope.dimension_count {rotated} rotates part of a {head_dim}-wide head "
            "(partial rotary), which these architectures do not have"
        )
    if rope_freqs is None:
        return scaling
    if len(rope_freqs) != head_dim // 2:
        raise ModelFileError(
            f"rope_freqs has {len(rope_freqs)} factors, head_dim {head_dim} needs {head_dim // 2}"
        )
    if scaling.rope_type != "default":
        raise ModelFileError(
            f"rope_freqs beside rope scaling {scaling.rope_type!r}: which applies is unclear"
        )
    return RopeScaling("freq_factors", freq_factors=tuple(rope_freqs))


def _gguf_rope_scaling(keys: dict[str, Any], prefix: str) -> RopeScaling:
    """Rotary scaling from GGUF keys, as llama.cpp reads them: none, linear, or YaRN (its attention scale
    `yarn_attn_factor` times the paper's, the ramp over [yarn_beta_fast, yarn_beta_slow] rotations)."""
    kind = keys.get("rope.scaling.type") or "none"
    if kind == "none":
        return RopeScaling()
    factor = positive_float(keys, "rope.scaling.factor", 1.0, prefix)
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind != "yarn":
        raise ModelFileError(f"unsupported rope scaling type {kind!r} in {prefix}rope.scaling.type")
    for key, neutral in (
        ("rope.scaling.yarn_log_multiplier", (0.0,)),  # DeepSeek's attention scale
        ("rope.scaling.yarn_ext_factor", (-1.0, 1.0)),  # -1: llama.cpp's "1 for yarn"
        ("rope.scaling.attn_factor", (1.0,)),
    ):
        if keys.get(key, neutral[0]) not in neutral:
            raise ModelFileError(f"unsupported {prefix}{key} {keys[key]!r}")
    return RopeScaling(
        "yarn",
        factor=factor,
        original_max_position_embeddings=positive_int(
            keys,
            "rope.scaling.original_context_length",
            positive_int(keys, "context_length", 2048, prefix),
            prefix,
        ),
        beta_fast=positive_float(keys, "rope.scaling.yarn_beta_fast", 32.0, prefix),
        beta_slow=positive_float(keys, "rope.scaling.yarn_beta_slow", 1.0, prefix),
        attention_factor=positive_float(keys, "rope.scaling.yarn_attn_factor", 1.0, prefix)
        * yarn_mscale(factor),
    )


def _gguf_layer_kinds(keys: dict[str, Any], prefix: str, head_dim: int) -> dict[str, Any]:
    """Gemma 3's per-layer fields from GGUF keys, as llama.cpp reads them: every sixth layer global, a local
    base of 10000, and scores scaled by head_dim ** -0.5 (query_pre_attn_scalar of every size but 27B)."""
    n = positive_int(keys, "block_count", prefix=prefix)
    return {
        "layer_types": tuple(SLIDING if (i + 1) % GGUF_SLIDING_PATTERN else FULL for i in range(n)),
        "sliding_window": positive_int(keys, "attention.sliding_window", prefix=prefix),
        "rope_local_theta": 10000.0,
        "query_pre_attn_scalar": float(head_dim),
        "attn_logit_softcapping": _optional_positive(keys, "attn_logit_softcapping"),
        "final_logit_softcapping": _optional_positive(keys, "final_logit_softcapping"),
    }


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelFileError(f'field "architectures" must be a list of names, got {_shown(archs)}')
    if archs:
        arch = archs[0]
    elif raw.get("model_type") in MODEL_TYPES:
        arch = MODEL_TYPES[raw["model_type"]]
    else:
        arch = str(raw.get("model_type"))
    family_for(arch)  # clear error for unsupported ones
    return arch


def _layer_kinds(raw: dict[str, Any], num_layers: int) -> tuple[float, RopeScaling, dict[str, Any]]:
    """Gemma 3: the global rope (theta, scaling), and the per-layer fields, from v5 (`rope_parameters`
    keyed by layer type) or v4 (`rope_theta`, `rope_local_base_freq`, `rope_scaling`) keys."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ModelFileError(f'field "rope_parameters" must be an object, got {_shown(params)}')
    if FULL in params or SLIDING in params:
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise ModelFileError(
                f'field "rope_parameters" must map layer types to objects, got {_shown(params)}'
            )
        if (local.get("rope_type") or "default") != "default":
            raise ModelFileError(f"unsupported rope type {local['rope_type']!r} for sliding layers")
        outer = {
            k: raw[k] for k in ("max_position_embeddings", "original_max_position_embeddings") if k in raw
        }
        theta, scaling = _rope({"rope_parameters": full, "rope_theta": 1_000_000.0, **outer})
        local_theta = positive_float(local, "rope_theta", 10000.0, "rope_parameters.sliding_attention.")
    else:
        theta, scaling = _rope({"rope_theta": 1_000_000.0, **raw})
        local_theta = positive_float(raw, "rope_local_base_freq", 10000.0)
    types = raw.get("layer_types")
    if types is None:
        pattern = positive_int(raw, "sliding_window_pattern", GGUF_SLIDING_PATTERN)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    _check_layer_types(types)
    window = raw.get("sliding_window")
    kinds = {
        "layer_types": tuple(types),
        "sliding_window": positive_int(raw, "sliding_window") if window is not None else None,
        "rope_local_theta": local_theta,
        "query_pre_attn_scalar": positive_float(raw, "query_pre_attn_scalar", 256.0),
        "attn_logit_softcapping": _optional_positive(raw, "attn_logit_softcapping"),
        "final_logit_softcapping": _optional_positive(raw, "final_logit_softcapping"),
    }
    if raw.get("use_bidirectional_attention"):
        raise ModelFileError("use_bidirectional_attention (an embedding model) is not supported")
    return theta, scaling, kinds


MISTRAL_WINDOW = QWEN_WINDOW = 4096  # transformers' MistralConfig / Qwen2Config default sliding_window
QWEN_MAX_WINDOW_LAYERS = 28  # Qwen2Config / Qwen3Config default: layers from this index on slide


def _window_kinds(raw: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """Sliding-window attention of Mistral, Qwen2 and Qwen3, as transformers reads their config.json:
    Mistral's window (4096 when the key is absent, none when null) covers every layer; Qwen's applies with
    `use_sliding_window` to the layers `layer_types` names sliding (when absent: those from index
    `max_window_layers` on). Sliding layers share the model's one rotary table. {} for full attention, and
    for a window at least the context: within it the window masks nothing, and full layers keep the fast
    paths (a fused decode attention, continuous batching, a shared prefill for n > 1)."""
    if family == "mistral":
        window = raw.get("sliding_window", MISTRAL_WINDOW)
    elif family in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
        window = raw.get("sliding_window", QWEN_WINDOW)
    else:
        return {}  # Llama has no window; Qwen without use_sliding_window attends over everything
    if window is None:
        return {}
    window = positive_int({"sliding_window": window}, "sliding_window")
    if window >= positive_int(raw, "max_position_embeddings", 2048):
        return {}  # every key of the context is inside it (Ministral's 32768 of 32768): full attention
    if family == "mistral":
        types: Any = [SLIDING] * num_layers
    else:
        types = raw.get("layer_types")
        if types is None:
            first = raw.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
            if not _is_int(first) or first < 0:
                raise ModelFileError(
                    f'field "max_window_layers" must be an integer >= 0, got {_shown(first)}'
                )
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
    _check_layer_types(types)
    if SLIDING not in types:
        return {}
    return {"layer_types": tuple(types), "sliding_window": window}


def _check_layer_types(types: Any) -> None:
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ModelFileError(f'field "layer_types" must be a list of names, got {_shown(types)}')


def _optional_positive(raw: dict[str, Any], key: str) -> float | None:
    return None if raw.get(key) is None else positive_float(raw, key, 1.0)


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Rope theta and scaling from either transformers v4 (rope_scaling) or v5 (rope_parameters) keys, with
    transformers' defaults (`original_max_position_embeddings`: the context, for llama3 and yarn)."""
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(raw.get(key) or {}, dict):
            raise ModelFileError(f'field "{key}" must be an object, got {_shown(raw[key])}')
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    theta = positive_float(params, "rope_theta", positive_float(raw, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type not in ROPE_TYPES:  # before reading fields another type may spell differently
        raise ModelFileError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    context = positive_int(raw, "max_position_embeddings", 2048)
    original = positive_int(params, "original_max_position_embeddings", context, "rope_scaling.")
    if raw.get("original_max_position_embeddings") is not None:  # a top-level one wins, as in transformers
        original = positive_int(raw, "original_max_position_embeddings")
    if rope_type != "yarn":
        return theta, RopeScaling(
            rope_type=rope_type,
            factor=positive_float(params, "factor", 1.0, "rope_scaling."),
            low_freq_factor=positive_float(params, "low_freq_factor", 1.0, "rope_scaling."),
            high_freq_factor=positive_float(params, "high_freq_factor", 4.0, "rope_scaling."),
            original_max_position_embeddings=original,
        )
    factor = positive_float(params, "factor", context / original, "rope_scaling.")
    attention = params.get("attention_factor")
    if attention is None:  # the YaRN paper's, as transformers infers it
        mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and all_dim:
            attention = yarn_mscale(factor, positive_float(params, "mscale", 1.0, "rope_scaling.")) / (
                yarn_mscale(factor, positive_float(params, "mscale_all_dim", 1.0, "rope_scaling."))
            )
        else:
            attention = yarn_mscale(factor)
    return theta, RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=positive_float(params, "beta_fast", 32.0, "rope_scaling.")
        if params.get("beta_fast")
        else 32.0,
        beta_slow=positive_float(params, "beta_slow", 1.0, "rope_scaling.")
        if params.get("beta_slow")
        else 1.0,
        truncate=bool(params.get("truncate", True)),
        attention_factor=positive_float(
            {"attention_factor": attention}, "attention_factor", 1.0, "rope_scaling."
        ),
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context stretched `factor` times: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


_REQUIRED: Any = object()


def positive_int(raw: dict[str, Any], key: str, default: int = _REQUIRED, prefix: str = "") -> int:
    """raw[key] as a positive integer (an integral float too); `default` when absent or null, else required."""
    value = raw.get(key)
    if value is None and default is not _REQUIRED:
        return default
    if key not in raw:
        raise ModelFileError(f'missing required field "{prefix}{key}"')
    integral = isinstance(value, float) and value.is_integer()
    if not (_is_int(value) or integral) or value <= 0:
        raise ModelFileError(f'field "{prefix}{key}" must be a positive integer, got {_shown(value)}')
    return int(value)


def positive_float(raw: dict[str, Any], key: str, default: float = _REQUIRED, prefix: str = "") -> float:
    """raw[key] as a positive finite number; `default` when absent or null, else required."""
    value = raw.get(key)
    if value is None and default is not _REQUIRED:
        return default
    if value is None:
        raise ModelFileError(f'missing required field "{prefix}{key}"')
    if not (_is_int(value) or isinstance(value, float)) or not 0 < value < float("inf"):
        raise ModelFileError(f'field "{prefix}{key}" must be a positive number, got {_shown(value)}')
    return float(value)


def token_id(raw: dict[str, Any], key: str) -> int | None:
    """A token id field; None when absent, null or negative (some configs write -1 for "none")."""
    value = raw.get(key)
    if value is not None and not _is_int(value):
        raise ModelFileError(f'field "{key}" must be a token id (an integer) or null, got {_shown(value)}')
    return value if value is not None and value >= 0 else None


def token_ids(raw: dict[str, Any], key: str) -> tuple[int, ...]:
    """A field holding one token id or a list of them; () when absent or null; negative ids are dropped."""
    value = raw.get(key)
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(_is_int(v) for v in values):
        raise ModelFileError(f'field "{key}" must be a token id or a list of token ids, got {_shown(value)}')
    return tuple(v for v in values if v >= 0)


def _dtype_name(raw: dict[str, Any]) -> str | None:
    """The checkpoint's own dtype: `dtype` (transformers v5) or `torch_dtype` (v4), e.g. "bfloat16"."""
    key = "dtype" if raw.get("dtype") else "torch_dtype"
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise ModelFileError(f'field "{key}" must be a dtype name such as "bfloat16", got {_shown(value)}')
    return value or None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A field's value as JSON, cut short: "576x", null, [1, 2]."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
