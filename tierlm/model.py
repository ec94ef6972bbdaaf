"""The public model object: a loaded decoder with its tokenizer, placement and generation entry points."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tierlm.cache import StaticCache
from tierlm.compile import CompileConfig, streamed_config
from tierlm.config import ModelConfig
from tierlm.generation.config import GenerationConfig
from tierlm.generation.run import Generation, GenerationResult
from tierlm.loading import execute
from tierlm.models.decoder import Decoder, run_layer
from tierlm.placement.offload import Streamer, canonical_strides
from tierlm.placement.placer import Placement
from tierlm.plan import LoadPlan, plan
from tierlm.weights import gguf_cache

log = logging.getLogger("tierlm")
MAX_STATIC_CACHES = 4  # static caches (and their compiled steps) kept for reuse across generate calls


class Model:
    """A loaded model: `model(input_ids)` gives logits [batch, seq, vocab]; `model.config` its shape."""

    def __init__(
        self,
        decoder: Decoder,
        path: Path,
        tokenizer=None,
        placement: Placement | None = None,
        streamer: Streamer | None = None,
        plan: LoadPlan | None = None,
    ) -> None:
        self.decoder = decoder
        self.plan = plan  # what load() planned and did (tierlm.plan.LoadPlan)
        self.path = path
        self.tokenizer = tokenizer
        self.placement = placement
        self.streamer = streamer
        self.device_map: dict[str, str] = placement.module_map if placement else {"": "cpu"}
        self._static_caches: dict[tuple, StaticCache] = {}
        self._compiled: dict[tuple, object] = {}
        self.packages = None  # tierlm.aot.Packages: whole steps built ahead of time (use_compiled_packages)

    @property
    def config(self) -> ModelConfig:
        return self.decoder.config

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.compute_dtype

    @property
    def device(self) -> torch.device:
        """The execution device (where activations and the KV cache live)."""
        return self.placement.device if self.placement else torch.device("cpu")

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
        cache = self._static_caches.pop(key, None)
        if cache is None:
            cache = StaticCache(self.config, batch, length, self.dtype, self.device)
            while len(self._static_caches) >= MAX_STATIC_CACHES:  # least recently used goes, with its graphs
                old_key = next(iter(self._static_caches))
                del self._static_caches[old_key]
                self._compiled = {k: v for k, v in self._compiled.items() if k[1:3] != old_key[:2]}
        self._static_caches[key] = cache  # most recently used last
        cache.reset()
        return cache

    def eager_step(self, cache):
        ones = torch.ones(cache.valid.shape[0], 1, dtype=torch.bool, device=self.device)
        bounded = hasattr(cache, "limit")  # a StaticCache, or continuous batching's SlotCache over one

        def step(tokens, positions, slots, length):
            if bounded:
                cache.limit = length  # read only the slots in use, not the whole cache
            return self.decoder(tokens, attention_mask=ones, positions=positions, cache=cache, slots=slots)[
                :, -1
            ].float()

        return step

    def use_compiled_packages(self, root: Path | None = None) -> None:
        """Build whole-model CPU steps ahead of time into a package store (default <cache>/aot) and load
        them from there in every later process, instead of compiling them in each one (tierlm.aot)."""
        from tierlm import aot

        self.packages = aot.Packages(self, root)

    def compiled_step(self, cache: StaticCache, compile_config: CompileConfig | None):
        """The compiled decode step for this cache shape, built once and reused by later calls."""
        cc = compile_config or CompileConfig()
        if self.streamer is not None:  # a whole step cannot take streamed weights: as decide() says
            cc = streamed_config(cc, str(self.device))
        # A step closes over its cache: a static cache's step and a continuous batch's (SlotCache) of one
        # shape read different tensors and must never be taken for each other.
        key = (cc, cache.batch, cache.max_len, self.dtype, type(cache).__name__)
        compiled = self._compiled.get(key)
        if compiled is None and self.packages is not None and self.packages.applies(cc, cache):
            self._compiled[key] = compiled = self.packages.step(cache, cc)  # loaded, or built once
        if compiled is None:
            # A persistent per-user inductor cache, so a second process starts warm.
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(gguf_cache.cache_root() / "inductor"))
            ones = torch.ones(cache.batch, 1, dtype=torch.bool, device=self.device)
            decoder = self.decoder
            kwargs = cc.compile_kwargs(str(self.device))
            layer_fn = torch.compile(run_layer, **kwargs) if cc.scope == "layer" else None
            if layer_fn is not None and self.streamer is not None and self.streamer.streams_layers():
                decoder.unfuse_projections()  # resident layers shaped like streamed ones: one body for all
                for layer in decoder.model.layers:
                    canonical_strides(layer)
                layer_fn = self.streamer.around_layers(layer_fn)  # fetch/release outside the compiled body

            def decode_step(tokens, positions, slots):
                logits = decoder(
                    tokens, ones, positions=positions, cache=cache, slots=slots, layer_fn=layer_fn
                )
                return logits[:, -1].float()

            if cc.scope == "model" and self.device.type == "cuda":
                _static_addresses(cache)
            compiled = decode_step if cc.scope == "layer" else torch.compile(decode_step, **kwargs)
            freezing = bool(kwargs.get("options", {}).get("freezing"))
            what = (
                f"the decode step (scope {cc.scope}, mode {cc.resolved_mode(str(self.device))}, "
                f"batch {cache.batch}, cache {cache.max_len})"
            )
            if cc.scope == "model" and self.device.type == "cpu":
                what += "; a cold whole-model compile takes minutes on a CPU"
            self._compiled[key] = compiled = _CompiledStep(
                compiled, cache, freezing, cc.scope == "model", what
            )
        return compiled  # keyed by (batch, length, dtype) like static caches, so its cache is `cache`


def _static_addresses(cache) -> None:
    """Tell dynamo that the cache's tensors keep their addresses: the step writes them in place, and
    CUDA graphs (reduce-overhead) are skipped for a graph that mutates inputs not known to be static."""
    for value in vars(cache).values():
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static_address(t)


class _CompiledStep:
    """Calls a compiled decode step.

    The first call traces and compiles. Dynamo reads inductor's `freezing` flag while tracing (to make
    the weights graph attributes that inductor folds and prepacks); options given to torch.compile only
    reach inductor, so the flag is set around that call, else nothing would be frozen. Later calls of a
    whole-model step skip dynamo's guard evaluation (~0.8 ms a step for ~300 weight guards): the step is
    built for one cache and one (batch, length), its inputs keep their shapes and dtypes, and inductor
    still asserts each input's size and stride.
    """

    def __init__(self, compiled, cache: StaticCache, freezing: bool, skip_guards: bool, what: str) -> None:
        self.compiled, self.cache = compiled, cache
        self.freezing, self.skip_guards, self.what = freezing, skip_guards, what
        self.traced = False

    def __call__(self, tokens, positions, slots, length):
        self.cache.limit = self.cache.max_len  # fixed shapes: the graph always reads the whole cache
        if self.traced and self.skip_guards:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self.compiled(tokens, positions, slots)
        inductor_config = torch._inductor.config if self.freezing else None
        old = inductor_config.freezing if inductor_config else None
        if inductor_config:
            inductor_config.freezing = True
        start = time.perf_counter()
        log.info("compiling %s ...", self.what)
        try:
            logits = self.compiled(tokens, positions, slots)
        finally:
            if inductor_config:
                inductor_config.freezing = old
        log.info("compiled in %.1f s", time.perf_counter() - start)
        self.traced = True
        return logits


def load(
    path: str | Path | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    device_map: dict | str | None = None,
    max_memory: dict | None = None,
    offload_folder: str | Path | None = None,
    execution_device: str | None = None,
    quantize: str | None = None,
    group_size: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Model:
    """Load an HF safetensors folder or a GGUF file (default: the embedded SmolLM2-135M-Instruct).

    device_map: {module name or prefix: device} with devices N / "cuda:N", "mps", "cpu", "disk", or
    "auto" / "balanced" / "sequential" computed from max_memory ({0: "20GiB", "cpu": "2GiB"}).
    execution_device: run the map's accelerator entries on this device instead (e.g. "cpu", to
    exercise cpu offload without an accelerator).
    quantize: "int8" (per channel) or "int4" (groups of `group_size`; default 32 when the GGUF source is
    Q4_0/Q4_1, whose blocks then carry over exactly, else 64) weight-only quantization of every
    projection and the LM head.

    The load is a LoadPlan (tierlm.plan, from the checkpoint's header) whose steps then run in order
    (tierlm.loading); the model keeps it as `.plan`.
    """
    load_plan = plan(
        path,
        dtype=dtype,
        device=device,
        device_map=device_map,
        max_memory=max_memory,
        offload_folder=offload_folder,
        execution_device=execution_device,
        quantize=quantize,
        group_size=group_size,
    )
    done = execute(load_plan, progress)
    return Model(done.decoder, load_plan.path, done.tokenizer, load_plan.placement, done.streamer, load_plan)
