"""Text <-> token ids from an HF tokenizer folder or GGUF metadata, chat templates, streaming decode."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# Pre-tokenizer regexes in their tokenizer.json spelling; llama.cpp runs adapted copies of these.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> the regexes llama.cpp applies in turn (llm_tokenizer_bpe in llama-vocab.cpp);
# each one splits the pieces the previous one left, keeping matches and gaps alike.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **dict.fromkeys(("gpt2", "mpt", "olmo", "jais", "trillion"), (_GPT2,)),
    # smollm: every digit on its own first, like SmolLM2's tokenizer.json `Digits(individual_digits=True)`.
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), (r"\p{N}", _GPT2)
    ),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), (_QWEN2,)),
}
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3"})

# llama.cpp token types (tokenizer.ggml.token_type).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


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
                raise ValueError(f"special token ids must be non-negative ints, got {token_id!r}")

    def check_within(self, vocab_size: int) -> None:
        """Raise if any id falls outside a vocabulary of `vocab_size` tokens."""
        for token_id in (self.bos_id, self.pad_id, self.unk_id, *self.eos_ids):
            if token_id is not None and token_id >= vocab_size:
                raise ValueError(f"special token id {token_id} is outside the {vocab_size}-token vocabulary")


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
            raise ValueError("add_bos is set but the tokenizer has no bos token")
        self._backend = backend
        self._special = special
        self._add_bos = add_bos
        self._chat_template = chat_template
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load an HF tokenizer folder: tokenizer.json, tokenizer_config.json, generation_config.json."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "special_tokens_map.json") | _read_json(folder / "tokenizer_config.json")
        special = _special_from_config(backend, config, _read_json(folder / "generation_config.json"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # no flag: the post-processor in tokenizer.json decides, as in transformers
            add_bos = special.bos_id is not None and backend.encode("").ids[:1] == [special.bos_id]
        return cls(backend, special, bool(add_bos), _chat_template_from_dir(folder, config))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        meta = _read_gguf_metadata(Path(path))
        kind = meta.get("tokenizer.ggml.model")
        if kind is None or "tokenizer.ggml.tokens" not in meta:
            raise ValueError(
                f"{path} has no tokenizer metadata (tokenizer.ggml.model, tokenizer.ggml.tokens)"
            )
        builder = _GGUF_BUILDERS.get(kind)
        if builder is None:
            supported = ", ".join(sorted(_GGUF_BUILDERS))
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} in {path}; supported: {supported}")
        backend = builder(meta)
        _add_gguf_added_tokens(backend, meta)
        special = SpecialTokens(
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_ids=tuple(dict.fromkeys(meta[key] for key in _EOS_KEYS if key in meta)),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"),
            unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
        )
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        return cls(backend, special, add_bos, meta.get("tokenizer.chat_template"))

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
        return self._with_bos(self._backend.encode(text, add_special_tokens=False).ids, add_special_tokens)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for many texts at once (parallel in the Rust backend)."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        return [self._with_bos(e.ids, add_special_tokens) for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A decoder that turns generated ids into text deltas, one id at a time."""
        return StreamDecoder(self._backend, skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the model's chat template, as transformers does."""
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled is None:
            self._compiled = compile_chat_template(self._chat_template)
        chat = [{key: value for key, value in m.items() if value is not None} for m in messages]
        context = {**self._template_tokens(), **extra, "add_generation_prompt": add_generation_prompt}
        try:
            return self._compiled.render(messages=chat, **context)
        except _TemplateRaised as err:
            raise ValueError(f"chat template raised an error: {err.message}") from err
        except jinja2.TemplateError as err:
            raise ValueError(f"chat template failed to render: {err}") from err

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


class StreamDecoder:
    """Turns ids into text deltas that never end inside a UTF-8 character; deltas join to `decode(ids)`."""

    def __init__(self, backend: BackendTokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []  # the window: ids[:read] were emitted, and decode as prefix text
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (often "", e.g. mid-character)."""
        self._ids.append(token_id)
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


# --- chat templates ---------------------------------------------------------------------------


class _TemplateRaised(jinja2.TemplateError):
    """The template called raise_exception()."""


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` and render the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: no HTML escaping (unlike jinja's), non-ASCII kept.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers renders them in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"chat template does not compile: line {err.lineno}: {err.message}") from err


# --- HF folders -------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _special_from_config(backend: BackendTokenizer, config: dict, generation: dict) -> SpecialTokens:
    def id_of(name: str, required: bool) -> int | None:
        content = _token_content(config.get(name))
        token_id = backend.token_to_id(content) if content is not None else None
        if content is not None and token_id is None and required:
            raise ValueError(f"{name} {content!r} from tokenizer_config.json is not in the vocabulary")
        return token_id

    extra_eos = generation.get("eos_token_id")
    extra_eos = extra_eos if isinstance(extra_eos, list) else [extra_eos]
    eos = tuple(dict.fromkeys(i for i in (id_of("eos_token", True), *extra_eos) if i is not None))
    pad = id_of("pad_token", False)
    return SpecialTokens(
        bos_id=id_of("bos_token", True),
        eos_ids=eos,
        pad_id=pad if pad is not None else generation.get("pad_token_id"),
        unk_id=id_of("unk_token", False),
    )


def _chat_template_from_dir(folder: Path, config: dict) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():  # transformers prefers the separate file
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default", next(iter(named.values()), None))
    return template


# --- GGUF -------------------------------------------------------------------------------------


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The `tokenizer.*` metadata of a GGUF file as plain Python values."""
    from gguf import GGUFReader  # reading maps the whole file; keep it off the import path

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, OSError) as err:
        raise ValueError(f"cannot read {path} as GGUF: {err}") from err
    return {
        name: _field_value(field) for name, field in reader.fields.items() if name.startswith("tokenizer.")
    }


def _field_value(field: Any) -> Any:
    from gguf import GGUFValueType

    def scalar(part: Any) -> Any:
        if field.types[-1] == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0]

    values = [scalar(field.parts[i]) for i in field.data]
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]


def _byte_level_backend(meta: dict[str, Any]) -> BackendTokenizer:
    """GPT-2 style byte-level BPE with the pre-tokenizer named by `tokenizer.ggml.pre`."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(sorted(_PRE_SPLITS))}"
        )
    vocab = {token: i for i, token in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(meta: dict[str, Any]) -> BackendTokenizer:
    """llama/SentencePiece BPE: merges ranked by score, `<0xNN>` byte fallback, "▁" for spaces."""
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=_merges_from_scores(tokens, scores),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        byte_fallback=True,
        fuse_unk=True,
    )
    backend = BackendTokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    scheme = "first" if prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best merged score first (SentencePiece BPE order)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score in dict(zip(tokens, scores)).items():
        pairs = [
            (token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab
        ]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, left, right) for left, right in pairs)
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable, as in transformers
    return [(left, right) for _, left, right in ranked]


def _add_gguf_added_tokens(backend: BackendTokenizer, meta: dict[str, Any]) -> None:
    """Control and unknown tokens become special; user-defined ones are matched whole but not special."""
    tokens, token_types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type", ())
    special = [t for t, kind in zip(tokens, token_types) if kind in (_UNKNOWN, _CONTROL)]
    plain = [t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])


_GGUF_BUILDERS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}
