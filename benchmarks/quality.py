"""Perplexity and greedy top-1 agreement of the default model in fp32, bf16, int8 and int4.

    python benchmarks/quality.py
"""

from __future__ import annotations

from pathlib import Path

import tierlm
from tierlm.evaluate import next_token_logits, perplexity, top1_agreement

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity.txt"
VARIANTS = [
    ("fp32", dict(dtype="float32")),
    ("bf16", dict(dtype="bfloat16")),
    ("int8", dict(dtype="bfloat16", quantize="int8")),
    ("int4 (g32, from Q4_1 blocks)", dict(dtype="bfloat16", quantize="int4")),
    ("int4 g64", dict(dtype="bfloat16", quantize="int4", group_size=64)),
]


def main() -> None:
    text = TEXT.read_text()
    rows, ref, ref_ppl, ids = [], None, None, None
    for name, kwargs in VARIANTS:
        model = tierlm.load(**kwargs)
        ids = ids or model.tokenizer.encode(text)
        logits = next_token_logits(model, ids)
        ppl = perplexity(model, ids)
        if ref is None:
            ref, ref_ppl = logits, ppl
        rows.append((name, ppl, ppl / ref_ppl - 1, top1_agreement(ref, logits)))
    print(f"default model, {len(ids)} tokens of tests/data/perplexity.txt")
    print(f"{'variant':<30} {'perplexity':>10} {'vs fp32':>9} {'top-1 agree':>12}")
    for name, ppl, rel, agree in rows:
        print(f"{name:<30} {ppl:>10.3f} {rel:>+9.2%} {agree:>12.1%}")


if __name__ == "__main__":
    main()
