"""`benchmarks/serve.py --replicas 1,2`: tierlm served through Ray Serve (`tierlm serve --replicas N`, 1 CPU and
so 1 torch thread per replica, on a local Ray instance) against the single-process server with 2 threads.

Reported per server: generated tokens/s and median time to first token at each client count (the rounds of
benchmarks/serve.py: streamed greedy chat completions, arriving at --rate; a large rate sends them together),
and the router's added latency per request: the
median wall time of GET /v1/models (no generation: the request and the answer only) through Ray Serve minus
through the single-process server, both over HTTP on loopback with a kept-alive connection. The issue's run:

    python benchmarks/serve.py --replicas 1,2 --clients 16 --min-tokens 64 --max-tokens 64 --rate 1000
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import contention_warning, fmt, machine_load  # noqa: E402
from serve import Server, bench, free_port, print_and_save, start, tierlm_argv  # noqa: E402

SINGLE_THREADS = 2
OVERHEAD_REQUESTS = 200


def start_single(model_file: Path, args) -> Server:
    """The single-process server, `SINGLE_THREADS` torch threads."""
    port = free_port()
    argv = tierlm_argv(model_file, args, port)
    return start(f"single process, {SINGLE_THREADS} threads", argv, port, threads=SINGLE_THREADS)


def start_replicas(model_file: Path, replicas: int, args) -> Server:
    """`tierlm serve --replicas N --replica-cpus 1`, the real CLI, on a local Ray instance of its own."""
    port = free_port()
    argv = [sys.executable, "-m", "tierlm.cli", "serve", "--model", str(model_file), "--dtype", args.dtype]
    argv += ["--replicas", str(replicas), "--replica-cpus", "1", "--port", str(port)]
    argv += ["--max-batch-size", str(args.max_batch_size)]
    return start(
        f"ray, {replicas} replica{'s' if replicas > 1 else ''} x 1 thread", argv, port, SINGLE_THREADS
    )


def stop(server: Server, timeout: float = 120) -> None:
    """SIGTERM (Ray's drain and shutdown take a while), then SIGKILL."""
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def request_ms(server: Server, n: int = OVERHEAD_REQUESTS) -> float:
    """Median wall time of GET /v1/models, after 20 warm-up requests, over one kept-alive connection."""
    times = []
    with httpx.Client(base_url=server.url, trust_env=False, timeout=30) as client:
        for i in range(n + 20):
            start = time.perf_counter()
            client.get("/v1/models").raise_for_status()
            if i >= 20:
                times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main(args, model_file: Path) -> None:
    """Called by benchmarks/serve.py with its arguments when it is given --replicas."""
    warning = contention_warning()
    if warning:
        print(warning, file=sys.stderr)
    servers = [lambda: start_single(model_file, args)]
    servers += [lambda n=n: start_replicas(model_file, n, args) for n in args.replicas]
    results: dict[str, dict] = {}
    for starter in servers:
        server = starter()
        try:
            results[server.name] = {"rounds": bench(server, args), "request_ms": request_ms(server)}
        finally:
            stop(server)
    base_name = next(iter(results))
    base = results[base_name]
    rows = []
    for name, res in results.items():
        overhead = res["request_ms"] - base["request_ms"]
        for clients, r in res["rounds"].items():
            ratio = r["tokens_per_s"] / base["rounds"][clients]["tokens_per_s"]
            rows.append(
                [name, str(clients), fmt(r["tokens_per_s"]), f"{ratio:.2f}x", fmt(r["ttft_ms"], 0)]
                + [fmt(res["request_ms"], 2), "-" if name == base_name else fmt(overhead, 2)]
            )
    headers = ["server", "clients", "tok/s", "vs single", "TTFT ms", "request ms", "router overhead ms"]
    title = (
        f"{model_file.name}, {args.max_tokens} new tokens per client, median of {args.runs} runs; "
        f"{machine_load()}"
    )
    print_and_save(headers, rows, title, model_file, args, results)
