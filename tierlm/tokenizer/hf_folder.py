"""What an HF tokenizer folder says besides tokenizer.json: special tokens, BOS, the chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from tierlm.errors import ModelFileError
from tierlm.tokenizer.special import SpecialTokens


def read_hf_folder(folder: Path) -> tuple[BackendTokenizer, SpecialTokens, bool, str | None]:
    """The backend, special tokens, whether to add BOS, and the chat template of an HF tokenizer folder."""
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    backend = BackendTokenizer.from_file(str(tokenizer_file))
    config = _read_json(folder / "special_tokens_map.json") | _read_json(folder / "tokenizer_config.json")
    special = _special_from_config(backend, config, _read_json(folder / "generation_config.json"))
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # no flag: the post-processor in tokenizer.json decides, as in transformers
        add_bos = special.bos_id is not None and backend.encode("").ids[:1] == [special.bos_id]
    return backend, special, bool(add_bos), _chat_template_from_dir(folder, config)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ModelFileError(f"{path} is not valid JSON: {err}") from err


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _special_from_config(backend: BackendTokenizer, config: dict, generation: dict) -> SpecialTokens:
    def id_of(name: str, required: bool) -> int | None:
        content = _token_content(config.get(name))
        token_id = backend.token_to_id(content) if content is not None else None
        if content is not None and token_id is None and required:
            raise ModelFileError(f"{name} {content!r} from tokenizer_config.json is not in the vocabulary")
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
