"""Eager decode and prefill of the default model per dtype and quantization, interleaved, on this CPU.

    python benchmarks/eager.py [--runs 5] [--new-tokens 64]

The question it answers (issue: every CPU): does a quantized model decode at least as fast as the
float default here, and what does each variant cost in prefill?
"""

from __future__ import annotations

import argparse

from common import cpu_header, interleave, machine_load, median, print_table, spread

import tierlm

PROMPT = "Write a short story about a lighthouse keeper who lived alone on a rocky island far out at sea, and one night"
VARIANTS = {
    "bf16 (the default)": dict(),
    "int8": dict(quantize="int8"),
    "int4": dict(quantize="int4"),
    "fp32": dict(dtype="float32"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    print(cpu_header())
    print(f"{machine_load()} at the start")
    models = {name: tierlm.load(**kwargs) for name, kwargs in VARIANTS.items()}
    n = args.new_tokens
    calls = {
        name: (lambda m=m: m.generate(PROMPT, max_new_tokens=n, min_new_tokens=n).stats)
        for name, m in models.items()
    }
    results = interleave(calls, args.runs)
    default = median([s.decode_tokens_per_s for s in results["bf16 (the default)"].timed])
    rows = []
    for name, runs in results.items():
        decode = [s.decode_tokens_per_s for s in runs.timed]
        prefill = [s.prompt_tokens / s.prefill_seconds for s in runs.timed]
        rows.append(
            [
                name,
                f"{median(decode):.1f}",
                f"{spread(decode):.0%}",
                f"{median(decode) / default:.2f}x",
                f"{median(prefill):.0f}",
                " ".join(f"{x:.1f}" for x in decode),
            ]
        )
    headers = ["variant", "decode tok/s", "spread", "x default", "prefill tok/s", "runs decode tok/s"]
    print_table(headers, rows, f"eager, batch 1, {n} new tokens, median of {args.runs} interleaved runs")
    print(f"{machine_load()} at the end")


if __name__ == "__main__":
    main()
