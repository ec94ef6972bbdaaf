"""Offload benchmark, engines: tierlm and transformers + accelerate under the same device maps (Part A,
in-process, timed), and the Part B children (one fresh process per run, started by benchmarks/offload.py
with the hidden --child/--spec flags) that load, decode and report what they measured.

Imported by benchmarks/offload.py, which puts this folder on sys.path first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import median, spread, timed
from offload_disk import RssSampler, StepClock, install_evictor, read_bytes

TIERLM, HF = "tierlm", "accelerate"
CPU_BUDGET = "400MB"
CPU_BUDGET_BYTES = 400 * 10**6
COLD_START, COLD_EVERY, RESIDENT = "cold start", "cold every token", "all in RAM (reference)"
COLD_EVERY_COMPILED = "cold every token, layer-compiled"


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ================================================================ Part A: in-process engines, page cache warm


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


# ================================================================ Part B: children, one fresh process per run


def timings(load_s: float, load_reads: int, total_s: float, clock, tok_s: float) -> dict:
    """The measurements both Part B children report."""
    return {
        "load_s": load_s,
        "load_read_bytes": load_reads,
        "total_s": total_s,
        "prefill_s": clock.prefill_s(),
        "prefill_read_bytes": clock.prefill_reads(),
        "decode_tok_s": tok_s,
    }


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
    watched = install_evictor(model) if spec["mode"] in (COLD_EVERY, COLD_EVERY_COMPILED) else 0
    ids = torch.tensor([spec["prompt"]])
    n = spec["new_tokens"]
    compile_config, compile_s = None, 0.0
    if spec["mode"] == COLD_EVERY_COMPILED:
        from tierlm import CompileConfig

        compile_config = CompileConfig(scope="layer")  # compiled by a warm-up call of the same cache length
        compile_s, _ = timed(lambda: model.generate(ids, max_new_tokens=n, compile_config=compile_config))
    clock = StepClock()
    model.decoder.register_forward_pre_hook(clock)
    total_s, r = timed(
        lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, compile_config=compile_config)
    )
    end_time, end_reads = time.perf_counter(), read_bytes()
    peak = sampler.stop()
    tok_s, step_reads = clock.decode(end_time, end_reads)
    cfg = model.config
    cache_len = bucket_length(ids.shape[1] + n, cfg.max_position_embeddings)
    streamer = model.streamer
    units = streamer.units if streamer is not None else []
    return {
        **timings(load_s, load_reads, total_s, clock, tok_s),
        "loop_tok_s": r.stats.decode_tokens_per_s,
        "compile_s": compile_s,
        "compiled": r.stats.compile.explain(),
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
        **timings(load_s, load_reads, total_s, clock, tok_s),
        "decode_read_bytes_per_token": step_reads,
        "tokens": out[0, ids.shape[1] :].tolist(),
        "device_map": {k: str(v) for k, v in model.hf_device_map.items()},
        "baseline": base,
        "peak": peak,
        "rss_samples": sampler.samples,
    }
