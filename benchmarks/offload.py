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

--time-budget (default 570 s) caps the whole run: a round that would not fit is skipped, and the output
says so (the first round of each part always runs). Run: python benchmarks/offload.py [--help]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runpy (`tierlm bench`) does not add it
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF and loading progress bars

from common import (  # noqa: E402
    MB,
    default_model_file,
    fmt,
    machine_load,
    median,
    print_table,
    spread,
    status,
    timed,
    write_json,
)

PROMPT = (
    "The sea was calm that morning, and the fishermen pushed their boats out before sunrise, "
    "talking quietly about the weather, the price of fish and the long winter ahead."
)
TIERLM, HF = "tierlm", "accelerate"
RESULT = "RESULT "  # a child's last stdout line: this prefix, then JSON
CPU_BUDGET = "400MB"
CPU_BUDGET_BYTES = 400 * 10**6
OVERHEAD_BYTES = 300 * 10**6  # allowance for Python, torch, activations on top of the budget and KV cache
RANDOM_LLAMA = dict(  # ~745M parameters, 1.49 GB in bf16 (16 layers would be 1.77 GB)
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=13,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
COLD_PROMPT = [1, 415, 2936, 9060, 285, 1142, 461, 10164, 754, 272, 17898, 3914, 28723, 13, 1014, 907]
COLD_START, COLD_EVERY, RESIDENT = "cold start", "cold every token", "all in RAM (reference)"
ACCELERATE_TIMEOUT_S = 180
PART_A_SHARE = 0.6  # of --time-budget, when Part B runs too


# ================================================================ shared helpers


T0 = time.perf_counter()


def step(message: str) -> None:
    """Progress on stderr, stamped with the seconds since the start."""
    status(f"[{time.perf_counter() - T0:4.0f} s] {message}")


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def safetensors_sizes(folder: Path) -> dict[str, int]:
    """{tensor name: bytes} read from the safetensors headers of a checkpoint folder (no tensor data)."""
    sizes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                sizes[name] = end - start
    return sizes


def tier_bytes(device_map: dict[str, Any], sizes: dict[str, int]) -> dict[str, int]:
    """Bytes per device of a module map, from the checkpoint's tensor sizes (most specific key wins)."""
    totals: dict[str, int] = {}
    for name, size in sizes.items():
        key = name
        while key not in device_map and key:
            key = key.rpartition(".")[0]
        device = str(device_map.get(key, device_map.get("", "?")))
        totals[device] = totals.get(device, 0) + size
    return totals


def leading_matches(a: list[int], b: list[int]) -> int:
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    return same


def read_bytes() -> int:
    """Bytes this process (all threads) made the block layer read: the disk, not the page cache."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


class StepClock:
    """A forward pre-hook on the top module: the time and disk bytes read at the start of each forward."""

    def __init__(self, disk_reads: bool = True) -> None:
        self.disk_reads = disk_reads
        self.times: list[float] = []
        self.reads: list[int] = []

    def reset(self) -> None:
        self.times.clear()
        self.reads.clear()

    def __call__(self, _module, _args) -> None:
        self.times.append(time.perf_counter())
        self.reads.append(read_bytes() if self.disk_reads else 0)

    def prefill_s(self) -> float:
        return self.times[1] - self.times[0] if len(self.times) > 1 else float("nan")

    def prefill_reads(self) -> int:
        return self.reads[1] - self.reads[0] if len(self.reads) > 1 else 0

    def decode(self, end_time: float, end_reads: int) -> tuple[float, float]:
        """(decode tok/s, disk bytes read per decode step) from the second forward on."""
        steps = len(self.times) - 1
        if steps < 1:
            return float("nan"), float("nan")
        return steps / (end_time - self.times[1]), (end_reads - self.reads[1]) / steps


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# ================================================================ Part A: page cache warm


def fp32_checkpoint(work_dir: Path) -> Path:
    """An fp32 safetensors folder of the default model (weights and tokenizer), made once from the GGUF."""
    folder = work_dir / "smollm2-135m-instruct-fp32"
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = default_model_file()
    step(f"writing an fp32 safetensors copy of {file.name} to {folder} (once) ...")
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    # The weights are plain fp32 after dequantization, but transformers still tags the model as
    # GGUF-quantized and refuses to save it; drop the tag.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    work_dir.mkdir(parents=True, exist_ok=True)
    tmp = work_dir / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    del model
    gc.collect()
    return folder


def part_a_maps(num_layers: int, device: str) -> dict[str, dict[str, Any]]:
    """The maps of Part A, with explicit module names both engines know (model.rotary_emb included)."""
    half = num_layers // 2
    last = f"{half}-{num_layers - 1}"

    def full(embed, early, late, norm, head):
        layers = {f"model.layers.{i}": (early if i < half else late) for i in range(num_layers)}
        return {
            "model.embed_tokens": embed,
            **layers,
            "model.norm": norm,
            "model.rotary_emb": "cpu",
            "lm_head": head,
        }

    if device == "cuda":
        gpu = 0
        maps = {
            "all on GPU": full(gpu, gpu, gpu, gpu, gpu),
            f"layers {last} + norm on cpu": full(gpu, gpu, "cpu", "cpu", gpu),
            f"layers {last} + norm on disk": full(gpu, gpu, "disk", "disk", gpu),
            "all but embed/lm_head on disk": full(gpu, "disk", "disk", "disk", gpu),
        }
        for m in maps.values():
            m["model.rotary_emb"] = gpu
        return maps
    return {
        "all in RAM": full("cpu", "cpu", "cpu", "cpu", "cpu"),
        f"layers {last} + norm on disk": full("cpu", "cpu", "disk", "disk", "cpu"),
        "all but embed/lm_head on disk": full("cpu", "disk", "disk", "disk", "cpu"),
    }


@dataclass
class Sample:
    """One timed run of one engine: a one-token call (prefill) and a full call."""

    prefill_s: float
    total_s: float
    tokens: list[int]
    in_call_tok_s: float  # from the second forward of the full call to its end (a forward pre-hook)
    loop_tok_s: float | None = None  # tierlm's own decode-loop timer


class Engine:
    """One model under one map: `sample` makes a one-token call, then a full one, both timed."""

    def __init__(self, top_module) -> None:
        self.clock = StepClock(disk_reads=False)
        top_module.register_forward_pre_hook(self.clock)

    def generate(self, ids, n: int) -> tuple[list[int], float | None]:
        raise NotImplementedError

    def warm(self, ids) -> None:
        self.generate(ids, 4)

    def sample(self, ids, n: int) -> Sample:
        prefill_s, _ = timed(lambda: self.generate(ids, 1))
        self.clock.reset()
        start = time.perf_counter()
        tokens, loop = self.generate(ids, n)
        end = time.perf_counter()
        return Sample(prefill_s, end - start, tokens, self.clock.decode(end, 0)[0], loop)


class TierlmEngine(Engine):
    def __init__(self, path: Path, device_map: dict, work_dir: Path) -> None:
        import tierlm

        self.load_s, self.model = timed(
            lambda: tierlm.load(
                path, dtype="float32", device_map=device_map, offload_folder=work_dir / "tierlm-offload"
            )
        )
        super().__init__(self.model.decoder)

    def generate(self, ids, n: int) -> tuple[list[int], float | None]:
        r = self.model.generate(ids, max_new_tokens=n, min_new_tokens=n)
        return r.token_ids[0], r.stats.decode_tokens_per_s

    def streamed_bytes(self) -> dict[str, int]:
        s = self.model.streamer
        out: dict[str, int] = {}
        for unit in s.units if s is not None else ():
            out[unit.tier] = out.get(unit.tier, 0) + unit.nbytes
        return out

    def prefetch_note(self) -> str:
        s = self.model.streamer
        return f"{s.prefetched}/{s.fetches}" if s is not None else "-"


class AccelerateEngine(Engine):
    def __init__(self, path: Path, device_map: dict, work_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        accelerators = [d for d in device_map.values() if d not in ("cpu", "disk")]
        self.device = torch.device("cuda", int(accelerators[0])) if accelerators else torch.device("cpu")
        self.load_s, model = timed(
            lambda: AutoModelForCausalLM.from_pretrained(
                path,
                device_map=device_map,
                offload_folder=str(work_dir / "accelerate-offload"),
                dtype=torch.float32,
            )
        )
        self.model = model.eval()
        self.pad_id = model.config.eos_token_id
        if isinstance(self.pad_id, list):
            self.pad_id = self.pad_id[0]
        super().__init__(self.model)

    def generate(self, ids, n: int) -> tuple[list[int], float | None]:
        torch = self.torch
        ids = ids.to(self.device)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=self.pad_id,
            )
        return out[0, ids.shape[1] :].tolist(), None  # .tolist() waits for the device


@dataclass
class ResultA:
    map_name: str
    engine: str
    load_s: float
    prefill_s: float
    decode_tok_s: float
    decode_spread: float
    runs_tok_s: list[float]
    tokens: list[int]
    tokens_stable: bool  # every timed run gave the same tokens
    in_call_tok_s: float
    loop_tok_s: float | None = None
    streamed_mb: dict[str, float] = field(default_factory=dict)
    prefetched: str = "-"


def summarize_a(map_name: str, engine: str, load_s: float, samples: list[Sample], n: int) -> ResultA:
    prefill = median([s.prefill_s for s in samples])
    rates = [(n - 1) / (s.total_s - prefill) if s.total_s > prefill else float("nan") for s in samples]
    loops = [s.loop_tok_s for s in samples if s.loop_tok_s is not None]
    return ResultA(
        map_name,
        engine,
        load_s,
        prefill,
        median(rates),
        spread(rates),
        rates,
        samples[-1].tokens,
        all(s.tokens == samples[-1].tokens for s in samples),
        median([s.in_call_tok_s for s in samples]),
        median(loops) if loops else None,
    )


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


def random_llama(work_dir: Path) -> Path:
    """A random-weight Llama (~1.5 GB bf16) written once with transformers; no tokenizer."""
    folder = work_dir / "random-llama-1.5gb-bf16"
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    step(f"writing a random bf16 Llama to {folder} (once) ...")
    config = LlamaConfig(**RANDOM_LLAMA)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.config.dtype = torch.bfloat16
    work_dir.mkdir(parents=True, exist_ok=True)
    tmp = work_dir / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="10GB")
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    del model
    gc.collect()
    return folder


def disk_read_speed(files: list[Path], reps: int) -> list[float]:
    """GB/s of sequential 64 MiB reads of the files, page cache dropped before each repetition."""
    buf = bytearray(64 << 20)
    speeds = []
    for _ in range(reps):
        drop_page_cache()
        total, start = 0, time.perf_counter()
        for file in files:
            with open(file, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
        speeds.append(total / (time.perf_counter() - start) / 1e9)
    return speeds


class RssSampler(threading.Thread):
    """Peak RssAnon, RssFile and their sum from /proc/self/status, sampled every `interval` seconds."""

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.peak = {"RssAnon": 0, "RssFile": 0, "sum": 0}
        self.samples = 0
        self._done = threading.Event()

    @staticmethod
    def read() -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
        return out

    def run(self) -> None:
        while not self._done.is_set():
            now = self.read()
            now["sum"] = now["RssAnon"] + now["RssFile"]
            for k, v in now.items():
                self.peak[k] = max(self.peak[k], v)
            self.samples += 1
            self._done.wait(self.interval)

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join()
        return self.peak


def install_evictor(model) -> int:
    """After each disk unit's forward (after tierlm's own release hook), drop its file pages from the page
    cache, so the next token reads them from the disk again. Returns how many units it watches."""
    fds: dict[Path, int] = {}
    count = 0
    for unit in model.streamer.units:
        if unit.tier != "disk":
            continue
        ranges = list(unit.ranges)
        for file, _, _ in ranges:
            if file not in fds:
                fds[file] = os.open(file, os.O_RDONLY)

        def evict(_module, _args, _output, ranges=ranges) -> None:
            for file, offset, length in ranges:
                os.posix_fadvise(fds[file], offset, length, os.POSIX_FADV_DONTNEED)

        model.decoder.get_submodule(unit.name).register_forward_hook(evict)
        count += 1
    return count


def child_tierlm(spec: dict) -> dict:
    import torch

    import tierlm
    from tierlm.cache import bucket_length
    from tierlm.placement.placer import kv_bytes_per_token

    resident = spec["mode"] == RESIDENT
    base = RssSampler.read()
    sampler = RssSampler()
    sampler.start()
    reads0 = read_bytes()
    placement = {} if resident else {"device_map": "auto", "max_memory": {"cpu": CPU_BUDGET}}
    load_s, model = timed(
        lambda: tierlm.load(
            spec["path"], dtype="bfloat16", offload_folder=spec["offload_folder"], **placement
        )
    )
    load_reads = read_bytes() - reads0
    watched = install_evictor(model) if spec["mode"] == COLD_EVERY else 0
    clock = StepClock()
    model.decoder.register_forward_pre_hook(clock)
    ids = torch.tensor([spec["prompt"]])
    n = spec["new_tokens"]
    total_s, r = timed(lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n))
    end_time, end_reads = time.perf_counter(), read_bytes()
    peak = sampler.stop()
    tok_s, step_reads = clock.decode(end_time, end_reads)
    cfg = model.config
    cache_len = bucket_length(ids.shape[1] + n, cfg.max_position_embeddings)
    streamer = model.streamer
    units = streamer.units if streamer is not None else []
    return {
        "load_s": load_s,
        "load_read_bytes": load_reads,
        "total_s": total_s,
        "prefill_s": clock.prefill_s(),
        "prefill_read_bytes": clock.prefill_reads(),
        "decode_tok_s": tok_s,
        "loop_tok_s": r.stats.decode_tokens_per_s,
        "decode_read_bytes_per_token": step_reads,
        "tokens": r.token_ids[0],
        "device_map": model.device_map,
        "streamer_disk_bytes": sum(u.nbytes for u in units if u.tier == "disk"),
        "fetches": streamer.fetches if streamer is not None else 0,
        "prefetched": streamer.prefetched if streamer is not None else 0,
        "evicted_units": watched,
        "kv_bytes": kv_bytes_per_token(cfg, model.dtype) * cache_len,
        "cache_len": cache_len,
        "baseline": base,
        "peak": peak,
        "rss_samples": sampler.samples,
    }


def child_accelerate(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    base = RssSampler.read()
    sampler = RssSampler()
    sampler.start()
    reads0 = read_bytes()
    load_s, model = timed(
        lambda: AutoModelForCausalLM.from_pretrained(
            spec["path"],
            device_map="auto",
            max_memory={"cpu": CPU_BUDGET},
            offload_folder=spec["offload_folder"],
            dtype=torch.bfloat16,
        )
    )
    load_reads = read_bytes() - reads0
    clock = StepClock()
    model.register_forward_pre_hook(clock)
    ids = torch.tensor([spec["prompt"]])
    n = spec["new_tokens"]
    with torch.inference_mode():
        total_s, out = timed(
            lambda: model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        )
    end_time, end_reads = time.perf_counter(), read_bytes()
    peak = sampler.stop()
    tok_s, step_reads = clock.decode(end_time, end_reads)
    return {
        "load_s": load_s,
        "load_read_bytes": load_reads,
        "total_s": total_s,
        "prefill_s": clock.prefill_s(),
        "prefill_read_bytes": clock.prefill_reads(),
        "decode_tok_s": tok_s,
        "decode_read_bytes_per_token": step_reads,
        "tokens": out[0, ids.shape[1] :].tolist(),
        "device_map": {k: str(v) for k, v in model.hf_device_map.items()},
        "baseline": base,
        "peak": peak,
        "rss_samples": sampler.samples,
    }


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
    runs: dict[str, list[dict]] = {COLD_START: [], COLD_EVERY: [], RESIDENT: []}
    accelerate: dict | str = "skipped (--skip-accelerate)"
    notes: list[str] = []
    round_s: list[float] = []
    for i in range(args.cold_runs):
        if i and time.perf_counter() + median(round_s) > deadline:
            notes.append(f"stopped after {i} of {args.cold_runs} rounds to stay within --time-budget")
            break
        t0 = time.perf_counter()
        for mode in (COLD_START, COLD_EVERY):
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
    every = runs[COLD_EVERY]
    achieved = median([r["decode_read_bytes_per_token"] * r["decode_tok_s"] for r in every]) / 1e9
    print(
        f"{COLD_EVERY}: tierlm read the disk at {achieved:.2f} GB/s while decoding, "
        f"{achieved / disk:.0%} of the measured sequential speed"
    )
    for mode in (COLD_START, COLD_EVERY):
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
    out["part_a"] = run_part_a(args, start + args.time_budget * share)
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
