"""Streaming decode: generated ids to text deltas that never end inside a UTF-8 character."""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer


class StreamDecoder:
    """Turns ids into text deltas that never end inside a UTF-8 character; deltas join to `decode(ids)`.

    `run_ids`: byte tokens a decoder turns into text a run at a time (SentencePiece byte fallback makes a
    whole run U+FFFD when any byte of it is invalid, rewriting bytes that were valid so far): text waits
    while the ids end in such a run."""

    def __init__(
        self,
        backend: BackendTokenizer,
        skip_special_tokens: bool = True,
        run_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._backend = backend
        self._skip_special = skip_special_tokens
        self._run_ids = run_ids
        self._ids: list[int] = []  # the window: ids[:read] were emitted, and decode as prefix text
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (often "", e.g. mid-character)."""
        self._ids.append(token_id)
        if token_id in self._run_ids:  # a byte run's text is known once a token other than a byte ends it
            return ""
        prefix_text = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        # A trailing U+FFFD is a character still waiting for its other bytes.
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        # Keep the just-emitted ids as the next prefix: decoding them with their context keeps spacing right.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Return whatever text is still held back (a broken character included) and reset."""
        prefix_text = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        self._ids, self._read = [], 0
        return text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
