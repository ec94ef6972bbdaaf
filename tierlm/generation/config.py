"""GenerationConfig: how generate() decodes, validated when it is built."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any

from tierlm.compile import CompileConfig
from tierlm.errors import RequestError
from tierlm.generation.response_format import ResponseFormat, parse_response_format

CACHE_IMPLEMENTATIONS = ("static", "dynamic")

SAMPLING_EPS = 1e-5  # a temperature below this decodes greedily
FLOAT32_MAX = 3.4028234663852886e38  # temperature and penalties are float32 in the sampler's tables


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    valid = f"an int >= {minimum}" + (" or None" if optional else "")
    if not _is_int(value) or value < minimum:
        raise RequestError(f"{name} must be {valid}, got {_describe(value)}")


def _check_float(name: str, value: Any, valid: str, in_range: bool) -> float:
    """Return value as a float; in_range is the caller's range test (ignored for non-numbers)."""
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number {valid}, got {_describe(value)}")
    if not in_range:
        raise RequestError(f"{name} must be {valid}, got {value!r}")
    return float(value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be True or False, got {_describe(value)}")


def _in(value: Any, low: float, high: float) -> bool:
    """low <= value <= high for numbers, False for anything else."""
    return (_is_int(value) or isinstance(value, float)) and low <= value <= high


def _normalize_eos(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = (value,) if _is_int(value) else value
    if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) and i >= 0 for i in ids):
        raise RequestError(
            "eos_token_id must be None (the model's), a token id >= 0 or a non-empty list of them, "
            f"got {_describe(value)}"
        )
    return tuple(ids)


def _normalize_stop(value: Any) -> tuple[str, ...]:
    stops = (value,) if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of non-empty strings, got {value!r}")
    return tuple(stops)


def _normalize_token_ids(value: Any, name: str = "stop_token_ids") -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in value):
        raise RequestError(f"{name} must be a list of token ids >= 0, got {_describe(value)}")
    return tuple(value)


def _normalize_bias(value: Any) -> tuple[tuple[int, float], ...]:
    pairs = value.items() if isinstance(value, dict) else value
    valid = "a dict (or pairs) of token id >= 0 -> a finite number in [-100, 100]"
    try:
        out = tuple(
            sorted(
                (int(k), v)
                for k, v in pairs
                if (_is_int(k) and k >= 0) or (isinstance(k, str) and k.isascii() and k.isdigit())
            )
        )
    except (TypeError, ValueError):
        raise RequestError(f"logit_bias must be {valid}, got {_describe(value)}") from None
    if len(out) != len(pairs) or not all(_in(v, -100, 100) and math.isfinite(v) for _, v in out):
        raise RequestError(f"logit_bias must be {valid}, got {value!r}")
    twice = sorted({k for (k, _), (after, _) in zip(out, out[1:]) if k == after})
    if twice:  # 100 and "100": which bias applies would depend on an indexed write's order
        raise RequestError(f"logit_bias gives token id {twice[0]} more than one bias")
    return tuple((k, float(v)) for k, v in out)


def _suggest(name: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# settings beam search does not take (it ranks raw log probabilities, greedily)
BEAM_EXCLUDES = (
    "do_sample",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "allowed_token_ids",
    "logprobs",
    "stop",
    "bad_words",
    "response_format",
)


@dataclass(frozen=True)
class GenerationConfig:
    """How generate() decodes: lengths, sampling, stopping, cache and compilation."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0  # no EOS, stop token or stop string ends a row before it (vLLM's min_tokens)
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's: minus this once a token was generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often a token was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict is accepted
    allowed_token_ids: tuple[int, ...] | None = None  # sample only these (vLLM's); None: any token
    n: int = 1  # samples per prompt, sharing one prefill; with num_beams > 1, the best n beams returned
    num_beams: int = 1  # > 1: beam search, as transformers' (generation/beam.py); 1: greedy or sampling
    length_penalty: float = 1.0  # beam search: a finished beam scores sum of log probs / new tokens ** this
    early_stopping: bool | str = False  # beam search: True, False (a heuristic) or "never", as transformers'
    logprobs: int | None = None  # per generated token: its log probability and the top-N (raw logits)
    prompt_logprobs: int | None = None  # the same for every prompt token but the first
    seed: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # more token ids that end a row, as EOS does (vLLM's)
    ignore_eos: bool = False  # EOS does not end a row: it decodes to max_new_tokens (vLLM's, llama.cpp's)
    include_stop_str_in_output: bool = False  # the text keeps the stop string or token it ends on (vLLM's)
    skip_special_tokens: bool = True  # False: special tokens' text is in the output (vLLM's)
    bad_words: tuple[str, ...] = ()  # words a row may not write, as vLLM bans them (generation/bad_words.py)
    # structured output, as OpenAI's {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}
    response_format: ResponseFormat | dict | None = None
    cache_implementation: str = "static"
    max_cache_len: int | None = None
    prefill_chunk: int | None = 256  # prompt tokens per prefill forward; None or 0: the whole prompt at once
    compile_config: CompileConfig | None = None
    disable_compile: bool = False

    def __post_init__(self) -> None:
        self._validate_lengths()
        self._validate_sampling()
        self._validate_stopping()
        self._set("response_format", parse_response_format(self.response_format))
        self._validate_cache_and_compile()
        self._validate_beams()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalizing in __post_init__ of a frozen dataclass

    def _validate_lengths(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_int("min_new_tokens", self.min_new_tokens, 0)
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"
            )

    def _validate_sampling(self) -> None:
        _check_bool("do_sample", self.do_sample)
        t, p, m, r = self.temperature, self.top_p, self.min_p, self.repetition_penalty
        self._set("temperature", _check_float("temperature", t, ">= 0", _in(t, 0, math.inf)))
        _check_int("top_k", self.top_k, 0)
        self._set("top_p", _check_float("top_p", p, "in (0, 1]", _in(p, 0, 1) and p > 0))
        self._set("min_p", _check_float("min_p", m, "in [0, 1)", _in(m, 0, 1) and m < 1))
        self._set(
            "repetition_penalty",
            _check_float("repetition_penalty", r, "> 0", _in(r, 0, math.inf) and r > 0),
        )
        for name in ("temperature", "repetition_penalty"):  # the sampler keeps them as float32
            if getattr(self, name) > FLOAT32_MAX:
                raise RequestError(
                    f"{name} must fit a float32 (at most {FLOAT32_MAX:.4g}), got {getattr(self, name)!r}"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            self._set(name, _check_float(name, v, "in [-2, 2]", _in(v, -2, 2)))
        self._set("logit_bias", _normalize_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _normalize_token_ids(self.allowed_token_ids, "allowed_token_ids")
            if not allowed:
                raise RequestError("allowed_token_ids must name at least one token (None: any token)")
            self._set("allowed_token_ids", allowed)
        _check_int("n", self.n, 1)
        _check_int("logprobs", self.logprobs, 0, optional=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, optional=True)
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            raise RequestError(f"seed must be None or an int in [0, 2**64), got {_describe(self.seed)}")

    def _validate_stopping(self) -> None:
        self._set("eos_token_id", _normalize_eos(self.eos_token_id))
        self._set("stop", _normalize_stop(self.stop))
        self._set("stop_token_ids", _normalize_token_ids(self.stop_token_ids))
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        words = self.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise RequestError(
                f"bad_words must be a list of words (non-blank strings), got {_describe(words)}"
            )
        self._set("bad_words", tuple(words))

    def _validate_cache_and_compile(self) -> None:
        impl = self.cache_implementation
        if impl not in CACHE_IMPLEMENTATIONS:
            hint = _suggest(impl, CACHE_IMPLEMENTATIONS) if isinstance(impl, str) else ""
            choices = ", ".join(map(repr, CACHE_IMPLEMENTATIONS))
            raise RequestError(f"cache_implementation must be one of {choices}, got {impl!r}{hint}")
        _check_int("max_cache_len", self.max_cache_len, 1, optional=True)
        _check_int("prefill_chunk", self.prefill_chunk, 0, optional=True)
        if self.compile_config is not None and not isinstance(self.compile_config, CompileConfig):
            raise RequestError(
                f"compile_config must be a CompileConfig or None, got {_describe(self.compile_config)}"
            )
        _check_bool("disable_compile", self.disable_compile)

    def _validate_beams(self) -> None:
        _check_int("num_beams", self.num_beams, 1)
        lp = self.length_penalty
        self._set("length_penalty", _check_float("length_penalty", lp, "(of any sign)", True))
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise RequestError(
                f"early_stopping must be True, False or 'never', got {_describe(self.early_stopping)}"
            )
        if self.num_beams == 1:
            return
        if self.n > self.num_beams:
            raise RequestError(
                f"n (the beams returned) must be <= num_beams ({self.num_beams}), got {self.n}"
            )
        default = GenerationConfig.__dataclass_fields__
        others = [name for name in BEAM_EXCLUDES if getattr(self, name) != default[name].default]
        if others:
            raise RequestError(
                f"num_beams > 1 (beam search) does not combine with {', '.join(others)}: beams rank the "
                "model's own log probabilities, greedily"
            )

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax: do_sample is off or the temperature is below SAMPLING_EPS (as
        vLLM's: dividing logits by 1e-45 overflows to inf, and the softmax of infs picked token 0)."""
        return not self.do_sample or self.temperature < SAMPLING_EPS

    def replace(self, **overrides: Any) -> GenerationConfig:
        """A copy with the given fields changed, validated again."""
        names = [f.name for f in dataclasses.fields(self)]
        for key in overrides:
            if key not in names:
                raise RequestError(
                    f"GenerationConfig has no field {key!r}{_suggest(key, names)}; "
                    f"valid fields are: {', '.join(names)}"
                )
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_overrides(cls, base: GenerationConfig | None = None, **overrides: Any) -> GenerationConfig:
        """base (or the defaults) with the overrides that are not None applied, e.g. from CLI flags."""
        if base is not None and not isinstance(base, GenerationConfig):
            raise RequestError(
                f"generation_config must be a GenerationConfig or None, got {_describe(base)} "
                "(settings go as keyword arguments: generate(prompt, max_new_tokens=8))"
            )
        return (base or cls()).replace(**{k: v for k, v in overrides.items() if v is not None})
