"""Quality checks on a fixed text: perplexity and greedy top-1 agreement between two models."""

from __future__ import annotations

import math

import torch


@torch.inference_mode()
def next_token_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids) - 1, vocab] in fp32, predicting each token from the ones before it."""
    x = torch.tensor([ids], device=model.device)
    return model.decoder(x)[0, :-1].float()


def perplexity(model, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given their prefixes, in one full-sequence forward."""
    logits = next_token_logits(model, ids)
    target = torch.tensor(ids[1:], device=logits.device)
    return math.exp(torch.nn.functional.cross_entropy(logits, target).item())


def top1_agreement(logits_a: torch.Tensor, logits_b: torch.Tensor) -> float:
    """Fraction of positions where two models' greedy next tokens agree."""
    return (logits_a.argmax(-1) == logits_b.argmax(-1)).float().mean().item()
