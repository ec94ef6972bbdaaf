"""vLLM's `bad_words`: words a row may not write, as vLLM bans them.

Each word is tokenized as it is (left-stripped) and, where that gives another first token of the same count,
with a leading space (a word at the start of the text and one inside it); a row may not sample a sequence's
last token right after its other tokens, which are matched against the row's generated tokens only (a
one-token word is never sampled). Rows without bad words cost nothing.
"""

from __future__ import annotations

import torch


def word_sequences(tokenizer, words: tuple[str, ...]) -> list[tuple[int, ...]]:
    """The token sequences `words` ban, as vLLM tokenizes them."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out += [plain] if plain else []
        if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


class BadWords:
    """Per row: the sequences it may not complete and the tokens it generated so far."""

    def __init__(self, tokenizer, rows: int) -> None:
        self.tokenizer = tokenizer
        self.sequences: list[list[tuple[int, ...]]] = [[] for _ in range(rows)]
        self.history: list[list[int]] = [[] for _ in range(rows)]
        self._cache: dict[tuple[str, ...], list[tuple[int, ...]]] = {}

    def set_row(self, row: int, words: tuple[str, ...]) -> None:
        if words and words not in self._cache:
            self._cache[words] = word_sequences(self.tokenizer, words)
        self.sequences[row] = self._cache[words] if words else []
        self.history[row] = []

    @property
    def active(self) -> bool:
        return any(self.sequences)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits [len(rows), vocab] with each row's banned next tokens at -inf (a new tensor)."""
        at, banned = [], []
        for i, row in enumerate(rows):
            history = self.history[row]
            for seq in self.sequences[row]:
                n = len(seq) - 1
                if n == 0 or (len(history) >= n and tuple(history[-n:]) == seq[:-1]):
                    at.append(i)
                    banned.append(seq[-1])
        if not at:
            return logits
        index = (torch.tensor(at, device=logits.device), torch.tensor(banned, device=logits.device))
        return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))

    def advance(self, rows: list[int], tokens: list[int]) -> None:
        for row, token in zip(rows, tokens):
            if self.sequences[row]:
                self.history[row].append(token)
