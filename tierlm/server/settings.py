"""A request's fields as the server reads them: its prompt token ids (checked against the vocabulary and cut
to truncate_prompt_tokens), its max_tokens against the context, and its sampling, vLLM and beam settings
as a GenerationConfig over the server's own. Each problem is one APIError (a 400 naming the field)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierlm.generation.config import GenerationConfig
from tierlm.generation.grammar import shortest_answer, too_short
from tierlm.generation.run import eos_token_ids
from tierlm.server.errors import APIError, short_repr
from tierlm.server.schemas import _Common

if TYPE_CHECKING:
    from tierlm.server.routes import ServerState


def request_config(
    state: ServerState, body: _Common, max_tokens: int, logprobs, prompt_logprobs
) -> GenerationConfig:
    """The request's sampling settings over the server's generation config."""
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    settings = dict(
        max_new_tokens=max_tokens,
        do_sample=temperature > 0,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=max(body.top_k or 0, 0),
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
        presence_penalty=float(body.presence_penalty or 0),
        frequency_penalty=float(body.frequency_penalty or 0),
        logit_bias=body.logit_bias_ids(state.model.config.vocab_size),
        seed=body.seed,
        n=body.n or 1,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        response_format=body.parsed_response_format,
        stop=(),
        **_vllm_settings(state, body, max_tokens),
    )
    settings.update(_beam_settings(body))  # beams replace the sampling settings
    base = state.scheduler.base_config
    try:
        config = base.replace(**settings)
    except ValueError as err:  # the schema checks ranges first; this names anything it let through
        raise APIError(400, str(err)) from err
    if config.response_format is not None and not eos_token_ids(state.model, config):
        message = "response_format needs a model with an end-of-sequence token, and this one names none"
        raise APIError(400, message, "response_format")
    check_closable(state, body, config)
    return config


def check_closable(state: ServerState, body: _Common, config: GenerationConfig) -> None:
    """A 400 naming max_tokens where the answer's format cannot close within it (refused before it is queued)."""
    if config.response_format is None:
        return
    tok, eos = state.model.tokenizer, eos_token_ids(state.model, config)
    shortest = shortest_answer(tok, state.model.config.vocab_size, eos, config.response_format)
    if shortest is not None and len(shortest) > config.max_new_tokens:
        field = getattr(body, "max_tokens_field", "max_tokens")
        raise APIError(400, too_short(field, config.max_new_tokens, tok, shortest), field)


def _vllm_settings(state: ServerState, body: _Common, max_tokens: int) -> dict:
    """vLLM's min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens,
    bad_words and allowed_token_ids as generation settings, checked against max_tokens and the vocabulary."""
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        message = f"min_tokens must be <= max_tokens ({max_tokens}), got {min_tokens}"
        raise APIError(400, message, "min_tokens")
    if any(not word.strip() for word in body.bad_words or ()):
        message = f"bad_words must be words (non-blank strings), got {short_repr(body.bad_words)}"
        raise APIError(400, message, "bad_words")
    allowed = body.allowed_token_ids
    if allowed is not None and not allowed:
        raise APIError(400, "allowed_token_ids must name at least one token", "allowed_token_ids")
    return dict(
        min_new_tokens=min_tokens,
        ignore_eos=bool(body.ignore_eos),
        stop_token_ids=_vocabulary_ids(state, "stop_token_ids", body.stop_token_ids or ()),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False,
        bad_words=tuple(body.bad_words or ()),
        allowed_token_ids=None if allowed is None else _vocabulary_ids(state, "allowed_token_ids", allowed),
    )


def _beam_settings(body: _Common) -> dict:
    """vLLM's use_beam_search: n beams, the n best returned; their search is greedy, so the sampling
    settings do not apply (as vLLM's beam search ignores top_p and top_k), and the settings it cannot take
    are a 400 (`GenerationConfig`)."""
    penalty = body.length_penalty
    if not body.use_beam_search:
        if penalty is not None and penalty != 1:
            raise APIError(400, f"length_penalty needs use_beam_search, got {penalty}", "length_penalty")
        return {}
    if body.stop:
        raise APIError(400, "stop strings do not combine with use_beam_search", "stop")
    n = body.n or 1
    beams = dict(num_beams=n, length_penalty=1.0 if penalty is None else float(penalty))
    return dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, **beams)


def _vocabulary_ids(state: ServerState, name: str, ids: list[int]) -> tuple[int, ...]:
    vocab = state.model.config.vocab_size
    bad = next((i for i in ids if i >= vocab), None)
    if bad is not None:
        raise APIError(400, f"{name} must be token ids in [0, {vocab}), got {bad}", name)
    return tuple(ids)


def truncated(state: ServerState, body: _Common, ids: list[int]) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (vLLM's; -1: the model's context), else all."""
    keep = body.truncate_prompt_tokens
    if keep == 0:
        raise APIError(
            400, "truncate_prompt_tokens must be -1 (the context) or >= 1, got 0", "truncate_prompt_tokens"
        )
    if keep is None:
        return ids
    return ids[-(state.context if keep == -1 else keep) :]


def prompt_token_ids(state: ServerState, ids: list[int], param: str = "prompt") -> list[int]:
    vocab = state.model.config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise APIError(400, f"prompt token ids must be in [0, {vocab}), got {bad[0]}", param)
    return ids


def max_tokens(
    state: ServerState, prompt_tokens: int, requested: int | None, default: int, param: str, field: str
) -> int:
    """The request's max_tokens: what it asked for if prompt and answer fit the context, else an error."""
    room = state.context - prompt_tokens
    if prompt_tokens == 0:
        raise APIError(400, "the prompt is empty: it needs at least one token", param)
    if room <= 0:
        message = (
            f"the prompt has {prompt_tokens} tokens, but {state.context_named} tokens; shorten the prompt"
        )
        raise APIError(400, message, param, "context_length_exceeded")
    if requested is None:
        return min(default, room)
    if requested > room:
        message = (
            f"{state.context_named} tokens, but the prompt has {prompt_tokens} and "
            f"{field} asks for {requested} more ({prompt_tokens + requested} in all); "
            f"use {field} <= {room}"
        )
        raise APIError(400, message, field, "context_length_exceeded")
    return requested
