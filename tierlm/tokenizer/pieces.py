"""The raw bytes of one token, as llama.cpp's token_to_piece gives them: what OpenAI's logprobs report in
`bytes` (and legacy completions as "bytes:\\x.." for a token that is not whole UTF-8). Decoding one token
alone gives U+FFFD for a token inside a character; its bytes come from the vocabulary entry instead."""

from __future__ import annotations

import functools
import json
import re

from tokenizers import Tokenizer as BackendTokenizer


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, every other byte
    for the character 256 + its rank among those others. Character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


BYTE_LEVEL = _byte_level_table()
FALLBACK_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Pieces:
    """Token id -> bytes for one backend: byte-level BPE, SentencePiece (U+2581 for a space, <0xNN> byte
    fallback) or, for a decoder of another kind, the token's decoded text."""

    def __init__(self, backend: BackendTokenizer) -> None:
        self.backend = backend
        self.added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        decoder = backend.decoder
        state = json.loads(decoder.__getstate__()) if decoder is not None else {}
        kinds = {d.get("type") for d in state.get("decoders", [state])}
        if "ByteLevel" in kinds:
            self.kind = "byte_level"
        elif kinds & {"ByteFallback", "Metaspace", "Replace"}:
            self.kind = "sentencepiece"
        else:
            self.kind = "text"

    @functools.cached_property
    def fallback_ids(self) -> frozenset[int]:
        """The <0xNN> byte tokens of a SentencePiece vocabulary with byte fallback (empty otherwise): its
        decoder turns a run of them into text as a whole (all U+FFFD when any byte is invalid)."""
        if self.kind != "sentencepiece":
            return frozenset()
        vocab = self.backend.get_vocab(with_added_tokens=False)
        return frozenset(i for piece, i in vocab.items() if FALLBACK_BYTE.fullmatch(piece))

    def __call__(self, token_id: int) -> bytes:
        if token_id in self.added:  # special and added tokens: their text
            return self.added[token_id].encode("utf-8")
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self.kind == "byte_level" and all(c in BYTE_LEVEL for c in piece):
            return bytes(BYTE_LEVEL[c] for c in piece)
        if self.kind == "sentencepiece":
            fallback = FALLBACK_BYTE.fullmatch(piece)
            return bytes([int(fallback[1], 16)]) if fallback else piece.replace("\u2581", " ").encode("utf-8")
        return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")


def piece_text(raw: bytes) -> str:
    """A token's text for logprobs: its UTF-8 when whole, else OpenAI's "bytes:\\xNN.." form (distinct per
    token, where decoding would give each the same U+FFFD)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
