"""`tierlm serve` (one process, or Ray Serve replicas) and `tierlm compile` (what serve --compile loads)."""

from __future__ import annotations

from pathlib import Path

from tierlm.cli.common import compile_config, load_model, placement_kwargs, status


def check_serve_args(args) -> None:
    """serve's (and compile --serve's) numbers and key, before anything loads: one error naming the flag."""
    if args.max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    port = getattr(args, "port", None)
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0-65535, got {port}")
    if getattr(args, "api_key", None) is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty (leave it out to serve without a key)")
    name = getattr(args, "served_model_name", None)
    if name is not None and not name.strip():
        raise ValueError("--served-model-name must not be empty")
    replicas = getattr(args, "replicas", None)
    if replicas is not None and replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    max_model_len = getattr(args, "max_model_len", None)
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {max_model_len}")


def check_bind(host: str, port: int) -> None:
    """Whether this process can listen on host:port, said before the model loads (uvicorn says it after,
    in several lines); the server binds again as it starts."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(address)
    except OSError as err:
        reason = err.strerror or str(err)
        raise OSError(f"cannot serve on {host}:{port}: {reason}") from None


def cmd_serve(args) -> int:
    from tierlm.generation.config import GenerationConfig
    from tierlm.server import run_server

    check_serve_args(args)
    if not args.ray_address:  # a cluster's proxy listens on its own head node
        check_bind(args.host, args.port)
    if args.replicas is not None or args.ray_address:
        return serve_replicas(args)
    model = load_model(args)  # on this thread, whose OpenMP team build_app frees: the worker decodes
    check_max_model_len(model, args.max_model_len)
    if (cc := compile_config(args)) is not None and served_statically(model, args.batching):
        prepare_served_packages(model, cc, args.max_batch_size, args.max_model_len)
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
        model_name=getattr(args, "served_model_name", None),
        max_model_len=args.max_model_len,
        trust_request_chat_template=args.trust_request_chat_template,
        prefill_together=args.prefill_together,
    )
    return 0


def check_max_model_len(model, max_model_len: int | None) -> None:
    """--max-model-len within the model's context (`model`: a loaded Model or a LoadPlan, both have config)."""
    context = model.config.max_position_embeddings
    if max_model_len is not None and max_model_len > context:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context of {context}")


SERVED_MAX_TOKENS = 1024  # what a chat request that names no max_tokens gets (build_app's default)


def served_statically(model, batching: str) -> bool:
    """Whether the server's static worker serves `model`: as asked (every model can be batched
    continuously, a sliding-window one too, compiled or not)."""
    return batching == "static"


def prepare_served_packages(model, cc, max_batch_size: int, max_model_len: int | None = None) -> None:
    """serve --compile: find or build the whole-step package of each batch the server compiles (1, 2, 4, ...
    up to max_batch_size; it rounds batches up to a power of two) at the cache length it serves
    (`served_cache_length`), before the server reports healthy. Without --max-model-len, a request longer
    than a default chat request's builds its length on first use."""
    from tierlm.server.batcher import served_cache_length

    model.use_compiled_packages()
    if not model.packages.applies(cc):
        return
    batches = [1 << i for i in range((max_batch_size - 1).bit_length() + 1)]
    length = served_cache_length(model, max_model_len, SERVED_MAX_TOKENS)
    status(f"tierlm: compiled steps for batches {', '.join(map(str, batches))} at cache length {length}:")
    model.packages.prepare(batches, length, cc, report=lambda line: status(f"tierlm: {line}"))


def serve_replicas(args) -> int:
    """`serve --replicas N`: the same server as N Ray Serve replicas, each loading the model itself."""
    from tierlm.generation.config import GenerationConfig
    from tierlm.server import ray_app

    ray_app.import_ray()  # a missing extra is the first thing to say
    if args.model and not Path(args.model).exists():
        raise FileNotFoundError(f"model not found: {args.model}")
    if args.max_model_len is not None:  # said here, not by each replica after it loads (and Ray retries)
        from tierlm.plan import plan

        check_max_model_len(plan(args.model, dtype=args.dtype, device=args.device), args.max_model_len)
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
            "model_name": getattr(args, "served_model_name", None),
            "max_model_len": args.max_model_len,
            "trust_request_chat_template": args.trust_request_chat_template,
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
    if args.max_model_len is not None and not args.serve:
        raise ValueError("--max-model-len goes with --serve (what serve builds); give --cache-len otherwise")
    if args.cache_len < 1:
        raise ValueError(f"--cache-len must be >= 1, got {args.cache_len}")
    if args.serve:
        check_serve_args(args)
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
    if args.serve:
        check_max_model_len(model, args.max_model_len)
    if args.serve and static:
        prepare_served_packages(model, cc, args.max_batch_size, args.max_model_len)
    elif args.serve:  # the continuous worker's steps, as it prepares them at start-up
        from tierlm.generation.config import GenerationConfig
        from tierlm.server.continuous import ContinuousScheduler

        config = GenerationConfig(compile_config=cc)
        scheduler = ContinuousScheduler(
            model, max_batch_size=args.max_batch_size, base_config=config, max_model_len=args.max_model_len
        )
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
