"""Offload: decode speed with weights on disk, tierlm vs transformers + accelerate, warm and cold page cache.

Part A (page cache warm): an fp32 safetensors copy of the default model (SmolLM2-135M-Instruct), the same
device maps for both engines: all in RAM, layers 15-29 + model.norm on disk, everything but the
embeddings and lm_head on disk. Greedy, a forced number of new tokens; every (map, engine) is loaded at
once and each round runs all of them in turn, so noise from other processes hits all alike; medians.
Decode tok/s is (new tokens - 1) / (wall time of the full call - median wall time of a call that makes
one token), for both engines alike; an in-call clock (from the second forward to the end) cross-checks it.

Part B (cold disk, needs root to drop the page cache): a random ~1.5 GB bf16 Llama written once, loaded
with device_map="auto", max_memory={"cpu": "400MB"}, each run in a fresh process after dropping the page
cache. Two modes: "cold start" (the cache is dropped once, before the run: on a machine with spare RAM
every token after the first is then read from the page cache) and "cold every token" (the benchmark also
evicts each disk-offloaded unit's file pages right after tierlm used them, as on a machine whose RAM
cannot cache the weights: every token reads them from the disk again). Decode tok/s is compared with the
disk bound = sequential disk read speed / bytes on the disk tier per token; RssAnon is sampled every
20 ms against the budget 400 MB + KV cache + 300 MB.

Part C (--compiled; benchmarks/offload_compiled.py): compiled decode under offload on the default model,
page cache warm: eager offloaded vs layer-compiled offloaded vs layer-compiled resident vs whole-step
compiled resident, two maps, default dtype and int4. With --compiled, Part B also runs "cold every token"
with the layer-compiled step (compiled in a warm-up call first), against the same disk bound.

--time-budget (default 570 s) caps the whole run: a round that would not fit is skipped, and the output
says so (the first round of each part always runs). Run: python benchmarks/offload.py [--help]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runpy (`tierlm bench`) does not add it
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF and loading progress bars

from common import MB, cpu_header, fmt, machine_load, median, print_table, spread, write_json  # noqa: E402
from offload_disk import (  # noqa: E402
    RANDOM_LLAMA,
    disk_read_speed,
    drop_page_cache,
    folder_bytes,
    fp32_checkpoint,
    random_llama,
    safetensors_sizes,
    step,
    tier_bytes,
)
from offload_engines import (  # noqa: E402
    COLD_EVERY,
    COLD_EVERY_COMPILED,
    COLD_START,
    CPU_BUDGET,
    CPU_BUDGET_BYTES,
    HF,
    RESIDENT,
    TIERLM,
    AccelerateEngine,
    ResultA,
    Sample,
    TierlmEngine,
    child_accelerate,
    child_tierlm,
    part_a_maps,
    quiet_transformers,
    summarize_a,
)

PROMPT = (
    "The sea was calm that morning, and the fishermen pushed their boats out before sunrise, "
    "talking quietly about the weather, the price of fish and the long winter ahead."
)
RESULT = "RESULT "  # a child's last stdout line: this prefix, then JSON
OVERHEAD_BYTES = 300 * 10**6  # allowance for Python, torch, activations on top of the budget and KV cache
COLD_PROMPT = [1, 415, 2936, 9060, 285, 1142, 461, 10164, 754, 272, 17898, 3914, 28723, 13, 1014, 907]
ACCELERATE_TIMEOUT_S = 180
PART_A_SHARE = 0.6  # of --time-budget, when Part B runs too


def leading_matches(a: list[int], b: list[int]) -> int:
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    return same


# ================================================================ Part A: page cache warm


def run_part_a(args, deadline: float) -> dict:
    """All maps and engines loaded at once, then runs interleaved over all of them (map x engine), round
    by round, so that machine noise hits every cell alike; a round that would end past `deadline`
    (perf_counter) is not started, but the first one always runs."""
    import torch

    quiet_transformers()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    path = fp32_checkpoint(args.work_dir)
    from tierlm.tokenizer import Tokenizer

    ids = torch.tensor([Tokenizer.from_dir(path).encode(PROMPT)])
    num_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    maps = part_a_maps(num_layers, args.device)
    sizes = safetensors_sizes(path)
    print(f"\nPart A: {path.name} ({folder_bytes(path) / MB:.0f} MB fp32 safetensors, page cache warm)")
    engines: dict[tuple[str, str], Any] = {}
    for map_name, device_map in maps.items():
        on_disk = tier_bytes(device_map, sizes).get("disk", 0)
        step(f"Part A: loading map '{map_name}' ({on_disk / MB:.0f} MB on disk) ...")
        engines[(map_name, TIERLM)] = TierlmEngine(path, device_map, args.work_dir)
        if not args.skip_accelerate:
            engines[(map_name, HF)] = AccelerateEngine(path, device_map, args.work_dir)
    for (map_name, name), engine in engines.items():
        step(f"  {map_name}, {name}: warm-up (4 tokens)")
        engine.warm(ids)
    samples: dict[tuple[str, str], list[Sample]] = {key: [] for key in engines}
    notes = []
    start = time.perf_counter()
    for i in range(args.runs):
        if i and time.perf_counter() + (time.perf_counter() - start) / i > deadline:
            notes.append(f"stopped after {i} of {args.runs} rounds to stay within --time-budget")
            break
        keys = list(engines)
        for key in keys[i % len(keys) :] + keys[: i % len(keys)]:  # a different cell goes first each round
            step(f"  round {i + 1}/{args.runs}: {key[0]}, {key[1]}")
            samples[key].append(engines[key].sample(ids, args.new_tokens))
    rounds = len(next(iter(samples.values())))
    print(
        f"prompt {ids.shape[1]} tokens, {args.new_tokens} new tokens forced, greedy; median of {rounds} "
        f"rounds, each running every map and engine in turn, after a 4-token warm-up"
    )
    results: list[ResultA] = []
    for (map_name, name), engine in engines.items():
        res = summarize_a(map_name, name, engine.load_s, samples[(map_name, name)], args.new_tokens)
        if name == TIERLM:
            res.streamed_mb = {t: b / MB for t, b in engine.streamed_bytes().items()}
            res.prefetched = engine.prefetch_note()
        results.append(res)
    del engines
    gc.collect()
    check = print_part_a(results, list(maps), rounds)
    for note in notes:
        print(f"note: {note}")
    return {
        "checkpoint": str(path),
        "prompt_tokens": ids.shape[1],
        "rounds": rounds,
        "maps": maps,
        "results": [vars(r) for r in results],
        "tierlm_tokens_equal_across_maps": check,
        "notes": notes,
    }


def print_part_a(results: list[ResultA], map_names: list[str], rounds: int) -> bool:
    by = {(r.map_name, r.engine): r for r in results}
    base_name = map_names[0]
    base_t = by[(base_name, TIERLM)]
    base_h = by.get((base_name, HF))
    headers = ["map", "tierlm tok/s", "accelerate tok/s", "tierlm / accelerate"]
    headers += [f"tierlm / tierlm {base_name}", f"accelerate / accelerate {base_name}"]
    headers += ["tierlm / accelerate (in-call clock)"]
    rows = []
    for m in map_names:
        t, h = by[(m, TIERLM)], by.get((m, HF))
        rows.append(
            [
                m,
                fmt(t.decode_tok_s, 2),
                fmt(h.decode_tok_s, 2) if h else "-",
                fmt(t.decode_tok_s / h.decode_tok_s, 2) + "x" if h else "-",
                fmt(t.decode_tok_s / base_t.decode_tok_s, 2) + "x",
                fmt(h.decode_tok_s / base_h.decode_tok_s, 2) + "x" if h and base_h else "-",
                fmt(t.in_call_tok_s / h.in_call_tok_s, 2) + "x" if h else "-",
            ]
        )
    print_table(headers, rows, f"Part A: decode tok/s, fp32, page cache warm (median of {rounds})")
    print(
        "decode tok/s = (new tokens - 1) / (full call - median one-token call); in-call clock = from the "
        "second forward of the full call to its end (immune to noise in the separate one-token call)"
    )

    headers = ["map", "engine", "load s", "prefill ms", "decode tok/s", "spread", "runs tok/s"]
    headers += ["in-call tok/s", "loop tok/s", "streamed MB/token", "prefetched"]
    headers += [f"same tokens as tierlm {base_name}"]
    rows = []
    for r in results:
        streamed = ", ".join(f"{b:.0f} {t}" for t, b in r.streamed_mb.items()) or "-"
        same = leading_matches(r.tokens, base_t.tokens)
        rows.append(
            [
                r.map_name,
                r.engine,
                fmt(r.load_s, 2),
                fmt(r.prefill_s * 1000, 0),
                fmt(r.decode_tok_s, 2),
                f"{r.decode_spread:.0%}",
                " ".join(f"{x:.2f}" for x in r.runs_tok_s),
                fmt(r.in_call_tok_s, 2),
                fmt(r.loop_tok_s, 2),
                streamed,
                r.prefetched,
                f"{same}/{len(base_t.tokens)}" + ("" if r.tokens_stable else " (runs differ!)"),
            ]
        )
    print_table(headers, rows, "Part A details (spread = (max - min) / median of the runs)")
    ours = [by[(m, TIERLM)] for m in map_names]
    equal = all(r.tokens == base_t.tokens for r in ours) and all(r.tokens_stable for r in ours)
    verdict = "OK" if equal else "MISMATCH"
    print(f"\ntierlm tokens across the {len(map_names)} maps: {verdict} ({len(base_t.tokens)} tokens each)")
    if not equal:
        for r in ours:
            print(f"  {r.map_name}: {r.tokens}")
    print(f"{machine_load()} at the end of Part A")
    return equal


# ================================================================ Part B: cold disk


def run_child(engine: str, spec: dict, timeout: float | None = None, drop: bool = True) -> dict | str:
    """A fresh process (after dropping the page cache); the result dict, or a string saying why none."""
    if drop:
        drop_page_cache()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine, "--spec", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"did not finish within {timeout:.0f} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        return f"failed (exit {proc.returncode}): {proc.stderr.strip()[-3000:]}"
    return json.loads(lines[-1][len(RESULT) :])


def run_part_b(args, deadline: float) -> dict:
    """Disk speed, then rounds of (cold start, cold every token), each run a fresh process; after the first
    round the all-in-RAM reference and accelerate once; more rounds while they fit before `deadline`."""
    start = time.perf_counter()
    path = random_llama(args.work_dir)
    weights = sorted(path.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in weights)
    sizes = safetensors_sizes(path)
    params = sum(sizes.values()) // 2
    print(
        f"\nPart B: random Llama, {RANDOM_LLAMA['num_hidden_layers']} layers, hidden "
        f"{RANDOM_LLAMA['hidden_size']}, {params / 1e6:.0f}M parameters, {size / MB:.0f} MB bf16 on disk "
        f"({'about 1.5 GB: ok' if 1.2e9 <= size <= 1.8e9 else 'NOT about 1.5 GB'}); "
        f"prompt {len(COLD_PROMPT)} token ids, {args.cold_tokens} new tokens forced; {machine_load()} at the start"
    )
    step("Part B: disk read speed (page cache dropped before each read) ...")
    speeds = disk_read_speed(weights, 3)
    disk = median(speeds)
    print(
        f"disk sequential read, 64 MiB reads, page cache dropped: {disk:.2f} GB/s "
        f"(runs {', '.join(f'{s:.2f}' for s in speeds)})"
    )
    if max(speeds) > 1.5 * min(speeds):
        print(
            f"note: the disk read speed varied {max(speeds) / min(speeds):.1f}x between reads with the page "
            "cache dropped (a virtual disk cached by its host, or other I/O on the machine); the bound uses "
            "the median"
        )
    spec = {
        "path": str(path),
        "offload_folder": str(args.work_dir / "tierlm-offload"),
        "prompt": COLD_PROMPT,
        "new_tokens": args.cold_tokens,
    }
    modes = (COLD_START, COLD_EVERY) + ((COLD_EVERY_COMPILED,) if args.compiled else ())
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    runs[RESIDENT] = []
    accelerate: dict | str = "skipped (--skip-accelerate)"
    notes: list[str] = []
    round_s: list[float] = []
    for i in range(args.cold_runs):
        if i and time.perf_counter() + median(round_s) > deadline:
            notes.append(f"stopped after {i} of {args.cold_runs} rounds to stay within --time-budget")
            break
        t0 = time.perf_counter()
        for mode in modes:
            step(f"Part B, tierlm, {mode}: run {i + 1}/{args.cold_runs} (fresh process, page cache dropped)")
            result = run_child(TIERLM, {**spec, "mode": mode})
            if isinstance(result, str):
                raise SystemExit(f"tierlm Part B child {result}")
            runs[mode].append(result)
            step(f"  {result['decode_tok_s']:.2f} tok/s, load {result['load_s']:.1f} s")
        round_s.append(time.perf_counter() - t0)
        if i == 0:
            step("Part B, tierlm, all in RAM (reference; page cache not dropped) ...")
            result = run_child(TIERLM, {**spec, "mode": RESIDENT}, drop=False)
            if isinstance(result, str):
                raise SystemExit(f"tierlm Part B child {result}")
            runs[RESIDENT].append(result)
            if not args.skip_accelerate:
                step(f"Part B, accelerate, {COLD_START}: once (timeout {ACCELERATE_TIMEOUT_S} s)")
                spec_hf = {**spec, "offload_folder": str(args.work_dir / "accelerate-offload-cold")}
                accelerate = run_child(HF, spec_hf, timeout=ACCELERATE_TIMEOUT_S)
    print_part_b(runs, accelerate, disk, sizes, notes)
    return {
        "checkpoint": str(path),
        "bytes": size,
        "disk_gb_s": disk,
        "disk_runs_gb_s": speeds,
        "tierlm": runs,
        "accelerate": accelerate,
        "notes": notes,
        "seconds": time.perf_counter() - start,
    }


def print_part_b(runs: dict[str, list[dict]], accelerate: dict | str, disk: float, sizes, notes) -> None:
    first = runs[COLD_START][0]
    device_map = first["device_map"]
    on_disk = tier_bytes(device_map, sizes).get("disk", 0)
    disk_modules = [m for m, d in device_map.items() if d == "disk"]
    print(
        f"tierlm device_map='auto', max_memory cpu={CPU_BUDGET}: {len(disk_modules)} modules on disk "
        f"({disk_modules[0]} .. {disk_modules[-1]}), {on_disk / MB:.0f} MB per token from the disk tier "
        f"(checkpoint sizes; tierlm's streamer units: {first['streamer_disk_bytes'] / MB:.0f} MB)"
    )
    bound = disk * 1e9 / on_disk if on_disk else float("nan")
    budget = CPU_BUDGET_BYTES + first["kv_bytes"] + OVERHEAD_BYTES
    print(
        f"disk bound: {disk:.2f} GB/s / {on_disk / MB:.0f} MB = {bound:.2f} tok/s; RSS budget "
        f"{CPU_BUDGET} + KV cache {first['kv_bytes'] / MB:.0f} MB ({first['cache_len']} slots) + 300 MB "
        f"= {budget / MB:.0f} MB"
    )
    resident = median([r["decode_tok_s"] for r in runs[RESIDENT]]) if runs[RESIDENT] else float("nan")
    headers = ["engine", "mode", "runs", "load s", "prefill s", "decode tok/s", "spread", "decode / bound"]
    headers += ["decode / all-RAM", "disk MB/token", "peak RssAnon MB", "vs budget", "peak Anon+File MB"]

    def row(engine: str, mode: str, rs: list[dict], budgeted: bool) -> list[str]:
        rates = [r["decode_tok_s"] for r in rs]
        tok_s = median(rates)
        peak_anon = max(r["peak"]["RssAnon"] for r in rs)
        return [
            engine,
            mode,
            str(len(rs)),
            fmt(median([r["load_s"] for r in rs]), 1),
            fmt(median([r["prefill_s"] for r in rs]), 2),
            fmt(tok_s, 2),
            f"{spread(rates):.0%}",
            fmt(tok_s / bound, 2) + "x" if budgeted else "-",
            fmt(tok_s / resident, 2) + "x",
            fmt(median([r["decode_read_bytes_per_token"] for r in rs]) / MB, 0),
            fmt(peak_anon / MB, 0),
            ("within" if peak_anon <= budget else "OVER") if budgeted else "-",
            fmt(max(r["peak"]["sum"] for r in rs) / MB, 0),
        ]

    rows = [row(TIERLM, mode, rs, mode != RESIDENT) for mode, rs in runs.items() if rs]
    if isinstance(accelerate, dict):
        rows.append(row(HF, COLD_START, [accelerate], True))
    print_table(headers, rows, "Part B: cold disk, bf16, device_map='auto', max_memory={'cpu': '400MB'}")
    print(
        "prefill s = the first forward (with the cache dropped it reads every disk-tier weight); decode tok/s "
        "from the second forward on; disk MB/token = /proc/self/io read_bytes per decode step (0: all from "
        f"the page cache); all-RAM = tierlm with no device map ({resident:.2f} tok/s), the compute floor"
    )
    base = first["baseline"]
    print(
        f"RssAnon after `import torch, tierlm` (before load): {base['RssAnon'] / MB:.0f} MB; peak RssAnon "
        "per run (MB): "
        + "; ".join(
            f"{mode}: " + ", ".join(f"{r['peak']['RssAnon'] / MB:.0f}" for r in rs)
            for mode, rs in runs.items()
            if rs
        )
    )
    for mode in [m for m in (COLD_EVERY, COLD_EVERY_COMPILED) if runs.get(m)]:
        every = runs[mode]
        achieved = median([r["decode_read_bytes_per_token"] * r["decode_tok_s"] for r in every]) / 1e9
        print(
            f"{mode}: tierlm read the disk at {achieved:.2f} GB/s while decoding, "
            f"{achieved / disk:.0%} of the measured sequential speed"
            + (
                f"; layer compile (warm-up call) {median([r['compile_s'] for r in every]):.1f} s"
                if mode == COLD_EVERY_COMPILED
                else ""
            )
        )
    for mode in [m for m in (COLD_START, COLD_EVERY, COLD_EVERY_COMPILED) if runs.get(m)]:
        r = runs[mode][-1]
        print(
            f"{mode}: prefetched {r['prefetched']}/{r['fetches']} unit fetches; load read "
            f"{r['load_read_bytes'] / MB:.0f} MB from the disk, the first forward "
            f"{r['prefill_read_bytes'] / MB:.0f} MB"
            + (f"; {r['evicted_units']} disk units evicted after each use" if r["evicted_units"] else "")
        )
    reference = runs[COLD_START][0]["tokens"]
    same = all(r["tokens"] == reference for rs in runs.values() for r in rs)
    print(f"tierlm tokens equal across all Part B runs (all-in-RAM included): {'OK' if same else 'MISMATCH'}")
    if isinstance(accelerate, dict):
        a = accelerate
        on_disk_hf = tier_bytes(a["device_map"], sizes).get("disk", 0)
        print(
            f"accelerate (cold start, once): {on_disk_hf / MB:.0f} MB on its disk tier "
            f"({sum(d == 'disk' for d in a['device_map'].values())} modules); load read "
            f"{a['load_read_bytes'] / MB:.0f} MB from the disk, the first forward "
            f"{a['prefill_read_bytes'] / MB:.0f} MB; tokens equal to tierlm's: "
            f"{leading_matches(a['tokens'], reference)}/{len(reference)} leading (bf16 random weights: "
            "near-tied logits, so different kernels may diverge)"
        )
    else:
        print(f"accelerate (cold start, once): {accelerate}")
    for note in notes:
        print(f"note: {note}")


# ================================================================ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/offload.py", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine and map in Part A (default 3)")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per call in Part A (default 64)")
    p.add_argument(
        "--cold",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run Part B (cold disk; drops the page cache, needs root); default: on when running as root",
    )
    p.add_argument("--cold-runs", type=int, default=3, help="runs per mode in Part B (default 3)")
    p.add_argument("--cold-tokens", type=int, default=16, help="new tokens per Part B run (default 16)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=570.0,
        help="seconds for the whole benchmark (default 570): later rounds that would not fit are skipped "
        "and said so; the first round of each part always runs",
    )
    p.add_argument("--quick", action="store_true", help="Part A only, 1 run, 16 tokens")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="Part A's execution device")
    p.add_argument("--skip-accelerate", action="store_true")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="run Part C (compiled decode under offload, default model) and a layer-compiled Part B mode",
    )
    p.add_argument("--compiled-only", action="store_true", help="Part C only (implies --compiled)")
    p.add_argument("--compiled-quick", action="store_true", help="Part C: default dtype and one map only")
    p.add_argument("--skip-whole-step", action="store_true", help="Part C: no whole-step compile (minutes)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/tierlm-bench"), help="checkpoints made once")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--child", choices=(TIERLM, HF), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)  # a child's settings, JSON
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv[1:] if argv[:1] == ["--"] else argv)  # `tierlm bench -- ...`
    if args.child:
        return args
    if args.quick:
        args.runs, args.new_tokens, args.cold = 1, 16, False
    args.compiled = args.compiled or args.compiled_only
    root = os.geteuid() == 0
    if args.cold is None:
        args.cold = root
    elif args.cold and not root:
        p.error("--cold drops the page cache (/proc/sys/vm/drop_caches) and needs root")
    if args.runs < 1 or args.cold_runs < 1 or args.new_tokens < 2 or args.cold_tokens < 2:
        p.error("--runs and --cold-runs >= 1, --new-tokens and --cold-tokens >= 2 are needed")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(args.spec)
        result = child_tierlm(spec) if args.child == TIERLM else child_accelerate(spec)
        print(RESULT + json.dumps(result), flush=True)
        return
    import torch

    start = time.perf_counter()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
        f"work dir {args.work_dir}; {machine_load()} at the start"
    )
    out: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    share = PART_A_SHARE if args.cold else 1.0
    if not args.compiled_only:
        out["part_a"] = run_part_a(args, start + args.time_budget * share)
    if args.compiled:
        from offload_compiled import run_part_c

        print(f"\nPart C: compiled decode under offload; {cpu_header()}")
        out["part_c"] = run_part_c(args, args.work_dir)
    if args.compiled_only:
        args.cold = False
    if args.cold:
        if args.device == "cuda":
            print("\nPart B runs on the CPU (it measures disk streaming, not the accelerator).")
        out["part_b"] = run_part_b(args, start + args.time_budget)
    else:
        print("\nPart B (cold disk): skipped (--quick, --no-cold, or not root)")
    out["seconds"] = time.perf_counter() - start
    print(f"\ntotal benchmark time: {out['seconds']:.0f} s; {machine_load()} at the end")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
