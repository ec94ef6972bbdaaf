"""Load time and peak memory of tierlm.load(dtype="float32") on the default model, each in a fresh process:
cold (empty TIERLM_CACHE_DIR, so the GGUF is dequantized and cached) and warm (same cache dir), plus
transformers' from_pretrained of the same GGUF once for comparison. Each process also runs one forward
pass of a 30-token prompt. Run: python benchmarks/load.py [--help]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    MB,
    contention_warning,
    current_rss_mb,
    default_model_file,
    fmt,
    machine_load,
    median,
    peak_rss_mb,
    print_table,
    rss_breakdown_mb,
    status,
    write_json,
)

PROMPT_TOKENS = 30
BUDGET = 1.4  # peak RSS growth allowed, as a multiple of the fp32 weights
RESULT = "RESULT "  # a child's last stdout line: this prefix, then JSON


def prompt_text() -> str:
    return (
        "The sea was calm that morning, and the fishermen pushed their boats out before sunrise, "
        "talking quietly about the weather, the price of fish and the long winter ahead."
    )


def child_tierlm() -> dict:
    start = time.perf_counter()
    import torch

    import tierlm

    import_s = time.perf_counter() - start
    base = current_rss_mb()
    start = time.perf_counter()
    model = tierlm.load(dtype="float32")
    load_s = time.perf_counter() - start
    ids = torch.tensor([model.tokenizer.encode(prompt_text())[:PROMPT_TOKENS]])
    params = sum(p.numel() for p in model.decoder.parameters())  # tied weights count once
    return measure(import_s, base, load_s, lambda: model(ids), params)


def child_transformers() -> dict:
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF conversion progress bar
    start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import_s = time.perf_counter() - start
    base = current_rss_mb()
    file = default_model_file()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    load_s = time.perf_counter() - start
    ids = torch.tensor([tokenizer(prompt_text())["input_ids"][:PROMPT_TOKENS]])
    params = sum(p.numel() for p in model.parameters())
    return measure(import_s, base, load_s, lambda: model(ids).logits, params)


def measure(import_s: float, base_mb: float, load_s: float, forward, params: int) -> dict:
    """Time one forward pass, then read the memory figures of this process."""
    import torch

    loaded_mb = current_rss_mb()
    start = time.perf_counter()
    with torch.inference_mode():
        logits = forward()
    forward_s = time.perf_counter() - start
    assert logits.shape[1] == PROMPT_TOKENS, logits.shape
    peak = peak_rss_mb()
    return {
        "import_s": import_s,
        "load_s": load_s,
        "forward_s": forward_s,
        "params": params,
        "fp32_weights_mb": params * 4 / MB,
        "baseline_rss_mb": base_mb,
        "loaded_rss_mb": loaded_mb,
        "peak_rss_mb": peak,
        "growth_mb": peak - base_mb,
        **{f"final_{k}_mb": v for k, v in rss_breakdown_mb().items()},
    }


def run_child(engine: str, cache_dir: Path) -> dict:
    env = dict(os.environ, TIERLM_CACHE_DIR=str(cache_dir))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{engine} child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][len(RESULT) :]), "process_s": wall}


def folder_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / MB


def run_all(args) -> list[dict]:
    rows = []
    cache_dir = Path(tempfile.mkdtemp(prefix="tierlm-bench-cache-"))
    try:
        status("tierlm cold (empty cache) ...")
        rows.append({"case": "tierlm cold", "runs": 1, **run_child("tierlm", cache_dir)})
        rows[-1]["cache_mb"] = folder_mb(cache_dir)
        warm = []
        for i in range(args.warm_runs):
            status(f"tierlm warm {i + 1}/{args.warm_runs} ...")
            warm.append(run_child("tierlm", cache_dir))
        rows.append({"case": "tierlm warm", "runs": len(warm), **medians(warm)})
        if not args.skip_transformers:
            status("transformers ...")
            rows.append({"case": "transformers", "runs": 1, **run_child("transformers", cache_dir)})
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return rows


def medians(results: list[dict]) -> dict:
    return {k: median([r[k] for r in results]) for k in results[0]}


def print_rows(rows: list[dict]) -> None:
    weights = rows[0]["fp32_weights_mb"]
    limit = BUDGET * weights
    headers = ["case", "runs", "import s", "load s", "forward s", "process s", "baseline MB"]
    headers += ["peak RSS MB", "growth MB", "growth / fp32", "anon MB", "file MB"]
    table = [
        [
            r["case"],
            str(r["runs"]),
            fmt(r["import_s"], 2),
            fmt(r["load_s"], 2),
            fmt(r["forward_s"], 3),
            fmt(r["process_s"], 1),
            fmt(r["baseline_rss_mb"], 0),
            fmt(r["peak_rss_mb"], 0),
            fmt(r["growth_mb"], 0),
            fmt(r["growth_mb"] / weights, 2) + "x",
            fmt(r["final_RssAnon_mb"], 0),
            fmt(r["final_RssFile_mb"], 0),
        ]
        for r in rows
    ]
    print_table(headers, table, "Load: fresh process each; warm = median of its runs")
    print(
        f"\nfp32 weights: {weights:.0f} MB ({rows[0]['params'] / 1e6:.1f}M parameters); "
        f"{BUDGET}x = {limit:.0f} MB. growth = peak RSS (ru_maxrss) - RSS after `import torch, tierlm` "
        f"(transformers: after importing it), load + one {PROMPT_TOKENS}-token forward included."
    )
    for r in rows:
        verdict = "within" if r["growth_mb"] <= limit else "OVER"
        print(f"  {r['case']}: growth {r['growth_mb']:.0f} MB, {verdict} {BUDGET}x")
    cold = rows[0]
    print(f"tierlm cache written by the cold load: {cold['cache_mb']:.0f} MB (GGUF page cache was warm)")
    print("anon / file MB: anonymous and file-backed (mmapped) resident memory at the end of the process")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="benchmarks/load.py", description=__doc__.splitlines()[0])
    p.add_argument("--warm-runs", type=int, default=3)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--child", choices=("tierlm", "transformers"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = child_tierlm() if args.child == "tierlm" else child_transformers()
        print(RESULT + json.dumps(result), flush=True)
        return
    if args.warm_runs < 1:
        p.error("--warm-runs must be at least 1")
    print(f"model: {default_model_file().name}, dtype float32; {machine_load()} at the start")
    if warning := contention_warning():
        print(warning.replace(" (or --threads 1)", ""))
    rows = run_all(args)
    print_rows(rows)
    print(f"{machine_load()} at the end")
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
