"""Perplexity and greedy top-1 agreement of the default model (or --model, a GGUF) in fp32, bf16, int8 and
int4, and llama.cpp's perplexity on the same GGUF and text (when llama-cpp-python is installed; `make bench`
installs it).

    python benchmarks/quality.py [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from common import MODEL_ENV, cpu_header, default_model_file, machine_load

import tierlm
from tierlm.evaluate import next_token_logits, perplexity, top1_agreement

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity.txt"
VARIANTS = [
    ("fp32", dict(dtype="float32")),
    ("bf16", dict(dtype="bfloat16")),
    ("int8", dict(dtype="bfloat16", quantize="int8")),
    ("int4 (g32 from Q4_0/Q4_1 blocks, else g64; head int8)", dict(dtype="bfloat16", quantize="int4")),
    ("int4 g64 (head int8)", dict(dtype="bfloat16", quantize="int4", group_size=64)),
    ("the default (load() with no arguments)", dict()),
]


def llama_cpp_perplexity(ids: list[int]) -> float | None:
    """llama.cpp's perplexity of the same token ids (its own kernels on the GGUF's own blocks)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    import numpy as np

    llm = Llama(str(default_model_file()), n_ctx=len(ids) + 8, logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # row t predicts token t + 1
    logits -= logits.max(-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -logprobs[np.arange(len(ids) - 1), ids[1:]].mean()
    return math.exp(nll)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    args = p.parse_args()
    if args.model:
        os.environ[MODEL_ENV] = str(Path(args.model).resolve())
    path = default_model_file()
    text = TEXT.read_text()
    rows, ref, ref_ppl, ids = [], None, None, None
    for name, kwargs in VARIANTS:
        model = tierlm.load(path, **kwargs)
        ids = ids or model.tokenizer.encode(text)
        logits = next_token_logits(model, ids)
        ppl = perplexity(model, ids)
        if ref is None:
            ref, ref_ppl = logits, ppl
        rows.append((f"tierlm {name}", ppl, ppl / ref_ppl - 1, f"{top1_agreement(ref, logits):.1%}"))
    peer = llama_cpp_perplexity(ids)
    if peer is None:
        rows.append(("llama.cpp: not installed (make bench installs it)", math.nan, math.nan, "-"))
    else:
        rows.append(("llama.cpp (its own kernels on the file's blocks)", peer, peer / ref_ppl - 1, "-"))
    print(cpu_header())
    print(f"{path.name}, {len(ids)} tokens of tests/data/perplexity.txt; {machine_load()}")
    print(f"{'variant':<60} {'perplexity':>10} {'vs fp32':>9} {'top-1 agree':>12}")
    for name, ppl, rel, agree in rows:
        print(f"{name:<60} {ppl:>10.3f} {rel:>+9.2%} {agree:>12}")


if __name__ == "__main__":
    main()
