"""A GGUF file's `tokenizer.*` metadata converted to a `tokenizers` backend (byte-level BPE or
SentencePiece-style BPE), the way llama.cpp reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from tierlm.errors import ModelFileError
from tierlm.tokenizer.special import SpecialTokens

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
    **dict.fromkeys(("gpt-2", "phi-2", "gpt2", "mpt", "olmo", "jais", "trillion"), (_GPT2,)),
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

# What ends generation, as llama.cpp decides it (llama-vocab.cpp, checked against llama-cpp-python 0.3.36):
# the tokens of these texts, whatever their type, one fill-in-the-middle pad, repo and file-separator token
# each (its key, else the first of these texts), and the eos / eot / eom ids.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    }
)  # fmt: skip
_FIM_EOG = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": (
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}
# A byte-level BPE vocabulary adds BOS where it does not say (tokenizer.ggml.add_bos_token) for these
# pre-tokenizers only, as llama.cpp's defaults do; a sentencepiece one always.
_BPE_ADDS_BOS = frozenset(
    {
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "tekken",
        "chameleon",
    }
)


def read_gguf_vocabulary(path: Path) -> tuple[BackendTokenizer, SpecialTokens, bool, str | None]:
    """The backend, special tokens, whether to add BOS, and the chat template a GGUF file describes."""
    meta = _read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise ModelFileError(
            f"{path} has no tokenizer metadata (tokenizer.ggml.model, tokenizer.ggml.tokens)"
        )
    builder = _GGUF_BUILDERS.get(kind)
    if builder is None:
        supported = ", ".join(sorted(_GGUF_BUILDERS))
        raise ModelFileError(f"unsupported GGUF tokenizer model {kind!r} in {path}; supported: {supported}")
    if kind == "llama" and meta.get("general.architecture") in _GEMMA_ARCHITECTURES:
        builder = _gemma_backend
    backend = builder(meta)
    eos_ids = end_of_generation_ids(meta)
    named = {meta.get(key) for key in _EOS_KEYS}  # promoted by their text, as llama.cpp does; not by an id
    _add_gguf_added_tokens(backend, meta, tuple(i for i in eos_ids if i not in named))
    template = meta.get("tokenizer.chat_template")
    if meta.get("general.architecture") in _GEMMA_ARCHITECTURES:
        template = template or GEMMA_CHAT_TEMPLATE
    special = SpecialTokens(
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=eos_ids,
        pad_id=meta.get("tokenizer.ggml.padding_token_id"),
        unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
    )
    adds_bos = special.bos_id is not None and (
        kind == "llama" or meta.get("tokenizer.ggml.pre") in _BPE_ADDS_BOS
    )
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", adds_bos))
    return backend, special, add_bos, template


def end_of_generation_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """The ids that end generation (_EOG_TEXTS): the file's eos, eot and eom ids first (the eos is the
    pad token and the template's eos_token), then the others by id. llama.cpp's two exceptions drop a
    found <|end|> (gpt-oss, solar) or </s> (Gemma 4); it drops a named one too, which is kept here."""
    tokens = meta["tokenizer.ggml.tokens"]
    named = [meta[key] for key in _EOS_KEYS if meta.get(key) is not None]
    by_text = {t: i for i, t in enumerate(tokens)}  # a text twice: its last id, as llama.cpp
    found = {by_text[t] for t in _EOG_TEXTS if t in by_text}
    for key, texts in _FIM_EOG.items():
        fim = meta.get(key, next((by_text[t] for t in texts if t in by_text), None))
        found.update([fim] if fim is not None else [])
    texts = {tokens[i] for i in set(named) | found if 0 <= i < len(tokens)}
    call = "<|call|>" in texts or "<|calls|>" in texts
    if call and ("<|return|>" in texts or "<|flush|>" in texts):  # <|end|> ends a message, not the reply
        found -= {by_text.get("<|end|>")}
    if "<|tool_response>" in texts:
        found -= {by_text.get("</s>")}
    return tuple(dict.fromkeys(named + sorted(found - set(named))))


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The `tokenizer.*` metadata of a GGUF file as plain Python values."""
    # Reading maps the whole file: keep it off the import path.
    from tierlm.gguf_read import metadata, open_gguf

    return metadata(
        open_gguf(path), lambda key: key.startswith("tokenizer.") or key == "general.architecture"
    )


def _byte_level_backend(meta: dict[str, Any]) -> BackendTokenizer:
    """GPT-2 style byte-level BPE with the pre-tokenizer named by `tokenizer.ggml.pre`."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise ModelFileError(
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


def _gemma_backend(meta: dict[str, Any]) -> BackendTokenizer:
    """Gemma's SentencePiece BPE as transformers reads it from a GGUF: every space becomes "▁" before the
    model (no pre-tokenizer splits), no prefix space, `<0xNN>` byte fallback.

    Two things differ from `_sentencepiece_backend`: the file stores tokens made only of spaces with real
    spaces (respelled here as "▁" runs, the spelling the normalized text has), and its scores do not rank
    merges; the order of the vocabulary does (earlier tokens merge first)."""
    tokens = [_respelled(t) for t in meta["tokenizer.ggml.tokens"]]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=_merges_from_scores(tokens, [-float(i) for i in range(len(tokens))]),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        byte_fallback=True,
        fuse_unk=True,
    )
    backend = BackendTokenizer(model)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def _respelled(token: str) -> str:
    return "▁" * len(token) if token and not token.strip() and " " in token else token


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


def _add_gguf_added_tokens(backend: BackendTokenizer, meta: dict[str, Any], eog: tuple[int, ...]) -> None:
    """Control and unknown tokens become special, and so do the end-of-generation ones found by their text
    (`eog`), whatever their type (llama.cpp makes them control tokens: a reply's text never shows them);
    user-defined ones are matched whole but not special."""
    tokens, token_types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type", ())
    ends = {tokens[i] for i in eog if 0 <= i < len(tokens)}
    special = [t for t, kind in zip(tokens, token_types) if kind in (_UNKNOWN, _CONTROL) or t in ends]
    vocab = backend.get_vocab()  # a user-defined token the backend respelled (Gemma's spaces) is not added
    plain = [
        t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab and t not in ends
    ]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])


_GGUF_BUILDERS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})

# Gemma's turn format, for Gemma GGUFs that carry no tokenizer.chat_template (the Gemma 3 270M one does
# not), as Gemma's own template renders it: <start_of_turn>user|model, the text trimmed, <end_of_turn>; a
# first system message (its text as given) opens the first turn; roles must alternate user/model; content
# is a string or a list of parts whose text parts are joined (another part type, or another content type,
# is an error, never its Python repr).
GEMMA_CHAT_TEMPLATE = (
    "{%- macro text(content, trimmed) -%}"
    "{%- if content is string -%}{{ content | trim if trimmed else content }}"
    "{%- elif content is iterable and content is not mapping -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] | trim if trimmed else part['text'] }}"
    "{%- else -%}{{ raise_exception('Unsupported content part type: ' ~ part['type']) }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = text(messages[0]['content'], false) + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ prefix if loop.first else '' }}{{ text(m['content'], true) }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
