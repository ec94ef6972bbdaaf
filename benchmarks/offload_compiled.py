"""Offload benchmark, Part C: compiled decode under offload (page cache warm), on the default model.

For the default model (SmolLM2-135M GGUF) in the CPU's default dtype and with int4 weights, and for two
maps (layers 15-29 + norm on disk; everything but the embeddings and the tied LM head on disk), decode tok/s
of: eager offloaded, layer-compiled offloaded (CompileConfig(scope="layer"): one compiled layer body,
the streamed weights its inputs), layer-compiled resident and whole-step-compiled resident (scope "model",
frozen weights; minutes of cold compile, --skip-whole-step leaves it out). Every contender compiles in
its warm-up call (the wall time of that call is reported as its compile time), then the timed calls run
interleaved (A B C ...) so machine noise hits all alike; medians. Decode tok/s is tierlm's loop clock
(the decode steps only). Targets (issue 12): layer-compiled offloaded >= 1.5x eager offloaded on the
same map, within 1.2x of layer-compiled resident, the layer compile under 30 s cold.

Imported by benchmarks/offload.py (--compiled), which puts this folder on sys.path first.
"""

from __future__ import annotations

import gc
from typing import Any

from common import fmt, interleave, machine_load, median, print_table, spread, status, timed

EAGER_OFF, LAYER_OFF, LAYER_RES, WHOLE_RES = (
    "eager offloaded",
    "layer-compiled offloaded",
    "layer-compiled resident",
    "whole-step resident",
)
PROMPT = "The sea was calm that morning, and the fishermen pushed their boats out before sunrise."


def part_c_maps(num_layers: int) -> dict[str, dict[str, str]]:
    half = num_layers // 2
    return {
        f"layers {half}-{num_layers - 1} + norm on disk": {
            "": "cpu",
            **{f"model.layers.{i}": "disk" for i in range(half, num_layers)},
            "model.norm": "disk",
        },
        "all but embed/lm_head on disk": {"": "disk", "model.embed_tokens": "cpu", "lm_head": "cpu"},
    }


def _contender(model, ids, n: int, compile_config) -> Any:
    def call() -> dict:
        r = model.generate(ids, max_new_tokens=n, min_new_tokens=n, compile_config=compile_config)
        return {
            "tok_s": r.stats.decode_tokens_per_s,
            "tokens": r.token_ids[0],
            "explain": r.stats.compile.explain(),
        }

    return call


def run_part_c(args, work_dir) -> dict:
    """Both weight kinds in turn (the models of one kind are freed before the next loads)."""
    import torch

    import tierlm
    from tierlm import CompileConfig

    layer, whole = CompileConfig(scope="layer"), CompileConfig()
    quants = [None, "int4"] if not args.compiled_quick else [None]
    out: dict[str, Any] = {"runs": args.runs, "new_tokens": args.new_tokens, "cells": []}
    for quant in quants:
        kind = quant or "default dtype"
        status(f"Part C ({kind}): loading the resident model ...")
        load_s, resident = timed(lambda q=quant: tierlm.load(quantize=q))
        ids = torch.tensor([resident.tokenizer.encode(PROMPT)])
        maps = part_c_maps(resident.config.num_layers)
        if args.compiled_quick:
            maps = dict(list(maps.items())[:1])
        calls = {(kind, "-", LAYER_RES): _contender(resident, ids, args.new_tokens, layer)}
        if not args.skip_whole_step:
            calls[(kind, "-", WHOLE_RES)] = _contender(resident, ids, args.new_tokens, whole)
        models = [resident]
        for name, device_map in maps.items():
            status(f"Part C ({kind}): loading map '{name}' ...")
            model = tierlm.load(
                quantize=quant, device_map=device_map, offload_folder=work_dir / "tierlm-offload"
            )
            models.append(model)
            calls[(kind, name, EAGER_OFF)] = _contender(model, ids, args.new_tokens, None)
            calls[(kind, name, LAYER_OFF)] = _contender(model, ids, args.new_tokens, layer)
        status(
            f"Part C ({kind}): {len(calls)} contenders, warm-up (compiles) then {args.runs} interleaved runs"
        )
        compile_s = {}
        for key, call in calls.items():  # the warm-up call compiles: time it on its own
            compile_s[key], _ = timed(call)
        results = interleave({" / ".join(k): c for k, c in calls.items()}, args.runs, warmup=0)
        for key in calls:
            runs = results[" / ".join(key)].timed
            rates = [r["tok_s"] for r in runs]
            out["cells"].append(
                {
                    "kind": kind,
                    "map": key[1],
                    "contender": key[2],
                    "decode_tok_s": median(rates),
                    "spread": spread(rates),
                    "runs_tok_s": rates,
                    "warmup_s": compile_s[key],
                    "tokens": runs[-1]["tokens"],
                    "decision": runs[-1]["explain"],
                    "dtype": str(resident.dtype).removeprefix("torch."),
                    "resident_load_s": load_s,
                }
            )
        del models, resident, calls, results
        gc.collect()
    print_part_c(out)
    return out


def print_part_c(out: dict) -> None:
    cells = out["cells"]
    by = {(c["kind"], c["map"], c["contender"]): c for c in cells}
    headers = ["weights", "map", EAGER_OFF, LAYER_OFF, "layer / eager", LAYER_RES, "offloaded / resident"]
    headers += [WHOLE_RES, "layer compile s (offloaded)", "tokens = layer resident"]
    rows = []
    for kind in dict.fromkeys(c["kind"] for c in cells):
        res = by[(kind, "-", LAYER_RES)]
        whole = by.get((kind, "-", WHOLE_RES))
        for name in dict.fromkeys(c["map"] for c in cells if c["kind"] == kind and c["map"] != "-"):
            eager, compiled = by[(kind, name, EAGER_OFF)], by[(kind, name, LAYER_OFF)]
            same = sum(1 for a, b in zip(compiled["tokens"], res["tokens"]) if a == b)
            rows.append(
                [
                    f"{kind} ({res['dtype']})" if kind != "int4" else "int4",
                    name,
                    fmt(eager["decode_tok_s"], 2),
                    fmt(compiled["decode_tok_s"], 2),
                    fmt(compiled["decode_tok_s"] / eager["decode_tok_s"], 2) + "x",
                    fmt(res["decode_tok_s"], 2),
                    fmt(compiled["decode_tok_s"] / res["decode_tok_s"], 2) + "x",
                    fmt(whole["decode_tok_s"], 2) if whole else "skipped",
                    fmt(compiled["warmup_s"], 1),
                    f"{same}/{len(res['tokens'])}",
                ]
            )
    print_table(
        headers,
        rows,
        f"Part C: compiled decode under offload, default model, page cache warm (median of {out['runs']} "
        f"interleaved runs, {out['new_tokens']} new tokens)",
    )
    print(
        "targets: layer / eager >= 1.5x; offloaded / resident >= 0.83x (within 1.2x); layer compile < 30 s cold "
        "(the warm-up call's wall time: compile + one generate; warm if the inductor cache already holds it)"
    )
    print(
        "per contender: "
        + "; ".join(
            f"{c['kind']}, {c['map']}, {c['contender']}: warm-up {c['warmup_s']:.1f} s, spread {c['spread']:.0%}"
            for c in cells
        )
    )
    for c in cells:
        if c["contender"] == LAYER_OFF:
            print(f"decision ({c['kind']}, {c['map']}): {c['decision']}")
    print(f"{machine_load()} at the end of Part C")
