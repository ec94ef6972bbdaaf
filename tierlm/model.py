"""The public model object: a loaded decoder with its tokenizer, placement and generation entry points."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tierlm.config import ModelConfig
from tierlm.models.decoder import Decoder
from tierlm.weights import gguf_cache
from tierlm.weights.gguf import GGUFCheckpoint
from tierlm.weights.load import build_decoder, default_model_path, open_checkpoint, resolve_dtype


class Model:
    """A loaded model: `model(input_ids)` gives logits [batch, seq, vocab]; `model.config` its shape."""

    def __init__(self, decoder: Decoder, path: Path, tokenizer=None) -> None:
        self.decoder = decoder
        self.path = path
        self.tokenizer = tokenizer

    @property
    def config(self) -> ModelConfig:
        return self.decoder.config

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.decoder.model.embed_tokens.weight.device

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        return self.decoder(input_ids, attention_mask=attention_mask)


def load(
    path: str | Path | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> Model:
    """Load an HF safetensors folder or a GGUF file (default: the embedded SmolLM2-135M-Instruct)."""
    path = Path(path) if path is not None else default_model_path()
    device = torch.device(device)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        decoder = _load_gguf(path, dtype, device, progress)
    else:
        checkpoint = open_checkpoint(path)
        decoder = build_decoder(checkpoint, resolve_dtype(dtype, checkpoint, device), device, progress)
    return Model(decoder, path)


def _load_gguf(path: Path, dtype, device: torch.device, progress) -> Decoder:
    """GGUF weights come dequantized from the disk cache when present; the first load fills it."""
    target = torch.float32 if dtype == "auto" else resolve_dtype(dtype, None, device)
    cached = gguf_cache.open_cached(path, target)
    if cached is not None:
        return build_decoder(cached, target, device, progress)
    decoder = build_decoder(GGUFCheckpoint(path), target, device, progress)
    state = {
        n: p
        for n, p in decoder.named_parameters()
        if n != "lm_head.weight" or not decoder.config.tie_word_embeddings
    }
    gguf_cache.store(path, decoder.config, state)
    return decoder
