"""The public model object: a loaded decoder with its tokenizer, placement and generation entry points."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from tierlm.cache import DynamicCache, StaticCache
from tierlm.compile import CompileConfig
from tierlm.config import ModelConfig
from tierlm.errors import RequestError
from tierlm.generation.config import GenerationConfig
from tierlm.generation.run import Generation, GenerationResult
from tierlm.loading import execute
from tierlm.models.decoder import Decoder
from tierlm.models.programs import decode_programs
from tierlm.placement.offload import Streamer
from tierlm.placement.placer import Placement
from tierlm.plan import LoadPlan, plan
from tierlm.steps import CompiledSteps

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
        # Generations share the reusable cache of their shape: taking it, and each unit of work on it, hold
        # this lock, and a generation whose cache another took since fails at its next unit (Generation)
        self.work_lock = threading.RLock()
        self._compiled = CompiledSteps()  # the compiled decode steps built for those caches
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
        config = GenerationConfig.from_overrides(generation_config, **overrides)
        if config.n > 1:
            raise RequestError("stream() yields one sequence's text; for n > 1 use stream_batch() or start()")
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and prompt.shape[0] != 1:
            raise RequestError("stream() takes one prompt; for a batch of token-id rows use stream_batch()")
        for _row, delta, _finished, _reason in self.stream_batch(
            prompt if isinstance(prompt, torch.Tensor) else [prompt], config
        ):
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
        config = GenerationConfig.from_overrides(config)  # a GenerationConfig or None, named if not
        with torch.inference_mode():
            return Generation(self, prompts, config, **rows)

    def static_cache(self, batch: int, length: int, rings: bool = True) -> StaticCache:
        """A static cache for (batch, length), reused across calls so compiled steps are reused too
        (`rings`: StaticCache's; False for rows at positions of their own)."""
        rings = rings and bool(self.config.sliding_layers)  # one cache whatever it says, where none is a ring
        key = (batch, length, self.dtype, rings)
        cache = self._static_caches.pop(key, None)
        if cache is None:
            cache = StaticCache(self.config, batch, length, self.dtype, self.device, rings)
            while len(self._static_caches) >= MAX_STATIC_CACHES:  # least recently used goes, with its graphs
                old_key = next(iter(self._static_caches))
                del self._static_caches[old_key]
                self._compiled.drop(*old_key[:2])
        self._static_caches[key] = cache  # most recently used last
        with torch.inference_mode(cache.valid.is_inference()):  # made by a run under inference mode
            cache.reset()
        return cache

    def eager_step(self, cache):
        """The decode step run eagerly: step(tokens, positions, slots, length) -> logits [batch, vocab],
        attending over the `length` slots in use, not the whole cache."""
        ones = torch.ones(cache.valid.shape[0], 1, dtype=torch.bool, device=self.device)
        grows = isinstance(cache, DynamicCache)  # no position bound known up front
        # a layer that streams its weights fetches them around its program, or runs as a module
        around = self.streamer.around_program if self.streamer is not None else None
        programs = decode_programs(self.decoder, cache, around)

        def step(tokens, positions, slots, length):
            rope = self.decoder.rope_cos
            if grows and (rope is None or cache.valid.shape[1] >= rope.shape[0]):  # positions <= the columns
                self.decoder.ensure_rope(cache.valid.shape[1] + 1, self.device)
            logits = self.decoder(
                tokens,
                attention_mask=ones,
                positions=positions,
                cache=cache,
                slots=slots,
                length=length,
                programs=programs,
            )
            return logits[:, -1].float()

        return step

    def use_compiled_packages(self, root: Path | None = None) -> None:
        """Build whole-model CPU steps ahead of time into a package store (default <cache>/aot) and load
        them from there in every later process, instead of compiling them in each one (tierlm.aot)."""
        from tierlm import aot

        self.packages = aot.Packages(self, root)

    def compiled_step(self, cache: StaticCache, compile_config: CompileConfig | None):
        """The compiled decode step for this cache shape, built once and reused by later calls (tierlm.steps)."""
        return self._compiled.step(self, cache, compile_config)


def load(
    path: str | Path | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    device_map: dict | str | None = None,
    max_memory: dict | None = None,
    offload_folder: str | Path | None = None,
    execution_device: str | None = None,
    quantize: str | None = "auto",
    group_size: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Model:
    """Load an HF safetensors folder or a GGUF file (default: the embedded SmolLM2-135M-Instruct).

    device_map: {module name or prefix: device} with devices N / "cuda:N", "mps", "cpu", "disk", or
    "auto" / "balanced" / "sequential" computed from max_memory ({0: "20GiB", "cpu": "2GiB"}).
    execution_device: run the map's accelerator entries on this device instead (e.g. "cpu", to
    exercise cpu offload without an accelerator).
    quantize: "int8" (per channel) or "int4" (groups of `group_size`; default 32 when the GGUF source is
    Q4_0/Q4_1, the files' block width, else 64) weight-only quantization of every
    projection and the LM head (int4 keeps the head int8); None: float weights; "auto" (the default):
    when `dtype` is "auto" and the forward runs on the CPU, "int4" for a GGUF whose projections are
    Q4_1 blocks and "int8" for one whose projections are other quantized blocks (Q4_0, K-quants, Q5_0,
    Q8_0 ...), each where this CPU decodes them faster (`tierlm.cpu`), else None. group_size is int4's:
    an error with "int8" or None.

    The load is a LoadPlan (tierlm.plan, from the checkpoint's header) whose steps then run in order
    (tierlm.loading); the model keeps it as `.plan`.
    """
    arguments = {k: v for k, v in locals().items() if k != "progress"}  # all but progress are the plan's
    load_plan = plan(**arguments)
    done = execute(load_plan, progress)
    return Model(done.decoder, load_plan.path, done.tokenizer, load_plan.placement, done.streamer, load_plan)
