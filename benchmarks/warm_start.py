"""Warm start: a new process on a warm inductor cache (or package store), from its first line (before
`import torch`) to its first decoded token, batch 1.

benchmarks/decode.py runs one per compiled variant after its timed runs have filled the inductor cache, and
with --packages one per packaged step plus the same weights eagerly, for reference. Alone, `python
benchmarks/warm_start.py VARIANT [--new-tokens N] [--package-store DIR]` prints one as a JSON line, on the
inductor cache that $TORCHINDUCTOR_CACHE_DIR names.
"""

# ruff: noqa: E402
from __future__ import annotations

import time

START = time.perf_counter()  # the new process measures from here, before `import torch`
START_WALL = time.time()

import argparse
import json
import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF progress bar; read when tqdm is imported

from common import fmt, print_table, status
from variants import Variant, chat_prompts, parse_variants


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
    peak_rss_mb: float = float("nan")  # the child's peak resident memory, through load and its first token
    error: str | None = None


def measure(variants: list[Variant], args) -> dict[str, WarmStart]:
    """A warm start per variant, batch 1, and one per weights run eagerly (what a compiled warm start is
    measured against; its load time and peak memory are the eager model's)."""
    status("warm starts, batch 1:")
    eager = [Variant(v.weights, "model", "eager") for v in variants]
    return {v.name: warm_start(v, args) for v in dict.fromkeys([*variants, *eager])}


def warm_start(variant: Variant, args) -> WarmStart:
    """Run this script in a new process for `variant`, on the inductor cache this process filled."""
    command = [sys.executable, str(Path(__file__).resolve()), variant.spec]
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


def child(args) -> None:
    """In the new process: import, load the variant, make two tokens (the second from one compiled decode
    step) at batch 1 on a static cache as long as the parent's; print the times as one JSON line."""
    import torch
    from torch._dynamo.utils import counters

    from tierlm.cache import bucket_length  # imports all of tierlm

    imported = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    variant = args.variant
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
        "peak_rss_mb": peak_rss_mb(),
    }
    print(json.dumps(out), flush=True)


def peak_rss_mb() -> float:
    """This process's peak resident memory: VmHWM, which starts afresh at exec (ru_maxrss does not: a child
    spawned by a large parent reports the parent's peak), else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def print_warm_starts(warm: dict[str, WarmStart]) -> None:
    headers = ["engine", "warm start s", "python start s", "import s", "load s", "first generate s"]
    headers += ["fx cache hits", "fx cache misses", "peak RSS MB"]
    rows = [
        [w.engine, fmt(w.total_s, 2), fmt(w.startup_s, 2), fmt(w.import_s, 2), fmt(w.load_s, 2)]
        + [fmt(w.generate_s, 2), str(w.cache_hits), str(w.cache_misses), fmt(w.peak_rss_mb, 0)]
        for w in warm.values()
    ]
    print_table(
        headers,
        rows,
        "Warm start, batch 1, bf16: a new process on the warm inductor cache, from its first line (before "
        "`import torch`) to the first decoded token\n(python start: interpreter start-up before that line, "
        "not included; first generate: prefill plus one compiled decode step; peak RSS: the new process's "
        "peak resident memory through load and that step, its static cache allocated at full length)",
    )
    for w in warm.values():
        if w.error:
            print(f"{w.engine}: warm start failed: {w.error}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant", help="WEIGHTS:SCOPE[:KIND], as benchmarks/decode.py --variants")
    p.add_argument("--new-tokens", type=int, default=128, help="the parent's, for its cache length")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--mode", help="CompileConfig(mode=...)")
    p.add_argument("--package-store", help="the package store of a package variant")
    p.add_argument("--spawned-at", type=float, help="the parent's wall clock when it started this process")
    args = p.parse_args(argv)
    variants = parse_variants(args.variant, p)
    if len(variants) != 1:
        p.error(f"give one variant, got {args.variant!r}")
    args.variant = variants[0]
    return args


if __name__ == "__main__":
    child(parse_args())
