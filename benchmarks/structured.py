"""What structured output costs: decode tok/s with and without a JSON schema, interleaved, on this CPU.

    python benchmarks/structured.py [--runs 5] [--batch 1,8] [--new-tokens 128]

The question it answers (issue 14, target <= 15%): how much of the default model's decode speed does the
grammar mask take? Both contenders sample (temperature 1.0) from the same chat prompt; the free run is held
to --new-tokens, the constrained one ends where its document ends (a rate, not a length, is compared).
"grammar ms/step" is the time inside GrammarMask.apply and .advance per decode step of the batch.
"""

from __future__ import annotations

import argparse
import time

from common import contention_warning, cpu_header, interleave, machine_load, median, print_table, spread

import tierlm
from tierlm.generation.grammar import GrammarMask

# Long documents: a list of up to 24 records with bounded strings, enums and nested objects.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "people": {
            "type": "array",
            "maxItems": 24,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "role": {"enum": ["admin", "editor", "viewer"]},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 24}},
                        "required": ["city"],
                    },
                },
                "required": ["name", "role", "age", "address"],
            },
        },
    },
    "required": ["title", "people"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "team", "schema": SCHEMA}}
ASK = "List the members of a large software team as JSON, with name, role, age and city for each."


class GrammarClock:
    """Adds up the seconds spent in GrammarMask.apply and .advance (wrapped for this process)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("apply", "advance"):
            setattr(GrammarMask, name, self._timed(getattr(GrammarMask, name)))

    def _timed(self, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    print(cpu_header())
    print(f"{machine_load()} at the start")
    if (warning := contention_warning()) is not None:
        print(warning)
    model = tierlm.load()
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": ASK}])
    clock = GrammarClock()
    n = args.new_tokens

    def run(batch: int, fmt):
        stats = model.generate(
            [prompt] * batch,
            max_new_tokens=n,
            min_new_tokens=0 if fmt else n,
            do_sample=True,
            temperature=1.0,
            response_format=fmt,
        ).stats
        return stats, clock.take()

    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        results = interleave(
            {"free": lambda b=batch: run(b, None), "schema": lambda b=batch: run(b, FORMAT)}, args.runs
        )
        free = median([s.decode_tokens_per_s for s, _ in results["free"].timed])
        for name, runs in results.items():
            rates = [s.decode_tokens_per_s for s, _ in runs.timed]
            per_step = [g / max(s.new_tokens / batch, 1) * 1e3 for s, g in runs.timed]
            tokens = median([s.new_tokens / batch for s, _ in runs.timed])
            cost = 1 - median(rates) / free
            rows.append(
                [
                    str(batch),
                    name,
                    f"{median(rates):.1f}",
                    f"{spread(rates):.0%}",
                    "-" if name == "free" else f"{cost:.1%}",
                    f"{median(per_step):.2f}",
                    f"{tokens:.0f}",
                ]
            )
    headers = ["batch", "run", "decode tok/s", "spread", "cost", "grammar ms/step", "tokens/row"]
    print_table(
        headers, rows, f"sampled decode, median of {args.runs} interleaved runs (target: cost <= 15%)"
    )
    print(f"{machine_load()} at the end")


if __name__ == "__main__":
    main()
