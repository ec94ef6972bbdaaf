"""Decode speed and compile cost of tierlm vs transformers (and llama.cpp) on the default model.

Engines: tierlm eager; compiled tierlm, each variant a separately loaded model (weights bf16, or int8 /
int4 with bf16 activations, x CompileConfig scope "model" or "layer"; bf16 only); transformers eager;
llama.cpp (batch 1). Same prompt tokens, greedy, forced length, runs interleaved, medians. Decode tok/s:
(new tokens after the first) x batch / (wall time of the full call - prefill time), prefill time being
the median time of a one-token call (llama.cpp: time to its first token). Cold compile s: with the
inductor cache in a fresh temporary directory, a variant's warm-up calls minus its median timed ones.
Warm start s: afterwards, a new process per variant on the warm inductor cache, from its first line
(before `import torch`) to the first decoded token, batch 1. --packages adds, per scope "model" variant,
the same step built ahead of time (tierlm.aot) into a fresh package store: its cold build s, its decode
tok/s beside the JIT-compiled step's, and warm starts that load the package, with an eager warm start of
the same weights for reference. Run: python benchmarks/decode.py [--help]
"""

# ruff: noqa: E402
from __future__ import annotations

import time

START = time.perf_counter()  # a --warm-start-child measures from here, before `import torch`
START_WALL = time.time()

import argparse
import gc
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runpy (`tierlm bench`) does not add it
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF progress bar; read when tqdm is imported

import torch
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

QUESTIONS = [  # 37-47 tokens with the chat template, so batches are left-padded
    "Write a haiku about the sea.",
    "Write a haiku about the moon.",
    "Write a short poem about a forest at night.",
    "Describe the rain in one sentence.",
    "Write a haiku about winter snow falling on a quiet mountain village.",
    "Tell me a fun fact about the desert.",
    "Explain why autumn leaves change their colour, in simple words for a child.",
    "Name three animals that live in the ocean and say one thing about each of them.",
]
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
TIERLM, HF, LLAMA = "tierlm eager", "transformers eager", "llama.cpp"
WEIGHTS, SCOPES = ("bf16", "int8", "int4"), ("model", "layer")  # SCOPES as tierlm.compile.SCOPES
VARIANTS = ",".join(f"{w}:{s}" for w in WEIGHTS for s in SCOPES)


KINDS = ("jit", "package", "eager")  # torch.compile in-process; an AOTInductor package; not compiled


@dataclass(frozen=True)
class Variant:
    """A compiled tierlm: bf16 weights, or int8 / int4 ones with bf16 activations, x the compile scope;
    kind "package" loads (or builds) the step from a package store, "eager" is the same weights uncompiled."""

    weights: str
    scope: str
    kind: str = "jit"

    @property
    def name(self) -> str:
        if self.kind == "eager":
            return f"tierlm {self.weights} eager"
        return f"tierlm {self.weights} {self.scope}" + (" package" if self.kind == "package" else "")

    @property
    def spec(self) -> str:
        return f"{self.weights}:{self.scope}" + (f":{self.kind}" if self.kind != "jit" else "")

    def prepare(self, model, store: str | None):
        """The model, set to load its compiled step from the package store when this is a package variant."""
        if self.kind == "package":
            model.use_compiled_packages(Path(store))
        return model

    def load(self):
        import tierlm

        quantize = None if self.weights == "bf16" else self.weights
        return tierlm.load(default_model_file(), dtype="bfloat16", quantize=quantize)

    def compile_config(self, mode: str | None):
        from tierlm import CompileConfig

        if self.kind == "eager":
            return None
        return CompileConfig(scope=self.scope) if mode is None else CompileConfig(scope=self.scope, mode=mode)


@dataclass
class Sample:
    """One timed run of one engine: a one-token call (prefill) and a full call."""

    prefill_s: float
    total_s: float
    tokens: list[list[int]]  # new tokens per row
    loop_tok_s: float | None = None  # tierlm's own decode-loop timer, for reference


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


@dataclass
class WarmStart:
    """A fresh process on the warm inductor cache, batch 1, to its first decoded token."""

    engine: str
    total_s: float = float("nan")  # the child's first line (before `import torch`) to the first decoded token
    startup_s: float = float("nan")  # interpreter start: spawn to the child's first line (wall clock)
    import_s: float = float("nan")  # torch, tierlm and this script
    load_s: float = float("nan")  # tierlm.load (and quantization) plus tokenizing the prompt
    generate_s: float = float("nan")  # generate(): prefill, then one compiled decode step
    cache_hits: int = 0  # inductor FX graph cache hits / misses in the child
    cache_misses: int = 0
    error: str | None = None


class TierlmEngine:
    def __init__(self, model, compile_config=None) -> None:
        self.model, self.compile_config = model, compile_config

    def _generate(self, rows: list[list[int]], n: int):
        return self.model.generate(
            rows,
            max_new_tokens=n,
            min_new_tokens=n,
            cache_implementation="static",
            compile_config=self.compile_config,
        )

    def sample(self, rows: list[list[int]], n: int) -> Sample:
        prefill_s, _ = timed(lambda: self._generate(rows, 1))
        total_s, r = timed(lambda: self._generate(rows, n))
        if self.compile_config is not None and not r.stats.compile.compile:
            raise SystemExit(f"tierlm did not compile the decode step: {r.stats.compile.explain()}")
        return Sample(prefill_s, total_s, r.token_ids, r.stats.decode_tokens_per_s)


class TransformersEngine:
    def __init__(self, model_file: Path, dtype: str, pad_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_file.parent, gguf_file=model_file.name, dtype=getattr(torch, dtype)
        ).eval()
        self.pad_id = pad_id

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=self.pad_id,
            )

    def sample(self, rows: list[list[int]], n: int) -> Sample:
        ids, mask = left_pad(rows, self.pad_id)
        prefill_s, _ = timed(lambda: self._generate(ids, mask, 1))
        total_s, out = timed(lambda: self._generate(ids, mask, n))
        return Sample(prefill_s, total_s, out[:, ids.shape[1] :].tolist())


class LlamaCppEngine:
    """llama-cpp-python on the same GGUF (Q4_1 kernels, so dtype does not apply); batch 1 only."""

    def __init__(self, model_file: Path, eos_ids: tuple[int, ...], context: int, threads: int) -> None:
        import numpy as np
        from llama_cpp import Llama, LogitsProcessorList

        self.llm = Llama(
            model_path=str(model_file),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=context,
            verbose=False,
        )
        eos = list(eos_ids)

        def suppress_eos(_ids, scores):  # force the full length, as min_new_tokens does elsewhere
            scores[eos] = -np.inf
            return scores

        wanted = dict(top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        accepted = inspect.signature(self.llm.generate).parameters
        self.options = {k: v for k, v in wanted.items() if k in accepted}
        self.options["logits_processor"] = LogitsProcessorList([suppress_eos])

    def sample(self, rows: list[list[int]], n: int) -> Sample:
        assert len(rows) == 1, "llama.cpp runs batch 1 only"
        self.llm.reset()  # else generate() reuses the KV cache of a matching prefix and skips prefill
        tokens, first = [], None
        start = time.perf_counter()
        for token in self.llm.generate(rows[0], **self.options):
            tokens.append(int(token))
            if first is None:
                first = time.perf_counter() - start
            if len(tokens) == n:
                break
        return Sample(first, time.perf_counter() - start, [tokens])


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def chat_prompts(tokenizer, batch: int) -> list[list[int]]:
    """Batch 1: the haiku prompt; larger batches: different questions, so rows are left-padded."""
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(batch)]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


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

    status(f"loading tierlm ({dtype}) ...")
    model = tierlm.load(model_file, dtype=dtype)
    engines = {TIERLM: TierlmEngine(model)}
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


def warm_start(variant: Variant, args) -> WarmStart:
    """Run this script as a --warm-start-child for `variant`, on the inductor cache this process filled."""
    command = [sys.executable, str(Path(__file__).resolve()), "--warm-start-child", variant.spec]
    command += ["--new-tokens", str(args.new_tokens)]
    command += ["--threads", str(args.threads)] if args.threads else []
    command += ["--mode", args.mode] if args.mode else []
    command += ["--package-store", args.package_store] if variant.kind == "package" else []
    command += ["--spawned-at", repr(time.time())]
    status(f"  {variant.name}: warm start in a new process ...")
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ), check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        status(f"  {variant.name}: warm start failed (exit {done.returncode}): {tail}")
        return WarmStart(variant.name, error=f"exit {done.returncode}: {tail}")
    return WarmStart(variant.name, **json.loads(lines[-1]))


def warm_start_child(args) -> None:
    """In the child: import, load the variant, make two tokens (the second from one compiled decode step)
    at batch 1 on a static cache as long as the parent's; print the times as one JSON line."""
    from torch._dynamo.utils import counters

    from tierlm.cache import bucket_length  # imports all of tierlm

    imported = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    variant = args.variants[0]
    model = variant.prepare(variant.load(), args.package_store)
    rows = chat_prompts(model.tokenizer, 1)
    length = bucket_length(len(rows[0]) + args.new_tokens, model.config.max_position_embeddings)
    loaded = time.perf_counter()
    # max_cache_len: the parent's batch-1 cache shape, so that its compiled graph is reused
    config = dict(max_new_tokens=2, min_new_tokens=2, cache_implementation="static", max_cache_len=length)
    r = model.generate(rows, compile_config=variant.compile_config(args.mode), **config)
    end = time.perf_counter()
    if variant.kind != "eager" and not r.stats.compile.compile:
        raise SystemExit(f"tierlm did not compile the decode step: {r.stats.compile.explain()}")
    inductor = counters["inductor"]
    out = {
        "total_s": end - START,
        "startup_s": START_WALL - args.spawned_at if args.spawned_at else float("nan"),
        "import_s": imported - START,
        "load_s": loaded - imported,
        "generate_s": end - loaded,
        "cache_hits": inductor["fxgraph_cache_hit"],
        "cache_misses": inductor["fxgraph_cache_miss"],
    }
    print(json.dumps(out), flush=True)


def check_tokenizers(model_file: Path, tokenizer, rows: list[list[int]]) -> str:
    """Both engines get tierlm's token ids; say whether transformers' tokenizer would give the same."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_file.parent, gguf_file=model_file.name)
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    same = hf(text, add_special_tokens=False)["input_ids"] == rows[0]
    return "same ids from the transformers tokenizer" if same else "NOTE: transformers' tokenizer differs"


def open_llama(model_file: Path, eos_ids, args) -> LlamaCppEngine | None:
    if 1 not in args.batches:
        return None
    try:
        import llama_cpp
    except ImportError:
        print("llama.cpp: not installed (make bench installs it)")
        return None
    threads = args.threads or 2
    print(f"llama.cpp: llama-cpp-python {llama_cpp.__version__}, threads: {threads}, batch 1 only")
    return LlamaCppEngine(model_file, tuple(eos_ids), 256 + args.new_tokens, threads)


def ratio(a: Result | None, b: Result | None) -> str:
    if a is None or b is None or a is b:
        return "-"
    return fmt(a.decode_tok_s / b.decode_tok_s, 2) + "x"


def print_summary(results: list[Result], warm: dict[str, WarmStart], args) -> None:
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


def print_results(results: list[Result], warm: dict[str, WarmStart], args) -> None:
    print_summary(results, warm, args)
    headers = ["dtype", "batch", "engine", "prompt tok", "prefill ms", "prefill tok/s", "decode tok/s"]
    headers += ["spread", "loop tok/s", "cold compile s", "same tokens as HF"]
    rows = [
        [r.dtype, str(r.batch), r.engine, str(r.prompt_tokens), fmt(r.prefill_s * 1000), fmt(r.prefill_tok_s)]
        + [fmt(r.decode_tok_s), f"{r.decode_spread:.0%}", fmt(r.loop_tok_s), fmt(r.compile_s), r.same_tokens]
        for r in results
    ]
    print_table(headers, rows, "Details (spread = (max - min) / median of the runs' decode tok/s)")
    if not warm:
        return
    headers = ["engine", "warm start s", "python start s", "import s", "load s", "first generate s"]
    headers += ["fx cache hits", "fx cache misses"]
    rows = [
        [w.engine, fmt(w.total_s, 2), fmt(w.startup_s, 2), fmt(w.import_s, 2), fmt(w.load_s, 2)]
        + [fmt(w.generate_s, 2), str(w.cache_hits), str(w.cache_misses)]
        for w in warm.values()
    ]
    print_table(
        headers,
        rows,
        "Warm start, batch 1, bf16: a new process on the warm inductor cache, from its first line (before "
        "`import torch`) to the first decoded token\n(python start: interpreter start-up before that line, "
        "not included; first generate: prefill plus one compiled decode step)",
    )
    for w in warm.values():
        if w.error:
            print(f"{w.engine}: warm start failed: {w.error}")


def parse_variants(text: str, p: argparse.ArgumentParser) -> list[Variant]:
    if text.strip() == "none":
        return []
    variants = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        weights, _, rest = spec.partition(":")
        scope, _, kind = rest.partition(":")
        kind = kind or "jit"
        if weights not in WEIGHTS or scope not in SCOPES or kind not in KINDS:
            p.error(
                f"unknown variant {spec!r}; use WEIGHTS:SCOPE[:KIND], WEIGHTS in {WEIGHTS}, SCOPE in {SCOPES}, "
                f"KIND in {KINDS}"
            )
        variants.append(Variant(weights, scope, kind))
    return list(dict.fromkeys(variants))


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
        help=f"compiled tierlm variants WEIGHTS:SCOPE, comma-separated, or none (default: {VARIANTS})",
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
    p.add_argument("--warm-start-child", metavar="VARIANT", help=argparse.SUPPRESS)
    p.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv[1:] if argv[:1] == ["--"] else argv)  # `tierlm bench -- --runs 5`
    try:
        args.dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    except KeyError as e:
        p.error(f"unknown dtype {e.args[0]!r}; use fp32 or bf16")
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.runs < 1 or args.new_tokens < 2 or not args.batches or min(args.batches) < 1:
        p.error("--runs >= 1, --new-tokens >= 2 and batch sizes >= 1 are needed")
    args.variants = parse_variants(args.warm_start_child or args.variants, p)
    if args.packages and not args.warm_start_child:
        model_scope = [v for v in args.variants if v.scope == "model" and v.kind == "jit"]
        args.variants += [Variant(v.weights, "model", "package") for v in model_scope]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model:  # every engine and warm-start child reads it (benchmarks/common.default_model_file)
        os.environ[MODEL_ENV] = str(Path(args.model).resolve())
    if args.warm_start_child:
        return warm_start_child(args)
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
        status("warm starts, batch 1:")
        warm_variants = list(variants)
        if args.packages:  # the same weights run eagerly: what a compiled warm start is measured against
            eager = [Variant(w, "model", "eager") for w in dict.fromkeys(v.weights for v in variants)]
            warm_variants += eager
        warm = {v.name: warm_start(v, args) for v in warm_variants}
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
