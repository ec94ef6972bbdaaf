"""Serving throughput of tierlm's OpenAI-compatible server vs llama.cpp's (llama-cpp-python[server]) on the
default model: 1, 4 and 16 concurrent clients, each streaming one chat completion of 64 new tokens (greedy).

Reported per server and client count (medians over the runs): total generated tokens/s (all clients'
completion tokens / wall time of the round) and the median time to first token. Each server runs in its own
process on loopback; the clients share one asyncio loop here. Run: python benchmarks/serve.py [--help]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_model_file, fmt, median, print_table, status, write_json  # noqa: E402

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
model = tierlm.load(path, dtype=dtype)
run_server(model, "127.0.0.1", port, model_name="bench", max_batch_size=batch, log_level="warning")
"""


@dataclass
class Round:
    tokens_per_s: float
    ttft_s: list[float]


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


def start(name: str, argv: list[str], port: int) -> Server:
    status(f"starting {name} server on port {port}")
    process = subprocess.Popen(argv, env={**os.environ, "TQDM_DISABLE": "1"})
    url = f"http://127.0.0.1:{port}"
    return Server(name, url, wait_ready(name, url, process), process)


def start_tierlm(model_file: Path, args) -> Server:
    port = free_port()
    argv = [
        sys.executable,
        "-c",
        TIERLM_SCRIPT,
        str(model_file),
        args.dtype,
        str(port),
        str(args.max_batch_size),
    ]
    return start("tierlm", argv, port)


def start_llama(model_file: Path) -> Server | None:
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        print("llama.cpp: llama-cpp-python[server] is not installed (pip install 'llama-cpp-python[server]')")
        return None
    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_file)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"]
    return start("llama.cpp", argv, port)


async def one_request(client: httpx.AsyncClient, server: Server, question: str, max_tokens: int):
    """(time to first token, completion tokens) of one streamed chat completion."""
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, chunks, usage = time.perf_counter(), None, 0, None
    async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line.removeprefix("data: "))
            usage = data.get("usage") or usage
            if data.get("choices") and data["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                chunks += 1
    tokens = usage["completion_tokens"] if usage else chunks  # a server without usage: one chunk per token
    return (first or time.perf_counter()) - start, tokens


async def one_round(server: Server, clients: int, max_tokens: int) -> Round:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(trust_env=False, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_request(client, server, QUESTIONS[i % len(QUESTIONS)], max_tokens) for i in range(clients))
        )
        wall = time.perf_counter() - start
    return Round(sum(t for _, t in results) / wall, [ttft for ttft, _ in results])


def bench(server: Server, args) -> dict[int, dict]:
    out = {}
    for clients in args.clients:
        status(f"  {server.name}: {clients} clients, warm-up")
        asyncio.run(one_round(server, clients, args.max_tokens))
        rounds = []
        for run in range(args.runs):
            status(f"  {server.name}: {clients} clients, run {run + 1}/{args.runs}")
            rounds.append(asyncio.run(one_round(server, clients, args.max_tokens)))
        out[clients] = {
            "tokens_per_s": median([r.tokens_per_s for r in rounds]),
            "ttft_ms": 1000 * median([median(r.ttft_s) for r in rounds]),
        }
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF or HF folder (default: SmolLM2-135M GGUF)")
    p.add_argument("--dtype", default="auto", help="tierlm's dtype (default: auto)")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=64)
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
    batch_sizes: dict[str, int] = {}
    for starter in (lambda: start_tierlm(model_file, args), lambda: start_llama(model_file)):
        server = starter()
        if server is None:
            continue
        try:
            results[server.name] = bench(server, args)
            if server.name == "tierlm":
                stats = httpx.get(f"{server.url}/stats", trust_env=False).json()
                batch_sizes = stats["batch_sizes"]
        except httpx.HTTPError as e:  # a peer that breaks under load is reported, not fatal
            print(
                f"{server.name}: failed under load ({type(e).__name__}: {e}); no numbers for it",
                file=sys.stderr,
            )
        finally:
            server.stop()
    base = results["tierlm"]
    rows = []
    for clients in args.clients:
        row = [str(clients)]
        for name, res in results.items():
            r = res[clients]
            row += [fmt(r["tokens_per_s"]), fmt(r["ttft_ms"], 0)]
            if name != "tierlm":
                row.append(f"{base[clients]['tokens_per_s'] / r['tokens_per_s']:.2f}x")
        rows.append(row)
    headers = ["clients"]
    for name in results:
        headers += [f"{name} tok/s", f"{name} TTFT ms"] + (["tierlm/llama tok/s"] if name != "tierlm" else [])
    title = f"{model_file.name}, {args.max_tokens} new tokens per client, median of {args.runs} runs"
    print_table(headers, rows, title)
    print(f"tierlm batch sizes seen (size: batches, warm-ups included): {batch_sizes}")
    if args.json:
        write_json(
            args.json,
            {"model": str(model_file), "args": vars(args), "results": results, "batch_sizes": batch_sizes},
        )


if __name__ == "__main__":
    main()
