"""Server start-up on a warm package store: seconds from `tierlm serve` to healthy, with and without --compile.

Issue 13's target: `serve --compile` healthy within 5 s more than `serve` when its compiled steps are already
in the store (tierlm.aot). First one `serve --compile` warms the store (it builds what is missing: cold build
seconds, reported apart); then `serve` and `serve --compile` start in turns (A B A B ...), each in a new
process, timed from the process start to the first 200 from /health, then one greedy four-token completion
(its prefill and three decode steps after healthy: it would show a compile that start-up left to the first
request; a one-token completion would run the eager prefill alone). A compiled server whose log says it
built a package, not loaded it, is flagged: its time is not a warm start.
Run: python benchmarks/serve_start.py [--help]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    contention_warning,
    default_model_file,
    fmt,
    machine_load,
    median,
    print_table,
    spread,
    status,
    write_json,
)
from serve import free_port  # noqa: E402


def start_args(args, compiled: bool, port: int) -> list[str]:
    argv = [sys.executable, "-m", "tierlm.cli", "serve", "--model", str(args.model), "--dtype", args.dtype]
    argv += ["--port", str(port), "--max-batch-size", str(args.max_batch_size), "--batching", args.batching]
    if args.quantize:
        argv += ["--quantize", args.quantize]
    if compiled:
        argv += ["--compile"] + (["--compile-mode", args.compile_mode] if args.compile_mode else [])
    return argv


def one_start(args, compiled: bool) -> dict:
    """Start a server, time it to healthy and to its first token, stop it; what its log said."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            start_args(args, compiled, port),
            env={**os.environ, "TQDM_DISABLE": "1"},
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            healthy = wait_healthy(url, proc, args.timeout) - start
            body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}  # decode steps, not only prefill
            t0 = time.perf_counter()
            model = httpx.get(f"{url}/v1/models", trust_env=False).json()["data"][0]["id"]
            r = httpx.post(
                f"{url}/v1/completions", json={"model": model, **body}, trust_env=False, timeout=None
            )
            r.raise_for_status()
            first = time.perf_counter() - t0
            steps = httpx.get(f"{url}/stats", trust_env=False).json().get("compiled_steps", {})
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        text = log.read()
    return {
        "healthy_s": healthy,
        "first_token_s": first,
        "loaded": text.count("compiled step: loaded package"),
        "built": text.count("compiled step: built package") + text.count("compiled in "),
        "compiled_steps": steps,
        "log": text,
    }


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    """perf_counter() at the first 200 from /health."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", trust_env=False, timeout=5).status_code == 200:
                return time.perf_counter()
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"the server was not healthy within {timeout:.0f} s")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF or HF folder (default: SmolLM2-135M GGUF)")
    p.add_argument("--dtype", default="auto", help="tierlm's dtype (default: auto)")
    p.add_argument("--quantize", choices=("int8", "int4"))
    p.add_argument("--max-batch-size", type=int, default=8, help="serve --max-batch-size (default: 8)")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous")
    p.add_argument("--compile-mode", choices=("default", "max-autotune-no-cudagraphs"))
    p.add_argument("--runs", type=int, default=3, help="timed starts of each server (default: 3)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        help="the store to warm and start from ($TIERLM_CACHE_DIR for the servers; default: the usual one)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds a server may take to be healthy")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    args.model = args.model or default_model_file()
    if args.cache_dir:
        os.environ["TIERLM_CACHE_DIR"] = str(args.cache_dir)  # the servers' store
    if warning := contention_warning():
        status(warning)
    status("warming the store: serve --compile once (builds what is missing) ...")
    warm = one_start(args, compiled=True)
    status(
        f"  healthy after {warm['healthy_s']:.1f} s ({warm['built']} built, {warm['loaded']} loaded); "
        f"steps: {warm['compiled_steps']}"
    )
    runs: dict[str, list[dict]] = {"serve": [], "serve --compile": []}
    for i in range(args.runs):
        for name in runs:
            r = one_start(args, compiled=name != "serve")
            status(
                f"  {name}: run {i + 1}/{args.runs}: healthy {r['healthy_s']:.1f} s, 4 tokens {r['first_token_s']:.2f} s"
            )
            if name != "serve" and r["built"]:
                status(f"  WARNING: {name} built {r['built']} step(s): not a warm start\n{r['log']}")
            runs[name].append(r)
    report(args, warm, runs)


def report(args, warm: dict, runs: dict[str, list[dict]]) -> None:
    rows = []
    for name, rs in runs.items():
        healthy = [r["healthy_s"] for r in rs]
        first = [r["first_token_s"] for r in rs]
        warm_start = "yes" if all(r["built"] == 0 for r in rs) else "NO (built)"
        rows.append(
            [name, fmt(median(healthy), 2), f"{spread(healthy):.0%}", fmt(median(first), 2), warm_start]
        )
    extra = median([r["healthy_s"] for r in runs["serve --compile"]]) - median(
        [r["healthy_s"] for r in runs["serve"]]
    )
    title = (
        f"{args.model.name} ({args.dtype}{', ' + args.quantize if args.quantize else ''}), {args.batching} "
        f"batching, --max-batch-size {args.max_batch_size}, median of {args.runs} starts; {machine_load()}"
    )
    print_table(["server", "healthy s", "spread", "4 tokens s", "no compile"], rows, title)
    print(f"serve --compile is healthy {extra:+.2f} s after serve (target: at most +5 s on a warm store)")
    print(
        f"warm-up start (cold store builds here): {warm['healthy_s']:.1f} s; steps: {warm['compiled_steps']}"
    )
    if args.json:
        strip = lambda r: {k: v for k, v in r.items() if k != "log"}  # noqa: E731
        write_json(
            args.json,
            {
                "model": str(args.model),
                "args": vars(args),
                "warm_up": strip(warm),
                "runs": {k: [strip(r) for r in v] for k, v in runs.items()},
                "compile_extra_s": extra,
            },
        )


if __name__ == "__main__":
    main()
