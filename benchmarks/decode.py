"""Decode speed and compile cost of tierlm vs transformers (and llama.cpp) on the default model.

Engines: tierlm as load() gives it with no options (its first row: on a GGUF of 4-bit blocks, int4 weights,
eager); tierlm eager with float weights of each --dtypes; compiled tierlm, each variant a separately loaded model (weights bf16, or int8 /
int4 with bf16 activations, x CompileConfig scope "model" or "layer"; bf16 only); transformers eager;
llama.cpp (batch 1). Same prompt tokens, greedy, forced length, runs interleaved, medians. Decode tok/s:
(new tokens after the first) x batch / (wall time of the full call - prefill time), prefill time being
the median time of a one-token call (llama.cpp: time to its first token). Cold compile s: with the
inductor cache in a fresh temporary directory, a variant's warm-up calls minus its median timed ones.
Warm start s: afterwards, a new process per variant on the warm inductor cache, from its first line
(before `import torch`) to the first decoded token, batch 1, and one per weights run eagerly for reference;
each reports its load time and peak RSS. --packages adds, per scope "model" variant, the same step built
ahead of time (tierlm.aot) into a fresh package store: its cold build s, its decode tok/s beside the
JIT-compiled step's, and warm starts that load the package (benchmarks/warm_start.py measures each).
Engines are in benchmarks/engines.py, the variants and prompts in benchmarks/variants.py.
Run: python benchmarks/decode.py [--help]
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runpy (`tierlm bench`) does not add it
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF progress bar; read when tqdm is imported

import torch
import warm_start
from common import (
    MODEL_ENV,
    Runs,
    contention_warning,
    cpu_header,
    default_model_file,
    fmt,
    interleave,
    machine_load,
    median,
    print_table,
    spread,
    status,
    timed,
    write_json,
)
from engines import Sample, TierlmEngine, TransformersEngine, open_llama
from variants import QUESTIONS, VARIANTS, Variant, chat_prompts, parse_variants

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
TIERLM, HF, LLAMA = "tierlm eager (float weights)", "transformers eager", "llama.cpp"


def default_engine_name(model_file: Path) -> tuple[str, str]:
    """The row of what load() gives with no options, and its compute dtype: what a user gets."""
    from tierlm.plan import plan

    default = plan(model_file)
    weights = f"{default.quantization.mode}" if default.quantization else "float"
    return f"tierlm default ({weights} weights, eager)", str(default.dtype).removeprefix("torch.")


@dataclass
class Result:
    """The medians of one engine on one (dtype, batch)."""

    engine: str
    dtype: str
    batch: int
    prompt_tokens: int
    prefill_s: float
    decode_tok_s: float
    decode_spread: float
    runs_tok_s: list[float]
    loop_tok_s: float | None = None
    compile_s: float | None = None  # cold compile: the warm-up call minus the median timed call
    same_tokens: str = "-"  # leading tokens equal to transformers' (min over rows) / new tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")


def summarize(engine: str, dtype: str, rows: list[list[int]], n: int, runs: Runs, compiled: bool) -> Result:
    samples: list[Sample] = runs.timed
    prefill = median([s.prefill_s for s in samples])
    decoded = (n - 1) * len(rows)
    rates = [decoded / (s.total_s - prefill) if s.total_s > prefill else float("nan") for s in samples]
    loop = [s.loop_tok_s for s in samples if s.loop_tok_s is not None]
    # Both calls count: a packaged step is loaded or built when the generation starts, even a one-token one.
    warmup = runs.warmup[0].prefill_s + runs.warmup[0].total_s
    compile_s = warmup - median([s.prefill_s + s.total_s for s in samples]) if compiled else None
    tokens = sum(len(r) for r in rows)
    result = Result(engine, dtype, len(rows), tokens, prefill, median(rates), spread(rates), rates)
    result.loop_tok_s, result.compile_s = median(loop) if loop else None, compile_s
    return result


def leading_matches(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens equal from the start, the smallest count over rows."""
    counts = []
    for x, y in zip(a, b):
        same = 0
        while same < min(len(x), len(y)) and x[same] == y[same]:
            same += 1
        counts.append(same)
    return min(counts)


def bench_group(engines: dict, dtype: str, rows: list[list[int]], args) -> list[Result]:
    calls = {name: (lambda e=e: e.sample(rows, args.new_tokens)) for name, e in engines.items()}
    status(f"{dtype}, batch {len(rows)}: {', '.join(calls)}")
    runs = interleave(calls, args.runs, warmup=1)
    results = []
    for name, r in runs.items():
        compiled = getattr(engines[name], "compile_config", None) is not None
        results.append(summarize(name, dtype, rows, args.new_tokens, r, compiled))
    if HF in runs:
        reference = runs[HF].timed[-1].tokens
        for res in results:
            if res.engine != HF:
                same = leading_matches(runs[res.engine].timed[-1].tokens, reference)
                res.same_tokens = f"{same}/{args.new_tokens}"
    return results


def bench_dtype(dtype: str, args, model_file: Path, llama) -> list[Result]:
    import tierlm

    engines = {}
    default_name, default_dtype = default_engine_name(model_file)
    if dtype == default_dtype:  # first, in the group of its compute dtype
        status(f"loading {default_name} ...")
        engines[default_name] = TierlmEngine(tierlm.load(model_file))
    status(f"loading tierlm ({dtype}) ...")
    model = tierlm.load(model_file, dtype=dtype, quantize=None)
    engines[TIERLM] = TierlmEngine(model)
    if dtype == "bfloat16":  # compiled variants compute in bf16
        for v in args.variants:
            status(f"loading {v.name} ...")
            engines[v.name] = TierlmEngine(
                v.prepare(v.load(), args.package_store), v.compile_config(args.mode)
            )
    if not args.skip_transformers:
        status(f"loading transformers ({dtype}) ...")
        engines[HF] = TransformersEngine(model_file, dtype, model.tokenizer.pad_token_id)
    results = []
    for batch in args.batches:
        rows = chat_prompts(model.tokenizer, batch)
        group = dict(engines)
        if batch == 1 and llama is not None:
            group[LLAMA] = llama
        results += bench_group(group, dtype, rows, args)
    del engines, model
    gc.collect()
    return results


def warm_inductor() -> float:
    """Compile a trivial function once, so that one-off process costs (importing inductor, probing the C++
    compiler and the CPU's vector ISA) fall on no variant's cold compile: those stay comparable."""
    seconds, _ = timed(lambda: torch.compile(lambda x: x * 2 + 1)(torch.ones(8)))
    return seconds


def check_tokenizers(model_file: Path, tokenizer, rows: list[list[int]]) -> str:
    """Both engines get tierlm's token ids; say whether transformers' tokenizer would give the same."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_file.parent, gguf_file=model_file.name)
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    same = hf(text, add_special_tokens=False)["input_ids"] == rows[0]
    return "same ids from the transformers tokenizer" if same else "NOTE: transformers' tokenizer differs"


def ratio(a: Result | None, b: Result | None) -> str:
    if a is None or b is None or a is b:
        return "-"
    return fmt(a.decode_tok_s / b.decode_tok_s, 2) + "x"


def print_summary(results: list[Result], warm: dict[str, warm_start.WarmStart], args) -> None:
    by_key = {(r.dtype, r.batch, r.engine): r for r in results}
    ref = 1 if 1 in args.batches else args.batches[0]  # the batch of the prefill and ratio columns
    compiled = any(r.compile_s is not None for r in results)
    headers = ["dtype", "engine", *(f"tok/s b{b}" for b in args.batches), f"prefill tok/s b{ref}"]
    headers += [f"cold compile s b{b}" for b in args.batches] if compiled else []
    headers += ["warm start s"] if warm else []
    peers = {e: b for e, b in ((HF, ref), (LLAMA, 1)) if any(r.engine == e for r in results)}
    headers += [f"x {e.split()[0]} b{b}" for e, b in peers.items()]
    rows = []
    for dtype, engine in dict.fromkeys((r.dtype, r.engine) for r in results):
        cells = [by_key.get((dtype, b, engine)) for b in args.batches]
        first = by_key.get((dtype, ref, engine))
        row = [dtype, engine, *(fmt(c.decode_tok_s) if c else "-" for c in cells)]
        row.append(fmt(first.prefill_tok_s) if first else "-")
        row += [fmt(c.compile_s if c else None) for c in cells] if compiled else []
        if warm:
            w = warm.get(engine) if dtype == "bfloat16" else None
            row.append(fmt(w.total_s) if w else "-")
        row += [ratio(by_key.get((dtype, b, engine)), by_key.get((dtype, b, e))) for e, b in peers.items()]
        rows.append(row)
    print_table(
        headers,
        rows,
        f"Summary: decode tok/s of all rows together (median of {args.runs} interleaved runs); "
        "x = decode tok/s over that peer's (same dtype, same batch)",
    )


def print_results(results: list[Result], warm: dict[str, warm_start.WarmStart], args) -> None:
    print_summary(results, warm, args)
    headers = ["dtype", "batch", "engine", "prompt tok", "prefill ms", "prefill tok/s", "decode tok/s"]
    headers += ["spread", "loop tok/s", "cold compile s", "same tokens as HF"]
    rows = [
        [r.dtype, str(r.batch), r.engine, str(r.prompt_tokens), fmt(r.prefill_s * 1000), fmt(r.prefill_tok_s)]
        + [fmt(r.decode_tok_s), f"{r.decode_spread:.0%}", fmt(r.loop_tok_s), fmt(r.compile_s), r.same_tokens]
        for r in results
    ]
    print_table(headers, rows, "Details (spread = (max - min) / median of the runs' decode tok/s)")
    if warm:
        warm_start.print_warm_starts(warm)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tierlm bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2-135M Q4_1), e.g. Gemma 3 270M")
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine (after one warm-up)")
    p.add_argument("--dtypes", default="bf16", help="comma-separated: fp32, bf16 (compiled: bf16 only)")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per row (EOS suppressed)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--variants",
        default=VARIANTS,
        help=f"compiled tierlm variants WEIGHTS:SCOPE[:KIND], comma-separated, or none (default: {VARIANTS}); "
        "KIND eager (not compiled), package (an AOTInductor package, as --packages) or cpp (inductor's C++ wrapper)",
    )
    p.add_argument(
        "--compiled", action="store_true", help="old flag, kept for scripts: the default --variants"
    )
    p.add_argument("--mode", help="CompileConfig(mode=...) for the variants (default: tierlm's)")
    p.add_argument("--inductor-cache", help="inductor cache dir (default: a fresh temporary one, so cold)")
    p.add_argument("--threads", type=int, help="torch and llama.cpp threads (default: torch's; llama.cpp 2)")
    p.add_argument(
        "--packages",
        action="store_true",
        help='add each scope "model" variant built ahead of time (tierlm.aot) into a fresh package store',
    )
    p.add_argument("--package-store", help="package store for --packages (default: a fresh temporary one)")
    p.add_argument("--json", help="also write the results to this file")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv[1:] if argv[:1] == ["--"] else argv)  # `tierlm bench -- --runs 5`
    try:
        args.dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    except KeyError as e:
        p.error(f"unknown dtype {e.args[0]!r}; use fp32 or bf16")
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.runs < 1 or args.new_tokens < 2 or not args.batches or min(args.batches) < 1:
        p.error("--runs >= 1, --new-tokens >= 2 and batch sizes >= 1 are needed")
    args.variants = parse_variants(args.variants, p)
    if args.packages:
        model_scope = [v for v in args.variants if v.scope == "model" and v.kind == "jit"]
        args.variants += [Variant(v.weights, "model", "package") for v in model_scope]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model:  # every engine and warm start reads it (benchmarks/common.default_model_file)
        os.environ[MODEL_ENV] = str(Path(args.model).resolve())
    # Before anything compiles: inductor memoizes paths under this directory.
    cache_dir = args.inductor_cache or tempfile.mkdtemp(prefix="tierlm-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    fresh_store = args.packages and not args.package_store
    if fresh_store:  # so that each package's first use is a cold build
        args.package_store = tempfile.mkdtemp(prefix="tierlm-packages-")
    try:
        run(args, cache_dir)
    finally:
        if not args.inductor_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
        if fresh_store:
            shutil.rmtree(args.package_store, ignore_errors=True)


def run(args, cache_dir: str) -> None:
    start = time.perf_counter()
    warning = contention_warning()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    import tierlm

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model_file = default_model_file()
    # the weights load again per engine below
    tokenizer = tierlm.load(model_file, dtype=args.dtypes[0]).tokenizer
    one = chat_prompts(tokenizer, 1)
    widths = sorted(len(r) for r in chat_prompts(tokenizer, max(args.batches)))
    variants = args.variants if "bfloat16" in args.dtypes else []
    print(cpu_header())
    print(f"model: {model_file.name}; torch {torch.__version__}, torch threads: {torch.get_num_threads()}")
    print(f"prompt: {len(one[0])} tokens (chat template of {QUESTIONS[0]!r}); ", end="")
    if max(args.batches) > 1:
        print(f"batch {max(args.batches)}: {widths[0]}-{widths[-1]} tokens, left-padded; ", end="")
    print(f"{args.new_tokens} new tokens forced, greedy; {machine_load()} at the start")
    default_name, default_dtype = default_engine_name(model_file)
    print(f"first row: {default_name}, load() with no options ({default_dtype} activations)")
    if default_dtype not in args.dtypes:
        print(f"  not measured: --dtypes lacks {default_dtype}")
    if warning:
        print(warning)
    if variants:
        kind = "given, so compiles may be warm" if args.inductor_cache else "fresh, so compiles are cold"
        mode = args.mode or "tierlm's default"
        print(f"compiled (bf16): {', '.join(v.spec for v in variants)}; mode: {mode}")
        print(f"inductor cache: {cache_dir} ({kind}); one-off inductor warm-up: {warm_inductor():.1f} s")
    if not args.skip_transformers:
        print(f"tokenizer check: {check_tokenizers(model_file, tokenizer, one)}")
    llama = open_llama(model_file, tokenizer.eos_token_ids, args)
    results = []
    for dtype in args.dtypes:
        results += bench_dtype(dtype, args, model_file, llama)
    warm = {}
    if variants and 1 in args.batches:  # the batch-1 graphs are in the inductor cache now
        warm = warm_start.measure(variants, args)
    elif variants:
        print("warm start: not measured (it reuses the batch-1 graphs; add batch 1 to --batches)")
    print_results(results, warm, args)
    elapsed = time.perf_counter() - start
    print(f"\ntotal benchmark time: {elapsed:.0f} s; {machine_load()} at the end")
    if args.json:
        settings = {**vars(args), "variants": [v.spec for v in args.variants]}
        data = {"settings": settings, "seconds": elapsed, "results": results_json(results)}
        write_json(args.json, {**data, "warm_starts": [vars(w) for w in warm.values()]})


def results_json(results: list[Result]) -> list[dict]:
    return [{**vars(r), "prefill_tok_s": r.prefill_tok_s} for r in results]


if __name__ == "__main__":
    main()
