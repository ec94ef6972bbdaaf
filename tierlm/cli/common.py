"""What several commands share: loading the model with a progress bar, and reading the placement, sampling
and compile flags into tierlm's configs."""

from __future__ import annotations

import json
import sys
import time


def status(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def show_library_progress() -> None:
    """The library's progress messages (e.g. compiling) as `tierlm: ...` lines on stderr."""
    import logging

    class CurrentStderr(logging.StreamHandler):
        """Writes to sys.stderr as it is when a line is logged, not as it was when the CLI started (a
        later redirect, or an in-process run's captured stream that is closed by then)."""

        @property
        def stream(self):
            return sys.stderr

        @stream.setter
        def stream(self, _value) -> None:
            pass

    handler = CurrentStderr()
    handler.setFormatter(logging.Formatter("tierlm: %(message)s"))
    logger = logging.getLogger("tierlm")
    if any(getattr(h, "tierlm_cli", False) for h in logger.handlers):
        return
    handler.tierlm_cli = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def show_warnings_as_lines() -> None:
    """Warnings as one `tierlm: warning: ...` line on stderr, not Python's file:line and source line."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        lines = str(message).strip().splitlines()
        print(f"tierlm: warning: {lines[0] if lines else category.__name__}", file=sys.stderr, flush=True)

    warnings.showwarning = show
    # inductor's max-autotune reads a storage the deprecated way; nothing a user of tierlm can change
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")


def load_model(args):
    import tierlm

    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(desc="loading weights", unit="tensor", file=sys.stderr, leave=False)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    status(f"tierlm: loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...")
    start = time.perf_counter()
    model = tierlm.load(
        args.model, dtype=args.dtype, device=args.device, progress=progress, **placement_kwargs(args)
    )
    if bar is not None:
        bar.close()
    status(f"tierlm: loaded in {time.perf_counter() - start:.1f} s ({model.dtype}, {model.device})")
    return model


def placement_kwargs(args) -> dict:
    """Placement keywords for tierlm.load; --max-memory alone implies --device-map auto."""
    kwargs = {}
    for flag in ("device_map", "max_memory"):
        if getattr(args, flag, None) is not None and not getattr(args, flag).strip():
            raise ValueError(f"--{flag.replace('_', '-')} is empty")
    dm = getattr(args, "device_map", None) or ("auto" if getattr(args, "max_memory", None) else None)
    if dm:  # a strategy, one device for the whole model ("cpu", "0", "cuda:1"), or a JSON map
        kwargs["device_map"] = dm if not dm.lstrip().startswith("{") else _json_arg(dm, "--device-map")
    if getattr(args, "max_memory", None):
        from tierlm.placement.memory import parse_max_memory_arg

        kwargs["max_memory"] = parse_max_memory_arg(args.max_memory)
    if getattr(args, "offload_folder", None):
        kwargs["offload_folder"] = args.offload_folder
    if getattr(args, "quantize", None):
        kwargs["quantize"] = None if args.quantize == "none" else args.quantize
    return kwargs


def _json_arg(text: str, flag: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None


def generation_config(args):
    from tierlm.generation.config import GenerationConfig

    if args.no_compile and (args.compile or args.compile_scope or getattr(args, "compile_mode", None)):
        raise ValueError("--no-compile contradicts --compile, --compile-scope and --compile-mode: give one")
    sample = args.do_sample or (args.temperature is not None and args.temperature > 0)
    return GenerationConfig.from_overrides(
        None,
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.min_new_tokens,
        do_sample=sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        num_beams=getattr(args, "num_beams", None),
        length_penalty=getattr(args, "length_penalty", None),
        cache_implementation=args.cache,
        compile_config=compile_config(args),
        disable_compile=args.no_compile,
    )


def compile_config(args):
    """CompileConfig from --compile / --compile-scope, or None (do not compile)."""
    from tierlm.compile import CompileConfig

    mode = getattr(args, "compile_mode", None)
    if args.compile_scope:
        return CompileConfig(scope=args.compile_scope, mode=mode)
    return CompileConfig(mode=mode) if args.compile or mode else None


def use_packages(model, config) -> None:
    """Whole-model CPU steps come from the package store (`tierlm compile`), built there when missing."""
    if config is not None and config.compile_config is not None and not config.disable_compile:
        model.use_compiled_packages()
