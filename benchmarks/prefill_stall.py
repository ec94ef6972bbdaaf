"""A long prompt vs everyone else on one worker: the time to first token of a 1-token request sent while a
4,000-token prompt is prefilled, with chunked prefill off (`prefill_chunk=0`, one forward of the whole prompt)
and on, and the decode tok/s of a streaming request that runs during that prefill.

Part 1 (library): the whole prefill of the long prompt per chunk size: total seconds and the longest chunk
(what a short request may have to wait for). Part 2 (server, its own process on loopback, fp32): the long
prompt L is sent; 0.5 s after the worker took it a streaming chat R (64 tokens) is sent, and 2 s after it a
1-token completion S (all greedy: without chunking, R and S share a batch once L is done). Reported: S's
time to first token, R's tok/s while L was prefilling (its text chunks between its first one and L's first
token), R's tok/s alone, and L's own time to first token.
Run: python benchmarks/prefill_stall.py [--help]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_header, default_model_file, fmt, machine_load, median, print_table, status  # noqa: E402
from serve import free_port, wait_ready  # noqa: E402

SERVER_SCRIPT = """
import sys, tierlm
from tierlm.generation.config import GenerationConfig
from tierlm.server import run_server
path, port, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = tierlm.load(path, dtype="float32")
config = GenerationConfig(prefill_chunk=chunk)
run_server(model, "127.0.0.1", port, model_name="bench", generation_config=config, log_level="warning")
"""
STORY = "Write a long story about a lighthouse keeper."


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def long_prompt(n: int) -> list[int]:
    """n token ids (a fixed pseudo-random sequence of ordinary vocabulary ids)."""
    return [100 + (i * 7919) % 40000 for i in range(n)]


# --- part 1: the library's prefill per chunk size ------------------------------------------------------------


def prefill_table(model_file: Path, args) -> None:
    import torch

    import tierlm
    from tierlm.generation.config import GenerationConfig

    model = tierlm.load(model_file, dtype="float32")
    ids = long_prompt(args.prompt_tokens)
    results: dict[int, list[tuple[float, float]]] = {c: [] for c in args.chunks}
    for run in range(args.runs):
        for chunk in args.chunks:  # interleaved, so a noisy neighbour hits every size alike
            status(f"  prefill of {len(ids)} tokens, chunk {chunk or 'off'}, run {run + 1}/{args.runs}")
            gen = model.start([ids], GenerationConfig(max_new_tokens=1, prefill_chunk=chunk))
            units = []
            while True:
                start = time.perf_counter()
                if gen.advance() is None:
                    break
                units.append(time.perf_counter() - start)
            results[chunk].append((sum(units), max(units)))
    base = median([total for total, _ in results[args.chunks[0]]])
    rows = []
    for chunk, runs in results.items():
        total = median([t for t, _ in runs])
        rows.append(
            [str(chunk or "off"), fmt(total, 2), fmt(median([m for _, m in runs]), 2), f"{total / base:.2f}x"]
        )
    title = (
        f"prefill of {len(ids)} tokens, fp32, median of {args.runs}, {torch.get_num_threads()} threads, "
        f"{machine_load()}"
    )
    print_table(
        ["chunk", "total s", "longest chunk s", f"total / chunk {args.chunks[0] or 'off'}"], rows, title
    )


# --- part 2: the server ---------------------------------------------------------------------------------------


def stream(url: str, body: dict, times: list[float]) -> None:
    """POST a streamed request; append the arrival time of every chunk that carries text or ends it."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with httpx.Client(trust_env=False, timeout=600) as c, c.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            if (
                choice.get("text")
                or (choice.get("delta") or {}).get("content")
                or choice.get("finish_reason")
            ):
                times.append(time.monotonic())


def chat_body(max_tokens: int) -> dict:
    return {
        "model": "bench",
        "messages": [{"role": "user", "content": STORY}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def decode_rate(times: list[float], end: float) -> float:
    """Tokens per second between the first token and `end` (chunks after the first, one token each)."""
    inside = [t for t in times if t <= end]
    return (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 2 else 0.0


def scenario(url: str, args) -> dict:
    solo: list[float] = []
    stream(url, chat_body(args.decode_tokens), solo)
    long_times: list[float] = []
    body = {"model": "bench", "prompt": long_prompt(args.prompt_tokens), "max_tokens": 1, "temperature": 0}
    body["stream"] = True
    long = threading.Thread(target=stream, args=(url, body, long_times))
    sent_long = time.monotonic()
    long.start()
    while httpx.get(f"{url}/stats", trust_env=False).json()["running"] == 0:
        time.sleep(0.01)
    time.sleep(0.5)
    running: list[float] = []
    decoder = threading.Thread(target=stream, args=(url, chat_body(args.decode_tokens), running))
    decoder.start()
    time.sleep(2.0)
    short: list[float] = []
    sent_short = time.monotonic()
    body = {"model": "bench", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    stream(url, {**body, "stream": True}, short)
    long.join()
    decoder.join()
    return {
        "short_ttft": short[0] - sent_short,
        "long_ttft": long_times[0] - sent_long,
        "during": decode_rate(running, long_times[0]),
        "solo": decode_rate(solo, float("inf")),
        "still_prefilling": short[0] < long_times[0],
    }


def server_table(model_file: Path, args) -> None:
    rows = []
    for chunk in args.server_chunks:
        port = free_port()
        argv = [sys.executable, "-c", SERVER_SCRIPT, str(model_file), str(port), str(chunk)]
        status(f"starting the tierlm server with prefill_chunk={chunk}")
        process = subprocess.Popen(argv, env={**os.environ, "TQDM_DISABLE": "1"})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready("tierlm", url, process)
            runs = []
            for run in range(args.runs):
                status(f"  prefill_chunk={chunk}: run {run + 1}/{args.runs}")
                runs.append(scenario(url, args))
        finally:
            process.terminate()
            process.wait(60)
        rows.append(
            [
                str(chunk or "off"),
                fmt(median([r["short_ttft"] for r in runs]), 2),
                fmt(median([r["during"] for r in runs]), 2),
                fmt(median([r["solo"] for r in runs]), 1),
                fmt(median([r["long_ttft"] for r in runs]), 1),
                str(all(r["still_prefilling"] for r in runs)),
            ]
        )
    headers = [
        "prefill_chunk",
        "1-token TTFT s",
        "R tok/s during prefill",
        "R tok/s alone",
        "long TTFT s",
        "answered mid-prefill",
    ]
    title = f"server, fp32, a {args.prompt_tokens}-token prompt prefilled, median of {args.runs}, {machine_load()}"
    print_table(headers, rows, title)


def parse_args() -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF or HF folder (default: SmolLM2-135M GGUF)")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--chunks", type=ints, default=[0, 128, 256, 512], help="part 1's chunk sizes (0: off)")
    p.add_argument("--server-chunks", type=ints, default=[0, 256], help="part 2's prefill_chunk values")
    p.add_argument("--decode-tokens", type=int, default=64, help="new tokens of the running request R")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--skip-library", action="store_true", help="only part 2")
    return p.parse_args()


def main() -> None:
    import torch

    args = parse_args()
    model_file = args.model or default_model_file()
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}, model {model_file.name}")
    print(f"# {cpu_header()}")
    if not args.skip_library:
        prefill_table(model_file, args)
    server_table(model_file, args)


if __name__ == "__main__":
    main()
