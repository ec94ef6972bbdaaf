"""Logits processors and next-token sampling as pure tensor functions.

Logits are [batch, vocab] of any float dtype; every function computes and returns float32. The
semantics are those of the matching Hugging Face transformers processor. Nothing here reads a tensor
back to the host, loops over batch or vocab in Python, or changes a shape, so a decode step that
calls these functions compiles into one graph. Hyperparameters are Python numbers: torch.compile
treats them as constants, and a value that disables a filter (top_k=0, top_p=1, min_p=0) skips it.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def mark_seen(seen: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Set seen[b, t] for the tokens [batch] or [batch, n] in place; returns seen."""
    return seen.scatter_(1, tokens.reshape(seen.shape[0], -1), True)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalize tokens already seen (prompt and output): negative scores * penalty, others / penalty."""
    logits = logits.float()
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def suppress_tokens(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set the scores of token_ids (a LongTensor on logits' device) to -inf, e.g. EOS before min_new_tokens."""
    return logits.float().index_fill(-1, token_ids, _NEG_INF)


def suppress_where(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """Set the scores that `banned` (bool, broadcast to logits) marks to -inf: a row's own tokens, e.g. its EOS
    and stop_token_ids before its min_new_tokens."""
    return logits.float().masked_fill(banned, _NEG_INF)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide by temperature (> 0); temperature 0 is greedy decoding, handled by sample_next."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest scores (and any tied with the k-th); k=0 keeps all."""
    logits = logits.float()
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, _NEG_INF)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to >= p (at least one)."""
    logits = logits.float()
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cumulative <= 1 - p
    sorted_remove[..., -1:] = False  # the most likely token always stays
    remove = sorted_remove.scatter(-1, order, sorted_remove)
    return logits.masked_fill(remove, _NEG_INF)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's (which always stays)."""
    logits = logits.float()
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    # min_p <= 1, so the most likely token is never below the threshold: at least one stays
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(remove, _NEG_INF)


def warp_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, in transformers' order; returns float32 scores."""
    logits = apply_temperature(logits, temperature)
    logits = top_k_filter(logits, top_k)
    logits = top_p_filter(logits, top_p)
    return min_p_filter(logits, min_p)


def exponential_noise(like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Exponential(1) noise of like's shape in float32, drawn from generator (else the global RNG)."""
    return torch.empty(like.shape, dtype=torch.float32, device=like.device).exponential_(
        1, generator=generator
    )


def sample_next(
    logits: torch.Tensor,
    *,
    greedy: bool,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """The next token per row, LongTensor[batch]: argmax when greedy (or temperature 0), else a draw.

    A draw takes argmax(probs / noise) with Exponential(1) noise, which picks token i with
    probability probs[i] without a device sync. torch.compile cannot trace a torch.Generator: inside a
    compiled step pass generator=None (global RNG) or noise drawn outside with exponential_noise().
    """
    if greedy or temperature == 0:
        return logits.argmax(dim=-1)
    probs = warp_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).softmax(-1)
    if noise is None:
        noise = exponential_noise(probs, generator)
    # exponential_ may return exactly 0, and 0 / 0 = NaN would win the argmax for a filtered token
    noise = noise.clamp_min(torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


# --- per-row settings: each row of a batch carries its own hyperparameters as [batch, 1] tensors ----------------


def apply_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: logit - frequency * count - presence * (count > 0).

    counts [batch, vocab] says how often each token was generated so far (not the prompt);
    presence and frequency are [batch, 1].
    """
    return logits.float() - frequency * counts - presence * (counts > 0).float()


def apply_repetition_penalty_rows(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """apply_repetition_penalty with a [batch, 1] penalty per row (1 leaves a row alone)."""
    logits = logits.float()
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def warp_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    cut: bool | None = None,
    floor: bool | None = None,
) -> torch.Tensor:
    """warp_logits with [batch, 1] settings per row: top_k 0, top_p 1 and min_p 0 disable their filter.
    `cut` / `floor`: whether any row filters by top-k or top-p / by min-p, when the caller knows (read
    from the tensors otherwise, a device sync on an accelerator).

    The vocabulary is sorted once, ascending, and only when some row filters by top-k or top-p: the k-th
    largest score is read from that order, and the scores top-k drops are the smallest, so masking them in
    place leaves the same values in the same order as sorting the filtered scores again, which top-p
    reads, up to the order of equal scores: where equal scores straddle the top-p cut, which of them stays
    may differ from transformers' (whose second, unstable sort orders them its own way); the kept
    probabilities are the same. A sort of 49152 scores costs ~2 ms a row on a 2-core CPU (Zen 3), so two sorts made sampling
    cost half of a 16-row decode step. Rows that only set a temperature (OpenAI's defaults) sort nothing:
    top_p 1 would only drop tokens whose probability is already exactly 0.
    """
    logits = logits.float() / temperature
    if cut is None:
        cut = bool((top_k > 0).any()) or bool((top_p < 1).any())
    if floor is None:
        floor = bool((min_p > 0).any())
    if cut:
        vocab = logits.shape[-1]
        ascending, order = logits.sort(dim=-1)
        kth = ascending.gather(-1, (vocab - top_k).clamp(0, vocab - 1))
        ascending = ascending.masked_fill((top_k > 0) & (ascending < kth), _NEG_INF)
        tail = (1 - top_p.double()).float()  # 1 - 0.9 in double, then rounded: transformers' threshold
        remove = ascending.isneginf() | (ascending.softmax(dim=-1).cumsum(dim=-1) <= tail)
        remove[..., -1:] = False  # the most likely token always stays
        logits = logits.masked_fill(remove.scatter(-1, order, remove), _NEG_INF)
    if floor:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), _NEG_INF)
    return logits


def draw(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) with Exponential(1) noise: token i with probability probs[i]."""
    return (probs / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax of the raw float32 logits [..., vocab]: the chosen tokens' values [...] and the `top`
    most likely tokens' values and ids [..., top], most likely first."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    values, ids = logprobs.topk(top, dim=-1) if top > 0 else (logprobs[..., :0], tokens[..., None][..., :0])
    return chosen, values, ids


def token_ranks(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each token's rank among the logits [..., vocab] (1: the most likely; tied tokens share a rank)."""
    logits = logits.float()
    chosen = logits.gather(-1, tokens.unsqueeze(-1))
    return (logits > chosen).sum(dim=-1) + 1
