"""`tierlm generate | chat | plan | bench | serve | compile | cache`: argument parsing and printing only."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """Bad flags are one line on stderr and exit code 2, not a usage dump."""

    def error(self, message: str):
        self.exit(2, f"tierlm: error: {message} (see {self.prog} --help)\n")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu", help="execution device when no device map is given")
    p.add_argument("--device-map", help='JSON map such as {"model.layers.1": "disk", "": "cpu"}, or auto')
    p.add_argument(
        "--max-memory",
        help="budgets such as cpu=2GiB,0=20GiB for the device map; implies --device-map auto when none is given",
    )
    p.add_argument("--offload-folder", help="folder for disk-offloaded weights that need conversion")
    p.add_argument("--quantize", choices=("int8", "int4"), help="weight-only quantization of the projections")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--min-new-tokens", type=int, default=0)
    p.add_argument("--do-sample", action="store_true", help="sample (implied by --temperature > 0)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--cache", choices=("static", "dynamic"), default="static")
    p.add_argument("--compile", action="store_true", help="compile the decode step (CompileConfig())")
    p.add_argument(
        "--compile-scope",
        choices=("model", "layer"),
        help="compile the decode step with this scope: model (fastest, ~2 min cold) or layer (~15 s)",
    )
    p.add_argument("--no-compile", action="store_true", help="never compile (disable_compile=True)")
    add_compile_mode_arg(p)


def add_compile_mode_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        help="inductor mode (default: max-autotune-no-cudagraphs for the whole step on a CPU, the fastest; "
        "'default' builds several times faster and runs slower)",
    )


COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="tierlm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    gen = sub.add_parser("generate", help="generate text for a prompt (argument or stdin)")
    gen.add_argument("prompt", nargs="?", help="the prompt; read from stdin when absent")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", help="system prompt (implies --chat)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text and stats")
    gen.add_argument("--explain", action="store_true", help="print the compile decision and its reasons")

    chat = sub.add_parser("chat", help="interactive multi-turn chat (exit with /exit or EOF)")
    add_model_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", help="system prompt")

    plan = sub.add_parser("plan", help="show placement and the compile decision without loading weights")
    add_model_args(plan)
    plan.add_argument("--cache", choices=("static", "dynamic"), default="static")
    plan.add_argument("--compile", action="store_true")

    bench = sub.add_parser("bench", help="run benchmarks/decode.py (tierlm vs transformers vs llama.cpp)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for benchmarks/decode.py")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--compile", action="store_true")
    serve.add_argument("--compile-scope", choices=("model", "layer"))
    add_compile_mode_arg(serve)
    serve.add_argument("--max-batch-size", type=int, default=8)
    serve.add_argument(
        "--batching",
        choices=("continuous", "static"),
        default="continuous",
        help="continuous: requests join and leave the running batch at every step (default); static: a "
        "request waits for a running batch to end",
    )
    serve.add_argument("--api-key")
    serve.add_argument(
        "--replicas", type=int, help="serve through Ray Serve with N model replicas (needs tierlm[ray])"
    )
    serve.add_argument("--ray-address", help="join this Ray cluster (default: start a local Ray instance)")
    serve.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica (default: 1)")
    serve.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica (default: 0)")

    comp = sub.add_parser(
        "compile", help="build the compiled decode steps ahead of time (AOTInductor packages)"
    )
    add_model_args(comp)
    comp.add_argument(
        "--batch-sizes", default="1", help="comma-separated batch sizes to build, e.g. 1,2,4,8 (default: 1)"
    )
    comp.add_argument(
        "--cache-len",
        type=int,
        default=512,
        help="static cache length; generate rounds prompt + max new tokens up to 256, 512, 1024, ... "
        "(default: 512, what a prompt under 256 tokens with --max-new-tokens 256 uses)",
    )
    add_compile_mode_arg(comp)
    comp.add_argument(
        "--serve",
        action="store_true",
        help="build what `tierlm serve --compile` loads as it starts, for the same --max-batch-size and "
        "--batching (instead of --batch-sizes and --cache-len)",
    )
    comp.add_argument("--max-batch-size", type=int, default=8, help="with --serve: serve's (default: 8)")
    comp.add_argument("--batching", choices=("continuous", "static"), default="continuous")

    cache = sub.add_parser("cache", help="list or clear tierlm's cache folder ($TIERLM_CACHE_DIR)")
    cache.add_argument(
        "action", choices=("list", "clear"), help="list: entries and sizes; clear: remove them"
    )
    cache.add_argument(
        "--stale",
        action="store_true",
        help="clear only what killed processes left behind (a live process's writes are never removed)",
    )
    return parser


def status(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def show_library_progress() -> None:
    """The library's progress messages (e.g. compiling) as `tierlm: ...` lines on stderr."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("tierlm: %(message)s"))
    logger = logging.getLogger("tierlm")
    if any(getattr(h, "tierlm_cli", False) for h in logger.handlers):
        return
    handler.tierlm_cli = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


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
    dm = getattr(args, "device_map", None) or ("auto" if getattr(args, "max_memory", None) else None)
    if dm:
        kwargs["device_map"] = (
            dm if dm in ("auto", "balanced", "sequential") else _json_arg(dm, "--device-map")
        )
    if getattr(args, "max_memory", None):
        from tierlm.placement.device_map import parse_max_memory_arg

        kwargs["max_memory"] = parse_max_memory_arg(args.max_memory)
    if getattr(args, "offload_folder", None):
        kwargs["offload_folder"] = args.offload_folder
    if getattr(args, "quantize", None):
        kwargs["quantize"] = args.quantize
    return kwargs


def _json_arg(text: str, flag: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None


def generation_config(args):
    from tierlm.generation.config import GenerationConfig

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
        cache_implementation=args.cache,
        compile_config=compile_config(args),
        disable_compile=args.no_compile,
    )


def cmd_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("empty prompt: give one as an argument or on stdin")
    config = generation_config(args)
    model = load_model(args)
    use_packages(model, config)
    if args.chat or args.system:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # the template writes its own special tokens (Gemma's <bos>): as the server does, add none
        prompt = model.tokenizer.encode(text, add_special_tokens=False)
    gen = model.start([prompt], config)
    if args.explain:
        from tierlm import cpu

        status(f"tierlm: cpu: {cpu.detect().describe()}")
        status(f"tierlm: {gen.decision.explain()}")
        if hasattr(gen.step, "explain"):  # a step loaded from a package says which one
            status(f"tierlm: {gen.step.explain()}")
    for _row, delta, _finished, _reason in gen.stream():
        if not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    result = gen.result()
    if args.json:
        print(json.dumps(result_json(result)))
    else:
        sys.stdout.write("\n")
        s = result.stats
        status(
            f"tierlm: {s.new_tokens} tokens, prefill {s.prefill_seconds:.2f} s, {s.decode_tokens_per_s:.1f} tok/s"
        )
    return 0


def result_json(result) -> dict:
    s = result.stats
    return {
        "text": result.texts[0],
        "token_ids": result.token_ids[0],
        "finish_reason": result.finish_reasons[0],
        "stats": {
            "prompt_tokens": s.prompt_tokens,
            "new_tokens": s.new_tokens,
            "prefill_seconds": s.prefill_seconds,
            "decode_tokens_per_s": s.decode_tokens_per_s,
            "cache": s.cache,
            "compiled": s.compile.compile,
            "compile_reasons": list(s.compile.reasons),
        },
    }


def cmd_chat(args) -> int:
    config = generation_config(args)
    model = load_model(args)
    use_packages(model, config)
    history = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        text = model.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        prompt = model.tokenizer.encode(text, add_special_tokens=False)  # the template wrote them
        reply = []
        for _row, delta, _f, _r in model.start([prompt], config).stream():
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_plan(args) -> int:
    from tierlm.plan import describe_plan

    kwargs = placement_kwargs(args)
    kwargs.pop("offload_folder", None)
    plan = describe_plan(
        args.model, dtype=args.dtype, cache=args.cache, compile=args.compile, device=args.device, **kwargs
    )
    print(plan)
    return 0


def cmd_bench(args) -> int:
    import runpy

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "decode.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: tierlm bench runs from a source checkout")
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def cmd_serve(args) -> int:
    from tierlm.generation.config import GenerationConfig
    from tierlm.server import run_server

    if args.replicas is not None or args.ray_address:
        return serve_replicas(args)
    model = load_model(args)
    if (cc := compile_config(args)) is not None and served_statically(model, args.batching):
        prepare_served_packages(model, cc, args.max_batch_size)
    elif cc is not None:  # the continuous worker loads or builds its packaged steps as it starts
        model.use_compiled_packages()
    run_server(
        model,
        args.host,
        args.port,
        max_batch_size=args.max_batch_size,
        api_key=args.api_key,
        generation_config=GenerationConfig(compile_config=cc) if (cc := compile_config(args)) else None,
        batching=args.batching,
    )
    return 0


SERVED_MAX_TOKENS = 1024  # what a chat request that names no max_tokens gets (build_app's default)


def served_statically(model, batching: str) -> bool:
    """Whether the server's static worker serves `model`: asked for, or a sliding-window model (build_app
    serves those statically: rows of one ring cache at different positions cannot share it)."""
    return batching == "static" or any(model.decoder.sliding)


def prepare_served_packages(model, cc, max_batch_size: int) -> None:
    """serve --compile: find or build the whole-step package of each batch the server compiles (1, 2, 4, ...
    up to max_batch_size; it rounds batches up to a power of two) at the cache length of a chat request
    with the default max tokens, before the server reports healthy. Other lengths build on first use."""
    from tierlm.cache import bucket_length

    model.use_compiled_packages()
    if not model.packages.applies(cc):
        return
    batches = [1 << i for i in range((max_batch_size - 1).bit_length() + 1)]
    length = bucket_length(SERVED_MAX_TOKENS + 1, model.config.max_position_embeddings)
    status(f"tierlm: compiled steps for batches {', '.join(map(str, batches))} at cache length {length}:")
    model.packages.prepare(batches, length, cc, report=lambda line: status(f"tierlm: {line}"))


def serve_replicas(args) -> int:
    """`serve --replicas N`: the same server as N Ray Serve replicas, each loading the model itself."""
    from tierlm.generation.config import GenerationConfig
    from tierlm.server import ray_app

    ray_app.import_ray()  # a missing extra is the first thing to say
    if args.model and not Path(args.model).exists():
        raise FileNotFoundError(f"model not found: {args.model}")
    cc = compile_config(args)
    spec = ray_app.ReplicaSpec(
        load_kwargs={
            "path": args.model,
            "dtype": args.dtype,
            "device": args.device,
            **placement_kwargs(args),
        },
        app_kwargs={
            "max_batch_size": args.max_batch_size,
            "api_key": args.api_key,
            "generation_config": GenerationConfig(compile_config=cc) if cc else None,
            "batching": args.batching,
        },
        cpus=args.replica_cpus,
        gpus=args.replica_gpus,
    )
    replicas = 1 if args.replicas is None else args.replicas
    status(f"tierlm: starting {replicas} replica(s) on {args.ray_address or 'a local Ray instance'} ...")
    ray_app.serve_replicas(replicas, spec, ray_address=args.ray_address, host=args.host, port=args.port)
    return 0


def cmd_compile(args) -> int:
    from tierlm.compile import CompileConfig

    batches = _batch_sizes(args.batch_sizes)
    if args.cache_len < 1:
        raise ValueError(f"--cache-len must be >= 1, got {args.cache_len}")
    model = load_model(args)
    cc = CompileConfig(mode=args.compile_mode)
    model.use_compiled_packages()
    if not model.packages.applies(cc):
        raise ValueError(
            f"tierlm compile builds the whole step of a model resident on the CPU; this one runs on "
            f"{model.device}{' with offloaded weights' if model.streamer is not None else ''}"
        )
    if args.cache_len > model.config.max_position_embeddings:
        raise ValueError(
            f"--cache-len {args.cache_len} exceeds the model's context of {model.config.max_position_embeddings}"
        )
    static = served_statically(model, args.batching)
    if args.serve and static:
        prepare_served_packages(model, cc, args.max_batch_size)
    elif args.serve:  # the continuous worker's steps, as it prepares them at start-up
        from tierlm.generation.config import GenerationConfig
        from tierlm.server.continuous import ContinuousScheduler

        config = GenerationConfig(compile_config=cc)
        scheduler = ContinuousScheduler(model, max_batch_size=args.max_batch_size, base_config=config)
        if not scheduler.prepare(print):
            raise ValueError("this model's continuous batches do not compile here: no package to build")
    else:
        model.packages.prepare(batches, args.cache_len, cc, report=print)
    return 0


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--batch-sizes must be comma-separated integers such as 1,2,4,8, got {text!r}"
        ) from None
    if any(b < 1 for b in sizes):
        raise ValueError(f"--batch-sizes must all be >= 1, got {text!r}")
    return list(dict.fromkeys(sizes))


def cmd_cache(args) -> int:
    from tierlm.cache_folder import cache_entries, clear_cache
    from tierlm.placement.device_map import format_bytes
    from tierlm.weights.gguf_cache import cache_root

    root = cache_root()
    if args.action == "list":
        print(cache_listing(root, cache_entries(root)))
        return 0

    def progress(entry) -> None:
        status(f"tierlm: removing {entry.path} ({format_bytes(entry.nbytes)})")

    removed, kept = clear_cache(root, stale_only=args.stale, progress=progress)
    busy = [e for e in kept if e.live_writer is not None]
    freed = format_bytes(sum(e.nbytes for e in removed))
    note = f"; kept {entries_text(len(busy))} still being written" if busy else ""
    status(f"tierlm: removed {entries_text(len(removed))} ({freed}) from {root}{note}")
    return 0


def entries_text(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def cache_listing(root: Path, entries) -> str:
    """The text of `tierlm cache list`: one line per entry, then the total."""
    from tierlm.placement.device_map import format_bytes

    lines = [f"cache folder: {root}" + ("" if root.is_dir() else " (does not exist)")]
    for e in entries:
        lines.append(f"  {format_bytes(e.nbytes):>10}  {e.path.relative_to(root)}  {e.about}")
    stale = [e for e in entries if e.stale]
    total = f"total: {format_bytes(sum(e.nbytes for e in entries))} in {entries_text(len(entries))}"
    if stale:
        total += f" ({len(stale)} left by killed processes: tierlm cache clear --stale removes them)"
    return "\n".join([*lines, total])


COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "plan": cmd_plan,
    "bench": cmd_bench,
    "serve": cmd_serve,
    "compile": cmd_compile,
    "cache": cmd_cache,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after it is benchmarks/decode.py's, verbatim
        args = argparse.Namespace(command="bench", args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    show_library_progress()
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"tierlm: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntierlm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # python -m tierlm.cli
    sys.exit(main())
