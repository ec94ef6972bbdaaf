"""Offload benchmark, disk side: the checkpoints it writes once (an fp32 copy of the default model, a
random ~1.5 GB bf16 Llama), their tensor sizes per tier, page-cache dropping and per-unit eviction, the
sequential disk read speed, disk bytes read (/proc/self/io) and RssAnon sampling (/proc/self/status).

Imported by benchmarks/offload.py, which puts this folder on sys.path first.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from common import default_model_file, status

from tierlm.weights.files import file_mappings

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


T0 = time.perf_counter()  # when benchmarks/offload.py imports this module, at its start


def step(message: str) -> None:
    """Progress on stderr, stamped with the seconds since the start."""
    status(f"[{time.perf_counter() - T0:4.0f} s] {message}")


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


def file_range(t, maps) -> tuple[Path, int, int]:
    """(file, offset, length) of the bytes behind a memory-mapped tensor."""
    ptr, length = t.data_ptr(), t.numel() * t.element_size()
    for start, end, offset, path in maps:
        if start <= ptr < end:
            return path, offset + ptr - start, length
    raise ValueError("tensor is not memory-mapped from a file")


def install_evictor(model) -> int:
    """After each release of a disk unit by tierlm's streamer (eager hook or compiled layer alike), drop its
    file pages from the page cache, so the next token reads them from the disk again. Returns how many
    units it watches."""
    fds: dict[Path, int] = {}
    maps = file_mappings()
    streamer = model.streamer
    ranges: dict[int, list] = {}
    for i, unit in enumerate(streamer.units):
        if unit.tier != "disk":
            continue
        ranges[i] = [file_range(t, maps) for t in unit.sources.values()]
        for file, _, _ in ranges[i]:
            if file not in fds:
                fds[file] = os.open(file, os.O_RDONLY)
    release = streamer.release

    def release_and_evict(i: int) -> None:
        release(i)
        for file, offset, length in ranges.get(i, ()):
            os.posix_fadvise(fds[file], offset, length, os.POSIX_FADV_DONTNEED)

    streamer.release = release_and_evict  # a module hook would land inside a compiled layer body
    return len(ranges)
