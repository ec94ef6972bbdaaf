"""Decode speed of tierlm vs transformers (and llama.cpp) on the default model: same prompt tokens, greedy,
a forced number of new tokens, runs interleaved between engines, medians reported.

Decode tok/s is measured the same way for every engine: (new tokens after the first) x batch divided by
(wall time of the full call - prefill time), where prefill time is the median wall time of a call that
makes one token (llama.cpp: the time to its first token). Run: python benchmarks/decode.py [--help]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runpy (`tierlm bench`) does not add it
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF progress bar; read when tqdm is imported

import torch  # noqa: E402
from common import (  # noqa: E402
    Runs,
    contention_warning,
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
TIERLM, COMPILED, HF, LLAMA = "tierlm", "tierlm compiled", "transformers", "llama.cpp (Q4_1)"


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
    compile_s: float | None = None
    same_tokens: str = "-"  # leading tokens equal to transformers' (min over rows) / new tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")


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


def summarize(engine: str, dtype: str, rows: list[list[int]], n: int, runs: Runs) -> Result:
    samples: list[Sample] = runs.timed
    prefill = median([s.prefill_s for s in samples])
    decoded = (n - 1) * len(rows)
    rates = [decoded / (s.total_s - prefill) if s.total_s > prefill else float("nan") for s in samples]
    loop = [s.loop_tok_s for s in samples if s.loop_tok_s is not None]
    compile_s = None
    if engine == COMPILED:
        compile_s = runs.warmup[0].total_s - median([s.total_s for s in samples])
    return Result(
        engine,
        dtype,
        len(rows),
        sum(len(r) for r in rows),
        prefill,
        median(rates),
        spread(rates),
        rates,
        median(loop) if loop else None,
        compile_s,
    )


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
    results = [summarize(name, dtype, rows, args.new_tokens, r) for name, r in runs.items()]
    if HF in runs:
        reference = runs[HF].timed[-1].tokens
        for res in results:
            if res.engine != HF:
                same = leading_matches(runs[res.engine].timed[-1].tokens, reference)
                res.same_tokens = f"{same}/{args.new_tokens}"
    return results


def bench_dtype(dtype: str, args, model_file: Path, llama) -> list[Result]:
    import tierlm
    from tierlm import CompileConfig

    status(f"loading tierlm ({dtype}) ...")
    model = tierlm.load(dtype=dtype)
    engines = {TIERLM: TierlmEngine(model)}
    if args.compiled:
        engines[COMPILED] = TierlmEngine(model, CompileConfig())
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


def print_results(results: list[Result], args) -> None:
    by_key = {(r.dtype, r.batch, r.engine): r for r in results}
    engines = list(dict.fromkeys(r.engine for r in results))
    peers = [e for e in (HF, LLAMA) if e in engines]
    ours = [e for e in (TIERLM, COMPILED) if e in engines]
    ratios = [(o, p) for p in peers for o in ours]
    headers = ["dtype", "batch", *engines, *(f"{o} / {p.split()[0]}" for o, p in ratios)]
    rows = []
    for dtype, batch in dict.fromkeys((r.dtype, r.batch) for r in results):
        cell = {e: by_key.get((dtype, batch, e)) for e in engines}
        row = [dtype, str(batch), *(fmt(c.decode_tok_s) if c else "-" for c in cell.values())]
        for o, p in ratios:
            a, b = cell.get(o), cell.get(p)
            row.append(fmt(a.decode_tok_s / b.decode_tok_s, 2) + "x" if a and b else "-")
        rows.append(row)
    print_table(headers, rows, f"Decode tok/s, all rows together (median of {args.runs} interleaved runs)")

    headers = ["dtype", "batch", "engine", "prompt tok", "prefill ms", "prefill tok/s", "decode tok/s"]
    headers += ["spread", "loop tok/s", "compile s", "same tokens as HF"]
    rows = [
        [
            r.dtype,
            str(r.batch),
            r.engine,
            str(r.prompt_tokens),
            fmt(r.prefill_s * 1000),
            fmt(r.prefill_tok_s),
            fmt(r.decode_tok_s),
            f"{r.decode_spread:.0%}",
            fmt(r.loop_tok_s),
            fmt(r.compile_s),
            r.same_tokens,
        ]
        for r in results
    ]
    print_table(headers, rows, "Details (spread = (max - min) / median of the runs' decode tok/s)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tierlm bench", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine (after one warm-up)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per row (EOS suppressed)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--compiled", action="store_true", help="add tierlm with CompileConfig() (slow start)")
    p.add_argument("--threads", type=int, help="torch and llama.cpp threads (default: torch's; llama.cpp 2)")
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
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    warning = contention_warning()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    import tierlm

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model_file = default_model_file()
    tokenizer = tierlm.load(dtype="float32").tokenizer  # the weights load again per dtype below
    one = chat_prompts(tokenizer, 1)
    widths = sorted(len(r) for r in chat_prompts(tokenizer, max(args.batches)))
    print(f"model: {model_file.name}; torch {torch.__version__}, torch threads: {torch.get_num_threads()}")
    print(f"prompt: {len(one[0])} tokens (chat template of {QUESTIONS[0]!r}); ", end="")
    if max(args.batches) > 1:
        print(f"batch {max(args.batches)}: {widths[0]}-{widths[-1]} tokens, left-padded; ", end="")
    print(f"{args.new_tokens} new tokens forced, greedy; {machine_load()} at the start")
    if warning:
        print(warning)
    if not args.skip_transformers:
        print(f"tokenizer check: {check_tokenizers(model_file, tokenizer, one)}")
    llama = open_llama(model_file, tokenizer.eos_token_ids, args)
    results = []
    for dtype in args.dtypes:
        results += bench_dtype(dtype, args, model_file, llama)
    print_results(results, args)
    elapsed = time.perf_counter() - start
    print(f"\ntotal benchmark time: {elapsed:.0f} s; {machine_load()} at the end")
    if args.json:
        write_json(args.json, {"settings": vars(args), "seconds": elapsed, "results": results_json(results)})


def results_json(results: list[Result]) -> list[dict]:
    return [{**vars(r), "prefill_tok_s": r.prefill_tok_s} for r in results]


if __name__ == "__main__":
    main()
