"""The Tokenizer: text <-> token ids from an HF tokenizer folder or GGUF metadata, chat rendering, streaming."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as BackendTokenizer

from tierlm.errors import ModelFileError, RequestError
from tierlm.tokenizer.chat import TemplateRaised, compile_chat_template
from tierlm.tokenizer.gguf_vocab import read_gguf_vocabulary
from tierlm.tokenizer.hf_folder import read_hf_folder
from tierlm.tokenizer.pieces import Pieces
from tierlm.tokenizer.special import SpecialTokens
from tierlm.tokenizer.stream import StreamDecoder


class Tokenizer:
    """Encodes and decodes text for one model; wraps a `tokenizers.Tokenizer`."""

    def __init__(
        self,
        backend: BackendTokenizer,
        special: SpecialTokens,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        backend.no_padding()
        backend.no_truncation()
        special.check_within(backend.get_vocab_size(with_added_tokens=True))
        if add_bos and special.bos_id is None:
            raise ModelFileError("add_bos is set but the tokenizer has no bos token")
        self._backend = backend
        self._special = special
        self._add_bos = add_bos
        self._chat_template = chat_template
        self._compiled: jinja2.Template | None = None
        self._pieces: Pieces | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load an HF tokenizer folder: tokenizer.json, tokenizer_config.json, generation_config.json."""
        backend, special, add_bos, chat_template = read_hf_folder(Path(path))
        return cls(backend, special, add_bos, chat_template)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        backend, special, add_bos, chat_template = read_gguf_vocabulary(Path(path))
        return cls(backend, special, add_bos, chat_template)

    @property
    def backend(self) -> BackendTokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def bos_token_id(self) -> int | None:
        return self._special.bos_id

    @property
    def special(self) -> SpecialTokens:
        return self._special

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._special.eos_ids

    @property
    def pad_token_id(self) -> int | None:
        """The pad token, or the first eos token when the model names none."""
        if self._special.pad_id is not None:
            return self._special.pad_id
        return self._special.eos_ids[0] if self._special.eos_ids else None

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS is prepended when the model wants it and `add_special_tokens`."""
        _check_text(text)
        return self._with_bos(self._backend.encode(text, add_special_tokens=False).ids, add_special_tokens)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for many texts at once (parallel in the Rust backend)."""
        for text in texts:
            _check_text(text)
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        return [self._with_bos(e.ids, add_special_tokens) for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def pieces(self) -> Pieces:
        if self._pieces is None:
            self._pieces = Pieces(self._backend)
        return self._pieces

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a token inside a multi-byte character has part of its bytes; its
        decoded text alone would be U+FFFD)."""
        return self.pieces(token_id)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A decoder that turns generated ids into text deltas, one id at a time."""
        return StreamDecoder(self._backend, skip_special_tokens, self.pieces.fallback_ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render `messages` with the model's chat template (or `chat_template`, a template's source), as
        transformers does: `tools` and `documents` are None unless given; `continue_final_message` ends the
        text inside the last message (for the model to continue it) instead of after its end-of-turn."""
        if chat_template is None and self._chat_template is None:
            raise RequestError("this tokenizer has no chat template")
        if not messages:
            raise RequestError("messages is empty: a chat needs at least one message")
        if continue_final_message and add_generation_prompt:
            raise RequestError(
                "continue_final_message continues the last message: add_generation_prompt must be False"
            )
        if chat_template is not None:
            template = _compiled_template(chat_template)
        else:
            if self._compiled is None:
                self._compiled = compile_chat_template(self._chat_template)
            template = self._compiled
        chat = [{key: value for key, value in m.items() if value is not None} for m in messages]
        if continue_final_message:  # a mark after the last text, to cut the rendered chat at
            chat[-1] = _marked(chat[-1])
        context = {
            "tools": None,
            "documents": None,
            **self._template_tokens(),
            **extra,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = template.render(messages=chat, **context)
        except TemplateRaised as err:
            raise RequestError(f"chat template raised an error: {err.message}") from err
        except (jinja2.TemplateError, TypeError) as err:  # e.g. list content a template adds to a string
            raise RequestError(f"chat template failed to render: {err}") from err
        if not continue_final_message:
            return text
        if text.count(CONTINUE_MARK) != 1:
            raise RequestError(
                "continue_final_message: the chat template does not render the final message's text"
            )
        return text[: text.index(CONTINUE_MARK)]

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self._add_bos:
            return [self._special.bos_id, *ids]  # type: ignore[list-item]
        return list(ids)

    def _template_tokens(self) -> dict[str, str]:
        """The special tokens transformers hands every template, as strings (pad: only a real one)."""
        s = self._special
        ids = {
            "bos_token": s.bos_id,
            "eos_token": (*s.eos_ids, None)[0],
            "pad_token": s.pad_id,
            "unk_token": s.unk_id,
        }
        return {name: self._backend.id_to_token(i) for name, i in ids.items() if i is not None}


CONTINUE_MARK = "\x00tierlm:continue\x00"  # no template trims it, no text holds it


def _marked(final: dict[str, Any]) -> dict[str, Any]:
    """The final message with CONTINUE_MARK after its text (after its last text part for a list), so the
    rendered chat is cut right there: what a template adds after the message goes, and trailing spaces of
    the text stay (as transformers marks and cuts it)."""
    content = final.get("content", "")
    if isinstance(content, list):
        last = max(
            (i for i, p in enumerate(content) if isinstance(p, dict) and p.get("type") == "text"),
            default=None,
        )
        if last is None:
            raise RequestError("continue_final_message: the final message has no text part to continue")
        parts = [*content]
        parts[last] = {**parts[last], "text": parts[last].get("text", "") + CONTINUE_MARK}
        return {**final, "content": parts}
    return {**final, "content": str(content) + CONTINUE_MARK}


def _check_text(text) -> None:
    """A ValueError naming the problem where `text` is not a str of valid Unicode: Python reads undecodable
    bytes (a prompt on stdin or in argv that is not UTF-8) as lone surrogates, which no tokenizer takes."""
    if not isinstance(text, str):
        raise RequestError(f"text to encode must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"text is not valid UTF-8: character {e.start} is {text[e.start]!r} (bytes that are not UTF-8?)"
        ) from None


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> jinja2.Template:
    """A chat template given with a call (a server request's), compiled once for its next uses."""
    return compile_chat_template(source)
