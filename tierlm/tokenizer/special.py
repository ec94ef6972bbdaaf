"""The ids of a model's special tokens (bos, eos, pad, unk)."""

from __future__ import annotations

from dataclasses import dataclass

from tierlm.errors import ModelFileError


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens a model uses; any may be missing (None / empty)."""

    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None
    unk_id: int | None = None

    def __post_init__(self) -> None:
        for token_id in (self.bos_id, self.pad_id, self.unk_id, *self.eos_ids):
            if token_id is not None and (not isinstance(token_id, int) or token_id < 0):
                raise ModelFileError(f"special token ids must be non-negative ints, got {token_id!r}")

    def check_within(self, vocab_size: int) -> None:
        """Raise if any id falls outside a vocabulary of `vocab_size` tokens."""
        for token_id in (self.bos_id, self.pad_id, self.unk_id, *self.eos_ids):
            if token_id is not None and token_id >= vocab_size:
                raise ModelFileError(
                    f"special token id {token_id} is outside the {vocab_size}-token vocabulary"
                )
