"""The argument parser of every `tierlm` command: flags only, no work."""

from __future__ import annotations

import argparse

DESCRIPTION = (
    "`tierlm generate | chat | plan | bench | serve | compile | cache`: argument parsing and printing only."
)


class OneLineParser(argparse.ArgumentParser):
    """Bad flags are one line on stderr and exit code 2, not a usage dump."""

    def error(self, message: str):
        self.exit(2, f"tierlm: error: {message} (see {self.prog} --help)\n")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu", help="execution device when no device map is given")
    p.add_argument(
        "--device-map",
        help='JSON map such as {"model.layers.1": "disk", "": "cpu"}, auto, or one device for the whole model',
    )
    p.add_argument(
        "--max-memory",
        help="budgets such as cpu=2GiB,0=20GiB for the device map; implies --device-map auto when none is given",
    )
    p.add_argument("--offload-folder", help="folder for disk-offloaded weights that need conversion")
    p.add_argument(
        "--quantize",
        choices=("auto", "none", "int8", "int4"),
        help="weight-only quantization of the projections (default auto: a GGUF's Q4_1 blocks stay "
        "packed as int4, its other quantized blocks become int8, where this CPU decodes them faster; "
        "none: float weights)",
    )


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
    p.add_argument(
        "--ignore-eos", action="store_true", help="EOS does not end the answer: decode --max-new-tokens"
    )
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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="tierlm", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for add in (_add_generate, _add_chat, _add_plan, _add_bench, _add_serve, _add_compile, _add_cache):
        add(sub)
    return parser


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for a prompt (argument or stdin)")
    gen.add_argument("prompt", nargs="?", help="the prompt; read from stdin when absent")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", help="system prompt (implies --chat)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text and stats")
    gen.add_argument("--explain", action="store_true", help="print the compile decision and its reasons")
    gen.add_argument(
        "--num-beams", type=int, help="beam search with this many beams (prints the best beam when it ends)"
    )
    gen.add_argument("--length-penalty", type=float, help="beam search: divide scores by length ** this")


def _add_chat(sub) -> None:
    chat = sub.add_parser("chat", help="interactive multi-turn chat (exit with /exit or EOF)")
    add_model_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", help="system prompt")
    chat.add_argument(
        "--tools",
        metavar="FILE",
        help="a JSON file of OpenAI function tools (a list, or {'tools': [...]}): calls are printed and each "
        "tool's result is read from the next input line",
    )
    chat.add_argument(
        "--tool-choice", default="auto", help="auto (default), required, none, or a function's name"
    )


def _add_plan(sub) -> None:
    plan = sub.add_parser("plan", help="show placement and the compile decision without loading weights")
    add_model_args(plan)
    plan.add_argument("--cache", choices=("static", "dynamic"), default="static")
    plan.add_argument("--compile", action="store_true")


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="run benchmarks/decode.py (tierlm vs transformers vs llama.cpp)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for benchmarks/decode.py")


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--compile", action="store_true")
    serve.add_argument("--compile-scope", choices=("model", "layer"))
    add_compile_mode_arg(serve)
    serve.add_argument("--max-batch-size", type=int, default=8)
    add_max_model_len_arg(serve)
    serve.add_argument(
        "--served-model-name",
        help="the model name clients send and /v1/models lists (default: the file or folder name), as vLLM's",
    )
    serve.add_argument(
        "--batching",
        choices=("continuous", "static"),
        default="continuous",
        help="continuous: requests join and leave the running batch at every step (default); static: a "
        "request waits for a running batch to end",
    )
    serve.add_argument(
        "--prefill-together",
        action="store_true",
        help="continuous batching: requests that arrive together prefill in one padded forward (one pass over "
        "the weights) instead of each alone; their tokens may then differ from their solo runs' (not "
        "batch-invariant)",
    )
    serve.add_argument("--api-key")
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a chat request bring its own chat_template (vLLM's flag; else a 400)",
    )
    serve.add_argument(
        "--replicas", type=int, help="serve through Ray Serve with N model replicas (needs tierlm[ray])"
    )
    serve.add_argument("--ray-address", help="join this Ray cluster (default: start a local Ray instance)")
    serve.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica (default: 1)")
    serve.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica (default: 0)")


def add_max_model_len_arg(parser, prefix: str = "") -> None:
    parser.add_argument(
        "--max-model-len",
        type=int,
        help=f"{prefix}the longest prompt + answer served, at most the model's context (default: it); with "
        "--compile the cache and compiled steps are built for it at start, so no request waits for a build",
    )


def _add_compile(sub) -> None:
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
    add_max_model_len_arg(comp, "with --serve: serve's; ")
    comp.add_argument("--batching", choices=("continuous", "static"), default="continuous")


def _add_cache(sub) -> None:
    cache = sub.add_parser("cache", help="list or clear tierlm's cache folder ($TIERLM_CACHE_DIR)")
    cache.add_argument(
        "action", choices=("list", "clear"), help="list: entries and sizes; clear: remove them"
    )
    cache.add_argument(
        "--stale",
        action="store_true",
        help="clear only what killed processes left behind and what is made from files that are gone or "
        "changed (a live process's writes are never removed)",
    )
