"""The engines benchmarks/decode.py times on the same prompt tokens: tierlm (eager or compiled),
transformers eager, llama.cpp (batch 1). Each gives a `Sample`: a one-token call and a full call."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import timed


@dataclass
class Sample:
    """One timed run of one engine: a one-token call (prefill) and a full call."""

    prefill_s: float
    total_s: float
    tokens: list[list[int]]  # new tokens per row
    loop_tok_s: float | None = None  # tierlm's own decode-loop timer, for reference


class TierlmEngine:
    def __init__(self, model, compile_config=None) -> None:
        self.model, self.compile_config = model, compile_config

    def _generate(self, rows: list[list[int]], n: int):
        return self.model.generate(
            rows,
            max_new_tokens=n,
            min_new_tokens=n,
            cache_implementation="static",
            compile_config=self.compile_config,
        )

    def sample(self, rows: list[list[int]], n: int) -> Sample:
        prefill_s, _ = timed(lambda: self._generate(rows, 1))
        total_s, r = timed(lambda: self._generate(rows, n))
        if self.compile_config is not None and not r.stats.compile.compile:
            raise SystemExit(f"tierlm did not compile the decode step: {r.stats.compile.explain()}")
        return Sample(prefill_s, total_s, r.token_ids, r.stats.decode_tokens_per_s)


class TransformersEngine:
    def __init__(self, model_file: Path, dtype: str, pad_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_file.parent, gguf_file=model_file.name, dtype=getattr(torch, dtype)
        ).eval()
        self.pad_id = pad_id

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=self.pad_id,
            )

    def sample(self, rows: list[list[int]], n: int) -> Sample:
        ids, mask = left_pad(rows, self.pad_id)
        prefill_s, _ = timed(lambda: self._generate(ids, mask, 1))
        total_s, out = timed(lambda: self._generate(ids, mask, n))
        return Sample(prefill_s, total_s, out[:, ids.shape[1] :].tolist())


class LlamaCppEngine:
    """llama-cpp-python on the same GGUF (Q4_1 kernels, so dtype does not apply); batch 1 only."""

    def __init__(self, model_file: Path, eos_ids: tuple[int, ...], context: int, threads: int) -> None:
        import numpy as np
        from llama_cpp import Llama, LogitsProcessorList

        self.llm = Llama(
            model_path=str(model_file),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=context,
            verbose=False,
        )
        eos = list(eos_ids)

        def suppress_eos(_ids, scores):  # force the full length, as min_new_tokens does elsewhere
            scores[eos] = -np.inf
            return scores

        wanted = dict(top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        accepted = inspect.signature(self.llm.generate).parameters
        self.options = {k: v for k, v in wanted.items() if k in accepted}
        self.options["logits_processor"] = LogitsProcessorList([suppress_eos])

    def sample(self, rows: list[list[int]], n: int) -> Sample:
        assert len(rows) == 1, "llama.cpp runs batch 1 only"
        self.llm.reset()  # else generate() reuses the KV cache of a matching prefix and skips prefill
        tokens, first = [], None
        start = time.perf_counter()
        for token in self.llm.generate(rows[0], **self.options):
            tokens.append(int(token))
            if first is None:
                first = time.perf_counter() - start
            if len(tokens) == n:
                break
        return Sample(first, time.perf_counter() - start, [tokens])


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def open_llama(model_file: Path, eos_ids, args) -> LlamaCppEngine | None:
    if 1 not in args.batches:
        return None
    try:
        import llama_cpp
    except ImportError:
        print("llama.cpp: not installed (make bench installs it)")
        return None
    threads = args.threads or 2
    print(f"llama.cpp: llama-cpp-python {llama_cpp.__version__}, threads: {threads}, batch 1 only")
    return LlamaCppEngine(model_file, tuple(eos_ids), 256 + args.new_tokens, threads)
