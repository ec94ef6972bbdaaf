"""The compiled tierlm variants benchmarks/decode.py measures (weights x compile scope x how the step is
made), their spec strings, and the chat prompts: shared by decode.py and warm_start.py."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import default_model_file

QUESTIONS = [  # 37-47 tokens with the chat template, so batches are left-padded
    "Write a haiku about the sea.",
    "Write a haiku about the moon.",
    "Write a short poem about a forest at night.",
    "Describe the rain in one sentence.",
    "Write a haiku about winter snow falling on a quiet mountain village.",
    "Tell me a fun fact about the desert.",
    "Explain why autumn leaves change their colour, in simple words for a child.",
    "Name three animals that live in the ocean and say one thing about each of them.",
]
WEIGHTS, SCOPES = ("bf16", "int8", "int4"), ("model", "layer")  # SCOPES as tierlm.compile.SCOPES
VARIANTS = ",".join(f"{w}:{s}" for w in WEIGHTS for s in SCOPES)
# torch.compile in-process; an AOTInductor package; not compiled; torch.compile with inductor's C++ wrapper
KINDS = ("jit", "package", "eager", "cpp")


@dataclass(frozen=True)
class Variant:
    """A compiled tierlm: bf16 weights, or int8 / int4 ones with bf16 activations, x the compile scope;
    kind "package" loads (or builds) the step from a package store, "eager" is the same weights uncompiled."""

    weights: str
    scope: str
    kind: str = "jit"

    @property
    def name(self) -> str:
        if self.kind == "eager":
            return f"tierlm {self.weights} eager"
        return f"tierlm {self.weights} {self.scope}" + (
            f" {self.kind}" if self.kind in ("package", "cpp") else ""
        )

    @property
    def spec(self) -> str:
        return f"{self.weights}:{self.scope}" + (f":{self.kind}" if self.kind != "jit" else "")

    def prepare(self, model, store: str | None):
        """The model, set to load its compiled step from the package store when this is a package variant."""
        if self.kind == "package":
            model.use_compiled_packages(Path(store))
        return model

    def load(self):
        import tierlm

        quantize = None if self.weights == "bf16" else self.weights
        return tierlm.load(default_model_file(), dtype="bfloat16", quantize=quantize)

    def compile_config(self, mode: str | None):
        from tierlm import CompileConfig

        if self.kind == "eager":
            return None
        return CompileConfig(scope=self.scope, mode=mode, cpp_wrapper=True if self.kind == "cpp" else None)


def chat_prompts(tokenizer, batch: int) -> list[list[int]]:
    """Batch 1: the haiku prompt; larger batches: different questions, so rows are left-padded."""
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(batch)]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def parse_variants(text: str, p: argparse.ArgumentParser) -> list[Variant]:
    if text.strip() == "none":
        return []
    variants = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        weights, _, rest = spec.partition(":")
        scope, _, kind = rest.partition(":")
        kind = kind or "jit"
        if weights not in WEIGHTS or scope not in SCOPES or kind not in KINDS:
            p.error(
                f"unknown variant {spec!r}; use WEIGHTS:SCOPE[:KIND], WEIGHTS in {WEIGHTS}, SCOPE in {SCOPES}, "
                f"KIND in {KINDS}"
            )
        variants.append(Variant(weights, scope, kind))
    return list(dict.fromkeys(variants))
