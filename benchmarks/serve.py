"""Serving under load: tierlm's OpenAI-compatible server with continuous batching vs its static batching
(`--batching static`, the previous worker) vs llama.cpp's (llama-cpp-python[server]) on the default model.

1, 4, 16 and 32 clients each stream one greedy chat completion of 64-256 new tokens (drawn per client), their
arrivals staggered as a Poisson process (`--rate` requests/s; the same seeded draw for every server).
Reported per server and client count (medians over the runs): generated tokens/s (all clients' completion
tokens / wall time of the round), the median and 99th-percentile time to first token, and the median
inter-token latency (gap between streamed chunks). Each server runs in its own process on loopback; the
clients share one asyncio loop here. llama-cpp-python's server has no parallel slots: it serves one request
at a time (started with --interrupt_requests False, so a new request queues instead of cutting the running
one off). Run: python benchmarks/serve.py [--help]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_header, default_model_file, fmt, median, print_table, status, write_json  # noqa: E402

QUESTIONS = [
    "Write a long story about a lighthouse keeper.",
    "Explain in detail how a bicycle works.",
    "Describe a walk through a busy city market.",
    "Tell me everything you know about the moon.",
    "Write a letter to a friend about your summer holiday.",
    "Explain how bread is made, step by step.",
    "Describe the life cycle of a butterfly in detail.",
    "Write a long poem about the ocean and its creatures.",
]
TIERLM_SCRIPT = """
import sys, tierlm
from tierlm.server import run_server
path, dtype, port, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
batching = sys.argv[5] if len(sys.argv) > 5 else "continuous"
together = batching == "prefill-together"  # continuous, joining requests prefilled in one padded forward
model = tierlm.load(path, dtype=dtype)
run_server(
    model, "127.0.0.1", port, model_name="bench", max_batch_size=batch, log_level="warning",
    batching="continuous" if together else batching, **({"prefill_together": True} if together else {}),
)
"""


@dataclass
class Round:
    tokens_per_s: float
    ttft_s: list[float]
    gaps_s: list[float]  # between streamed chunks, every request's


@dataclass
class Server:
    name: str
    url: str
    model: str
    process: subprocess.Popen

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(name: str, url: str, process: subprocess.Popen, timeout: float = 600) -> str:
    """Poll /v1/models until the server answers; return the model id it serves."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} server exited with code {process.returncode}")
        try:
            return httpx.get(f"{url}/v1/models", trust_env=False).json()["data"][0]["id"]
        except (httpx.TransportError, KeyError, ValueError):
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"{name} server did not start within {timeout:.0f} s")


def start(name: str, argv: list[str], port: int, threads: int | None = None) -> Server:
    """Run `argv` (a server on `port`; `threads`: its OMP_NUM_THREADS) until it answers."""
    status(f"starting {name} server on port {port}")
    env = {**os.environ, "TQDM_DISABLE": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    process = subprocess.Popen(argv, env=env)
    url = f"http://127.0.0.1:{port}"
    return Server(name, url, wait_ready(name, url, process), process)


def tierlm_argv(model_file: Path, args, port: int, batching: str = "continuous") -> list[str]:
    """The single-process tierlm server (TIERLM_SCRIPT) for `args.dtype` and `args.max_batch_size`."""
    script = [TIERLM_SCRIPT, str(model_file), args.dtype, str(port), str(args.max_batch_size), batching]
    return [sys.executable, "-c", *script]


def start_tierlm(model_file: Path, args, batching: str = "continuous") -> Server:
    port = free_port()
    return start(f"tierlm {batching}", tierlm_argv(model_file, args, port, batching), port)


def start_llama(model_file: Path) -> Server | None:
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        print("llama.cpp: llama-cpp-python[server] is not installed (pip install 'llama-cpp-python[server]')")
        return None
    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_file)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--interrupt_requests", "False"]
    try:
        return start("llama.cpp", argv, port)
    except SystemExit as e:  # a peer that does not start is reported, not fatal
        print(f"llama.cpp: {e}; no numbers for it", file=sys.stderr)
        return None


async def one_request(
    client: httpx.AsyncClient, server: Server, question: str, max_tokens: int, delay: float
):
    """(time to first token, completion tokens, chunk gaps) of one streamed chat completion sent after `delay`."""
    await asyncio.sleep(delay)
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, times, usage = time.perf_counter(), [], None
    async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line.removeprefix("data: "))
            usage = data.get("usage") or usage
            if data.get("choices") and data["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    tokens = (
        usage["completion_tokens"] if usage else len(times)
    )  # a server without usage: one chunk per token
    first = times[0] if times else time.perf_counter()
    return first - start, tokens, [b - a for a, b in zip(times, times[1:])]


def arrivals(clients: int, rate: float, seed: int, low: int, high: int) -> list[tuple[float, int]]:
    """Per client: when it sends (a Poisson process of `rate` requests/s) and how many tokens it asks for."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(clients):
        out.append((t, rng.randint(low, high)))
        t += rng.expovariate(rate)
    return out


async def one_round(server: Server, clients: int, args) -> Round:
    limits = httpx.Limits(max_connections=clients + 4)
    plan = arrivals(clients, args.rate, args.seed, args.min_tokens, args.max_tokens)
    async with httpx.AsyncClient(trust_env=False, timeout=1800, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(
                one_request(client, server, QUESTIONS[i % len(QUESTIONS)], n, delay)
                for i, (delay, n) in enumerate(plan)
            )
        )
        wall = time.perf_counter() - start
    gaps = [g for _, _, request_gaps in results for g in request_gaps]
    return Round(sum(t for _, t, _ in results) / wall, [ttft for ttft, _, _ in results], gaps)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench(server: Server, args) -> dict[int, dict]:
    out = {}
    # One warm-up round per server (its first batches, its compiles), not one per load level.
    status(f"  {server.name}: warm-up (2 clients)")
    asyncio.run(one_round(server, 2, args))
    for clients in args.clients:
        rounds = []
        for run in range(args.runs):
            status(f"  {server.name}: {clients} clients, run {run + 1}/{args.runs}")
            rounds.append(asyncio.run(one_round(server, clients, args)))
        out[clients] = {
            "tokens_per_s": median([r.tokens_per_s for r in rounds]),
            "ttft_ms": 1000 * median([median(r.ttft_s) for r in rounds]),
            "ttft_p99_ms": 1000 * median([percentile(r.ttft_s, 0.99) for r in rounds]),
            "itl_ms": 1000 * median([median(r.gaps_s) if r.gaps_s else 0.0 for r in rounds]),
        }
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF or HF folder (default: SmolLM2-135M GGUF)")
    p.add_argument("--dtype", default="auto", help="tierlm's dtype (default: auto)")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 32])
    p.add_argument("--min-tokens", type=int, default=64, help="fewest new tokens a client asks for (64)")
    p.add_argument("--max-tokens", type=int, default=256, help="most new tokens a client asks for (256)")
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrival rate, requests/s (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals and lengths (default: 0)")
    p.add_argument(
        "--servers",
        type=lambda s: s.split(","),
        default=["continuous", "static", "llama.cpp"],
        help="which of continuous, static, llama.cpp, prefill-together (continuous batching with the padded "
        "prefill of requests that join together, not batch-invariant) to run (default: the first three)",
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-batch-size", type=int, default=16, help="tierlm's batch limit (default: 16)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--replicas",
        type=lambda s: [int(x) for x in s.split(",")],
        help="instead: Ray Serve with these replica counts vs the single-process server (serve_ray.py)",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    model_file = args.model or default_model_file()
    if args.replicas:
        import serve_ray

        return serve_ray.main(args, model_file)
    results: dict[str, dict[int, dict]] = {}
    starters = {
        "continuous": lambda: start_tierlm(model_file, args, "continuous"),
        "static": lambda: start_tierlm(model_file, args, "static"),
        "prefill-together": lambda: start_tierlm(model_file, args, "prefill-together"),
        "llama.cpp": lambda: start_llama(model_file),
    }
    for name in args.servers:
        server = starters[name]()
        if server is None:
            continue
        name = server.name  # a server named twice (interleaved rounds) keeps each round's numbers
        name = name if name not in results else f"{name} ({sum(k.startswith(name) for k in results) + 1})"
        try:
            results[name] = bench(server, args)
        except httpx.HTTPError as e:  # a peer that breaks under load is reported, not fatal
            print(
                f"{server.name}: failed under load ({type(e).__name__}: {e}); no numbers for it",
                file=sys.stderr,
            )
        finally:
            server.stop()
    report(results, model_file, args)


def report(results: dict[str, dict[int, dict]], model_file: Path, args) -> None:
    base = results.get("tierlm static")
    rows = []
    for clients in args.clients:
        for name, res in results.items():
            r = res[clients]
            row = [str(clients), name, fmt(r["tokens_per_s"]), fmt(r["ttft_ms"], 0), fmt(r["ttft_p99_ms"], 0)]
            row.append(fmt(r["itl_ms"], 1))
            if base is not None:
                b = base[clients]
                row += [
                    f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x",
                    f"{r['ttft_p99_ms'] / b['ttft_p99_ms']:.2f}x",
                ]
            rows.append(row)
    headers = ["clients", "server", "tok/s", "TTFT ms", "p99 TTFT ms", "ITL ms"]
    if base is not None:
        headers += ["tok/s vs static", "p99 TTFT vs static"]
    title = (
        f"{model_file.name}, {args.min_tokens}-{args.max_tokens} new tokens per client, Poisson arrivals "
        f"at {args.rate}/s (seed {args.seed}), median of {args.runs} runs"
    )
    print_and_save(headers, rows, title, model_file, args, results)


def print_and_save(
    headers: list[str], rows: list[list[str]], title: str, model_file: Path, args, results: dict
) -> None:
    """The CPU and the table on stdout, and with --json the results with the model and the arguments."""
    print(cpu_header())
    print_table(headers, rows, title)
    if args.json:
        write_json(args.json, {"model": str(model_file), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
