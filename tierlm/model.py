"""The public model object: a loaded decoder with its tokenizer, placement and generation entry points."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tierlm.cache import StaticCache
from tierlm.compile import CompileConfig
from tierlm.config import ModelConfig
from tierlm.generation.config import GenerationConfig
from tierlm.generation.run import Generation, GenerationResult
from tierlm.models.decoder import Decoder
from tierlm.tokenizer import Tokenizer
from tierlm.weights import gguf_cache
from tierlm.weights.gguf import GGUFCheckpoint
from tierlm.weights.load import build_decoder, default_model_path, open_checkpoint, resolve_dtype


class Model:
    """A loaded model: `model(input_ids)` gives logits [batch, seq, vocab]; `model.config` its shape."""

    def __init__(self, decoder: Decoder, path: Path, tokenizer=None) -> None:
        self.decoder = decoder
        self.path = path
        self.tokenizer = tokenizer
        self.device_map: dict[str, str] = {"": str(self.device)}
        self._static_caches: dict[tuple, StaticCache] = {}
        self._compiled: dict[tuple, object] = {}

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

    def uncompilable_reasons(self) -> tuple[str, ...]:
        """Reasons, beyond placement and cache, that the forward cannot be compiled (none yet)."""
        return ()

    @torch.inference_mode()
    def generate(
        self, prompts, generation_config: GenerationConfig | None = None, **overrides
    ) -> GenerationResult:
        """Generate for a string, a list of strings or a LongTensor of token ids (one row per prompt)."""
        config = GenerationConfig.from_overrides(generation_config, **overrides)
        gen = Generation(self, prompts, config)
        for _ in gen.events():
            pass
        return gen.result()

    def stream(self, prompt, generation_config: GenerationConfig | None = None, **overrides):
        """Yield text deltas for one prompt as tokens are generated."""
        for row, delta, _finished, _reason in self.stream_batch([prompt], generation_config, **overrides):
            assert row == 0
            if delta:
                yield delta

    def stream_batch(self, prompts, generation_config: GenerationConfig | None = None, **overrides):
        """Yield (row, text delta, finished, finish_reason) for a batch of prompts, step by step."""
        if isinstance(prompts, str):
            prompts = [prompts]
        yield from self.start(
            prompts, GenerationConfig.from_overrides(generation_config, **overrides)
        ).stream()

    def start(self, prompts, config: GenerationConfig, **rows) -> Generation:
        """A generation to drive step by step (`.stream()`, `.cancel(row)`, `.result()`); see Generation."""
        with torch.inference_mode():
            return Generation(self, prompts, config, **rows)

    def static_cache(self, batch: int, length: int) -> StaticCache:
        """A static cache for (batch, length), reused across calls so compiled steps are reused too."""
        key = (batch, length, self.dtype)
        cache = self._static_caches.get(key)
        if cache is None:
            cache = StaticCache(self.config, batch, length, self.dtype, self.device)
            self._static_caches[key] = cache
        cache.reset()
        return cache

    def eager_step(self, cache):
        ones = torch.ones(cache.valid.shape[0], 1, dtype=torch.bool, device=self.device)
        static = isinstance(cache, StaticCache)

        def step(tokens, positions, slots, length):
            if static:
                cache.limit = length  # read only the slots in use
            return self.decoder(tokens, attention_mask=ones, positions=positions, cache=cache, slots=slots)[
                :, -1
            ].float()

        return step

    def compiled_step(self, cache: StaticCache, compile_config: CompileConfig | None):
        """The compiled decode step for this cache shape, built once and reused by later calls."""
        cc = compile_config or CompileConfig()
        key = (cc, cache.batch, cache.max_len, self.dtype)
        compiled = self._compiled.get(key)
        if compiled is None:
            ones = torch.ones(cache.batch, 1, dtype=torch.bool, device=self.device)
            decoder = self.decoder

            def decode_step(tokens, positions, slots):
                return decoder(tokens, attention_mask=ones, positions=positions, cache=cache, slots=slots)[
                    :, -1
                ].float()

            compiled = torch.compile(
                decode_step,
                fullgraph=cc.fullgraph,
                dynamic=cc.dynamic,
                backend=cc.backend,
                mode=cc.resolved_mode(str(self.device)) if cc.backend == "inductor" else None,
                options=cc.options,
            )
            self._compiled[key] = compiled

        def step(tokens, positions, slots, length):
            cache.limit = cache.max_len  # fixed shapes: the graph always reads the whole cache
            return compiled(tokens, positions, slots)

        return step


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
        tokenizer = gguf_cache.open_cached_tokenizer(path)
        if tokenizer is None:
            tokenizer = Tokenizer.from_gguf(path)
            gguf_cache.store_tokenizer(path, tokenizer)
    else:
        checkpoint = open_checkpoint(path)
        decoder = build_decoder(checkpoint, resolve_dtype(dtype, checkpoint, device), device, progress)
        tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    return Model(decoder, path, tokenizer)


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
