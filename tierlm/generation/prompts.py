"""Prompts in: text or token ids checked and encoded, and the log probabilities of prompt tokens."""

from __future__ import annotations

import operator

import torch

from tierlm.errors import RequestError
from tierlm.generation.loop import TokenLogprob
from tierlm.generation.sampling import token_logprobs, token_ranks


def encode_prompts(tokenizer, prompts) -> list[list[int]]:
    """A string, a list of strings, or token ids: a LongTensor of shape [seq] or [batch, seq], a list of
    ints (one prompt) or a list of lists of ints."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dtype not in (torch.long, torch.int32) or prompts.dim() not in (1, 2):
            raise RequestError("token-id prompts must be a LongTensor of shape [seq] or [batch, seq]")
        if prompts.numel() == 0:
            raise RequestError("empty prompt: every prompt needs at least one token")
        rows = prompts.reshape(-1, prompts.shape[-1]).tolist()
    elif isinstance(prompts, str):
        rows = [_encode(tokenizer, prompts)]
    elif isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts):
        rows = [_encode(tokenizer, p) for p in prompts]
    elif isinstance(prompts, list) and prompts and all(isinstance(p, list) for p in prompts):
        rows = [_token_ids(p, r) for r, p in enumerate(prompts)]
    elif isinstance(prompts, list) and prompts and not any(isinstance(p, (str, list)) for p in prompts):
        rows = [_token_ids(prompts, 0)]
    else:
        raise RequestError(
            "prompts must be a string, a non-empty list of strings, token ids (a list of ints, or one list "
            "of ints per prompt) or a LongTensor of token ids"
        )
    if any(len(r) == 0 for r in rows):
        raise RequestError("empty prompt: every prompt needs at least one token")
    return rows


def _token_ids(row: list, r: int) -> list[int]:
    """A prompt's token ids as ints; anything that is not an integer (1.5, "1", True) is one error (int()
    would truncate or parse it into some other prompt)."""
    out = []
    for i in row:
        try:
            if isinstance(i, bool):
                raise TypeError
            out.append(operator.index(i))
        except TypeError:
            raise RequestError(
                f"prompt {r} has {i!r} ({type(i).__name__}) where a token id (an int) goes"
            ) from None
    return out


def check_ids(rows: list[list[int]], vocab: int) -> None:
    """Token ids in [0, vocab), else one ValueError naming the first that is not (the embedding would
    raise an IndexError from inside torch)."""
    for r, row in enumerate(rows):
        bad = next((i for i in row if not 0 <= i < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt {r} has token id {bad}; this model's ids are in [0, {vocab})")


def check_vocab_settings(configs, vocab: int) -> None:
    """Settings that name token ids or count them fit the vocabulary (else errors from inside torch)."""
    for c in configs:
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(c, name) or 0) > vocab:
                raise RequestError(f"{name} must be <= the vocabulary size {vocab}, got {getattr(c, name)}")
        named = {"logit_bias": [i for i, _ in c.logit_bias], "stop_token_ids": c.stop_token_ids}
        named["allowed_token_ids"] = c.allowed_token_ids or ()
        for name, ids in named.items():
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise RequestError(f"{name} names token id {bad}; this model's ids are in [0, {vocab})")


def _encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise RequestError("text prompts need a tokenizer; this model has none (pass token ids)")
    if not text:
        raise RequestError("empty prompt: every prompt needs at least one token")
    return tokenizer.encode(text)


class PromptLogprobs:
    """Collects, chunk by chunk of a prefill, each prompt token's log probability given those before it."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, top: int) -> None:
        self.ids, self.mask, self.top = ids, mask, top
        self.parts: list[tuple[list, list, list, list]] = []

    def add(self, logits: torch.Tensor, start: int) -> None:
        """logits [b, chunk, vocab] of columns start.. predict the tokens one column later."""
        end = min(start + logits.shape[1], self.ids.shape[1] - 1)
        if end <= start:
            return
        logits, targets = logits[:, : end - start], self.ids[:, start + 1 : end + 1]
        chosen, values, ids = token_logprobs(logits, targets, self.top)
        ranks = token_ranks(logits, targets)
        self.parts.append((chosen.tolist(), values.tolist(), ids.tolist(), ranks.tolist()))

    def rows(self, wanted: list[int | None]) -> list[list[TokenLogprob | None]]:
        out = []
        width = self.ids.shape[1]
        for row, n in enumerate(wanted):
            chosen = [v for part in self.parts for v in part[0][row]]
            values = [v for part in self.parts for v in part[1][row]]
            top_ids = [v for part in self.parts for v in part[2][row]]
            ranks = [v for part in self.parts for v in part[3][row]]
            first = width - int(self.mask[row].sum())  # left padding
            entries: list[TokenLogprob | None] = [None]
            for col in range(first + 1, width):
                top = list(zip(top_ids[col - 1][: n or 0], values[col - 1][: n or 0]))
                entries.append(TokenLogprob(int(self.ids[row, col]), chosen[col - 1], top, ranks[col - 1]))
            out.append(entries if n is not None else None)
        return out
