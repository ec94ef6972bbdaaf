"""Eager decode and prefill of the default model per dtype and quantization, interleaved, on this CPU.

    python benchmarks/eager.py [--runs 5] [--new-tokens 64]

The question it answers (issue: every CPU): does a quantized model decode at least as fast as the
float bf16 model here, and what does each variant cost in prefill? (Where it does, `load()` keeps a GGUF's
Q4_0/Q4_1 blocks packed by default: `tierlm.cpu.CpuFeatures.keeps_q4_packed`.)
"""

from __future__ import annotations

import argparse

from common import cpu_header, interleave, machine_load, median, print_table, spread

import tierlm
from tierlm import cpu

PROMPT = "Write a short story about a lighthouse keeper who lived alone on a rocky island far out at sea, and one night"
VARIANTS = {
    "bf16": dict(quantize=None),
    "int8": dict(quantize="int8"),
    "int4": dict(quantize="int4"),
    "fp32": dict(dtype="float32"),
}
REFERENCE = "bf16"  # the float default; `load()` with no arguments packs Q4 blocks where tierlm.cpu says so


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    print(cpu_header())
    print(f"{machine_load()} at the start")
    models = {name: tierlm.load(**kwargs) for name, kwargs in VARIANTS.items()}
    default = tierlm.load().plan.quantization
    chosen = "int4" if default and default.mode == "int4" else "bf16"
    print(f"load() with no arguments on this CPU: {chosen} ({cpu.detect().describe()})")
    n = args.new_tokens
    calls = {
        name: (lambda m=m: m.generate(PROMPT, max_new_tokens=n, min_new_tokens=n).stats)
        for name, m in models.items()
    }
    results = interleave(calls, args.runs)
    reference = median([s.decode_tokens_per_s for s in results[REFERENCE].timed])
    rows = []
    for name, runs in results.items():
        decode = [s.decode_tokens_per_s for s in runs.timed]
        prefill = [s.prompt_tokens / s.prefill_seconds for s in runs.timed]
        rows.append(
            [
                name,
                f"{median(decode):.1f}",
                f"{spread(decode):.0%}",
                f"{median(decode) / reference:.2f}x",
                f"{median(prefill):.0f}",
                " ".join(f"{x:.1f}" for x in decode),
            ]
        )
    headers = ["variant", "decode tok/s", "spread", "x bf16", "prefill tok/s", "runs decode tok/s"]
    print_table(headers, rows, f"eager, batch 1, {n} new tokens, median of {args.runs} interleaved runs")
    print(f"{machine_load()} at the end")


if __name__ == "__main__":
    main()
