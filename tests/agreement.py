"""Comparing the greedy generations of two code paths that round differently.

In fp32 two placements of the same kernels give the same tokens, and the tests say so exactly. Two
different kernels in bf16, or the int8/int4 weight-only kernels (fused vs split projections, grouped vs
SDPA attention, AVX2 vs AVX-512 micro-kernels), sum in different orders and round each layer's output to
8 significant bits: their logits differ by a few units in the last place of bf16 at the logits' scale,
and a greedy pick may flip wherever the two best logits are that close. So in reduced precision the
test is on logits: both paths agree within the dtype's tolerance at every step up to and including
the first step whose tokens differ; past it the two histories differ and nothing is compared. A flip
can only come from a near tie: if every logit agrees within d, a different argmax needs a top-2
margin of at most 2d.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest.mock import patch

import torch

import tierlm.generation.loop as loop

# Tolerance relative to the largest |logit| of the compared steps. bf16 keeps 8 significant bits, so one
# unit in the last place is 2^-8 of the value (0.125 for logits near 32). Measured on the default model
# (30 layers, logits up to 36) on an AVX2 CPU (Zen 3): grouped vs SDPA decode attention in bf16 differ by
# up to 0.69 (about 5 ulps; the top two logits tied exactly at step 20, where the tokens split); int8 and
# int4 resident vs half on disk differed by 0.0 there (the same kernels), which other CPUs need not
# repeat. 2^-5 is 8 ulps, 1.1 at 36: above the largest difference measured, while a real defect (a wrong
# mask, position or weight) moves logits by whole units. int8/int4 sum bf16 activations, so the same.
RELATIVE_TOLERANCE = {"bfloat16": 2**-5, "int8": 2**-5, "int4": 2**-5}


@dataclass
class Greedy:
    """Greedy tokens per row and the logits the sampler chose them from: [batch, steps, vocab]."""

    tokens: list[list[int]]
    logits: torch.Tensor


def greedy(model, prompts, **overrides) -> Greedy:
    """Run `model.generate` greedily, recording the (float32) logits of every step."""
    seen: list[torch.Tensor] = []
    real = loop.Sampler.__call__

    def spy(self, logits, *args, **kwargs):
        seen.append(logits.detach().float().cpu().clone())
        return real(self, logits, *args, **kwargs)

    with patch.object(loop.Sampler, "__call__", spy):
        result = model.generate(prompts, do_sample=False, **overrides)
    return Greedy(result.token_ids, torch.stack(seen, 1))


def assert_greedy_agrees(ref: Greedy, other: Greedy, precision: str) -> None:
    """fp32: the same tokens. bf16/int8/int4: logits within tolerance up to the first differing token."""
    if precision == "float32":
        assert other.tokens == ref.tokens
        return
    assert len(other.tokens) == len(ref.tokens)
    for row, (a, b) in enumerate(zip(ref.tokens, other.tokens)):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            assert len(a) == len(b), f"row {row}: same tokens but {len(a)} vs {len(b)} of them"
        upto = len(a) if first is None else first + 1
        la, lb = ref.logits[row, :upto], other.logits[row, :upto]
        finite = la.isfinite()
        assert torch.equal(finite, lb.isfinite()), f"row {row}: different tokens suppressed"
        tolerance = RELATIVE_TOLERANCE[precision] * la[finite].abs().max().item()
        diff = (la[finite] - lb[finite]).abs().max().item()
        where = "no token differs" if first is None else f"tokens differ from step {first}"
        assert diff <= tolerance, (
            f"row {row}: {precision} logits differ by {diff:.3f} > {tolerance:.3f} in the first {upto} "
            f"steps ({where})"
        )
