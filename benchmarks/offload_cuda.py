"""Offload on a GPU: decode with layers streamed from pinned CPU RAM into a compiled layer body (issue 12).

A random ~1.5 GB bf16 Llama (benchmarks/offload_disk.py's, written once; no tokenizer) on the execution
device, three placements: all resident; the second half of the layers + the final norm on the cpu tier;
every layer + the norm on the cpu tier (embeddings and LM head resident). Contenders: eager (no compile),
layer-compiled (CompileConfig(scope="layer"): one compiled body, the streamed weights its inputs) and, for
the resident model, the whole step compiled as tierlm does by default on CUDA. Each contender's warm-up
call compiles (its wall time is reported); then the timed calls run interleaved; medians of tierlm's loop
clock (decode steps only).

The bound of a streamed placement is the pinned host-to-device copy rate measured here divided by the
bytes streamed per token: when the side-stream copy of layer i+1 overlaps the compute of layer i, the
streamed decode comes close to it. Greedy tokens of every contender are compared with the eager resident
model's (bf16: compiled kernels may differ after a near tie, so the count of leading equal tokens is shown).

Run on a GPU: python benchmarks/offload_cuda.py [--runs 3 --new-tokens 64]; --device cpu only checks the
script (the cpu tier is then resident RAM: nothing streams).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fmt, interleave, median, print_table, spread, status, timed, write_json  # noqa: E402
from offload_disk import random_llama  # noqa: E402

EAGER, LAYER, WHOLE = "eager", "layer-compiled", "whole step compiled"


def maps(num_layers: int, gpu) -> dict[str, dict]:
    half = num_layers // 2
    layers = lambda tier_of: {f"model.layers.{i}": tier_of(i) for i in range(num_layers)}  # noqa: E731
    resident = {"model.embed_tokens": gpu, "model.norm": gpu, "lm_head": gpu}
    return {
        "all resident": {"": gpu},
        f"layers {half}-{num_layers - 1} + norm on cpu": {
            **resident,
            **layers(lambda i: gpu if i < half else "cpu"),
            "model.norm": "cpu",
        },
        "all layers + norm on cpu": {**resident, **layers(lambda i: "cpu"), "model.norm": "cpu"},
    }


def h2d_gb_s(device) -> float:
    """Pinned host-to-device copy rate (GB/s) of one 256 MB tensor, best of 5."""
    import torch

    if device.type != "cuda":
        return float("nan")
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    best = float("inf")
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return src.numel() / best / 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/tierlm-bench"))
    p.add_argument("--checkpoint", type=Path, help="a safetensors folder (default: the random ~1.5 GB Llama)")
    p.add_argument("--json")
    args = p.parse_args(argv)

    import torch

    import tierlm
    from tierlm import CompileConfig

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    gpu = 0 if device.type == "cuda" else "cpu"
    path = args.checkpoint or random_llama(args.work_dir)
    num_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; checkpoint {path} ({num_layers} layers, bf16)")
    rate = h2d_gb_s(device)
    print(f"pinned host-to-device copy: {fmt(rate, 1)} GB/s (256 MB, best of 6)")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (1, args.prompt_tokens), generator=gen)
    n = args.new_tokens

    calls, models, streamed = {}, {}, {}
    for map_name, device_map in maps(num_layers, gpu).items():
        status(f"loading '{map_name}' ...")
        model = tierlm.load(path, dtype="bfloat16", device_map=device_map)
        models[map_name] = model
        streamed[map_name] = sum(u.nbytes for u in model.streamer.units) if model.streamer else 0
        contenders = {
            EAGER: dict(disable_compile=True),
            LAYER: dict(compile_config=CompileConfig(scope="layer")),
        }
        if map_name == "all resident":
            contenders[WHOLE] = {} if device.type == "cuda" else dict(compile_config=CompileConfig())
        for contender, kwargs in contenders.items():

            def call(model=model, kwargs=kwargs):
                r = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
                return {
                    "tok_s": r.stats.decode_tokens_per_s,
                    "tokens": r.token_ids[0],
                    "decision": r.stats.compile,
                }

            calls[(map_name, contender)] = call
    warmup = {}
    for key, call in calls.items():
        status(f"warm-up (compiles): {key[0]}, {key[1]}")
        warmup[key], _ = timed(call)
    results = interleave({" / ".join(k): c for k, c in calls.items()}, args.runs, warmup=0)
    reference = results[" / ".join(("all resident", EAGER))].timed[-1]["tokens"]
    rows, out = [], []
    for key in calls:
        runs = results[" / ".join(key)].timed
        rates = [r["tok_s"] for r in runs]
        tokens = runs[-1]["tokens"]
        same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(reference))
        nbytes = streamed[key[0]]
        bound = rate * 1e9 / nbytes if nbytes and rate == rate else None
        decision = runs[-1]["decision"]
        rows.append(
            [
                key[0],
                key[1],
                fmt(median(rates), 1),
                f"{spread(rates):.0%}",
                fmt(nbytes / 1e6, 0),
                fmt(bound, 1) if bound else "-",
                f"{median(rates) / bound:.0%}" if bound else "-",
                fmt(warmup[key], 1),
                f"{same}/{len(reference)}",
                "yes" if decision.compile else "no",
            ]
        )
        out.append(
            {
                "map": key[0],
                "contender": key[1],
                "decode_tok_s": median(rates),
                "runs_tok_s": rates,
                "streamed_bytes_per_token": nbytes,
                "copy_bound_tok_s": bound,
                "warmup_s": warmup[key],
                "leading_tokens_equal_eager_resident": same,
                "decision": decision.explain(),
            }
        )
    print_table(
        ["map", "contender", "decode tok/s", "spread", "MB streamed/token", "copy bound tok/s", "of bound"]
        + ["warm-up s", "tokens = eager resident", "compiled"],
        rows,
        f"decode, batch 1, prompt {args.prompt_tokens} random tokens, {n} new tokens forced, greedy, bf16; "
        f"median of {args.runs} interleaved runs",
    )
    for map_name, model in models.items():
        if model.streamer:
            s = model.streamer
            print(f"{map_name}: {s.fetches} fetches, {s.prefetched} already under way when needed")
    for item in out:
        if item["contender"] == LAYER:
            print(f"decision ({item['map']}): {item['decision']}")
    if args.json:
        write_json(args.json, {"device": name, "h2d_gb_s": rate, "cells": out})


if __name__ == "__main__":
    main()
