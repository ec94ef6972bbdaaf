"""Request and response bodies of the OpenAI-compatible API. Requests are validated strictly (bad types are
errors, not coerced), and every OpenAI field the server cannot honour is refused unless it is at its default."""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from tierlm.generation.response_format import ResponseFormat
from tierlm.server.errors import APIError, short_repr
from tierlm.server.structured import STRUCTURED, constraint

MAX_STOPS = 16  # OpenAI's API takes 4, vLLM any number; lm-evaluation-harness sends a task's stops and EOS
NO_FUNCTIONS = "is OpenAI's older form of tools, not supported: send tools and tool_choice"
MAX_LOGPROBS = 20  # as OpenAI's API: logprobs (completions) and top_logprobs (chat) up to this
MAX_N = 16  # choices per request (each takes a row of the batch)
# vLLM's extensions to OpenAI's API this server does not implement, with the values it accepts (vLLM's
# defaults, null aside): any other would change the output, so it is refused. top_k, min_p,
# repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, allowed_token_ids,
# truncate_prompt_tokens, return_tokens_as_token_ids, skip_special_tokens, bad_words, prompt_logprobs, use_beam_search,
# length_penalty and the structured-output fields are fields below; add_generation_prompt, continue_final_message and chat_template_kwargs are chat's.
EXTENSIONS: dict[str, tuple] = {
    "spaces_between_special_tokens": (True,),
    "logits_processors": (),
    "guided_decoding_backend": (
        "auto",
        "guidance",
        "llguidance",
    ),  # llguidance is the one here (vLLM's "guidance")
    "guided_whitespace_pattern": (),
    "chat_template": (),
    "documents": ([],),
    "mm_processor_kwargs": (),
}


def _valid_unicode(text: str) -> str:
    """Refuse a lone UTF-16 surrogate ("\\ud800" in JSON): it is not text any tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise PydanticCustomError(
            "lone_surrogate",
            "contains a lone UTF-16 surrogate at character {index}; send valid Unicode text",
            {"index": err.start},
        ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


def refuse_unless_default(body: BaseModel, limits: dict[str, tuple[tuple, str]], prefix: str = "") -> None:
    """Raise a 400 naming the first field set to a value the server cannot honour.

    `limits` maps a field to the values it honours besides null (its defaults) and why others are refused.
    """
    for name, (honoured, why) in limits.items():
        value = getattr(body, name, None)  # an undeclared field, absent: None
        if value is not None and value not in honoured:
            raise APIError(400, f"{prefix}{name} {why}, got {short_repr(value)}", f"{prefix}{name}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _Common(BaseModel):
    """Fields both endpoints share; fields unknown to OpenAI's API are accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="allow")
    LIMITS: ClassVar[dict[str, tuple[tuple, str]]] = {}

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: Text | list[Text] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id -> bias
    user: str | None = None  # accepted: only a label
    # extensions, as vLLM accepts them
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: no top-k filter
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    min_tokens: int | None = Field(None, ge=0)  # no EOS, stop token or stop string ends a choice before these
    ignore_eos: bool | None = None  # EOS does not end a choice
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # token ids that end a choice, as EOS
    include_stop_str_in_output: bool | None = None  # keep the stop string (or token) the text ends on
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # sample only these
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last k prompt tokens (-1: context)
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>"
    skip_special_tokens: bool | None = None  # false: special tokens' text is in the output
    bad_words: list[Text] | None = None  # words a choice may not write
    # each prompt token's log probability, rank and the top ones there (vLLM's shape; not in a stream)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    use_beam_search: bool | None = None  # n beams, the n best returned (transformers' beam search)
    length_penalty: float | None = (
        None  # with use_beam_search: a beam scores its log probs / new tokens ** this
    )
    # structured output: OpenAI's field on chat, the same as an extension on completions (as vLLM has it),
    # and vLLM's structured_outputs and its older guided_* fields: one of them per request
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # one of json, json_object, regex, choice, grammar
    guided_json: dict[str, Any] | str | None = None  # a JSON schema, or its JSON text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark, as llguidance reads it

    @cached_property
    def parsed_response_format(self) -> ResponseFormat | None:
        """The request's output constraint validated and compiled to a grammar; a 400 naming what is wrong
        or unsupported, or that two constraints were given."""
        given = [name for name in STRUCTURED if getattr(self, name) is not None]
        if len(given) > 1:
            message = f"give one structured-output field, got {' and '.join(given)}"
            raise APIError(400, message, given[1])
        if not given:
            return None
        name = given[0]
        try:
            return constraint(name, getattr(self, name))
        except ValueError as err:
            raise APIError(400, str(err), name) from err

    def logit_bias_ids(self, vocab: int) -> dict[int, float]:
        """logit_bias with its keys as token ids, each checked against the vocabulary."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) < vocab):
                message = f"logit_bias keys must be token ids in [0, {vocab}), got {short_repr(key)}"
                raise APIError(400, message, "logit_bias")
            out[int(key)] = bias
        return out

    def check_supported(self) -> None:
        """Reject values the server cannot honour rather than silently ignoring them."""
        refuse_unless_default(self, self.LIMITS)
        for name, accepted in EXTENSIONS.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and not any(type(value) is type(a) and value == a for a in accepted):
                message = f"{name} is not supported (an extension of other servers to OpenAI's API)"
                allowed = f" except at {' or '.join(map(repr, accepted))}" if accepted else ""
                raise APIError(400, f"{message}{allowed}, got {short_repr(value)}", name)
        self.stops()
        _ = self.parsed_response_format
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer it
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM answers it
            raise APIError(400, "prompt_logprobs is not available in a stream", "prompt_logprobs")

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOPS or not all(stops):
            raise APIError(
                400, f"stop must be up to {MAX_STOPS} non-empty strings, got {self.stop!r}", "stop"
            )
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_Common):
    LIMITS: ClassVar[dict[str, tuple[tuple, str]]] = {
        **_Common.LIMITS,
        "best_of": ((1,), "must be 1: one candidate per choice is supported"),
        "suffix": (("",), "is not supported: this server does not insert text"),
        "chat_template_kwargs": (({},), "is a chat completion's field: a completion has no chat template"),
    }

    prompt: Text | list[Text] | list[int] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, text or token ids: one choice (n choices) each, in order."""
        p = self.prompt
        prompts = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for i, one in enumerate(prompts):
            if not one:
                param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise APIError(400, f"{param} must not be empty", param)
        return prompts


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    LIMITS: ClassVar[dict[str, tuple[tuple, str]]] = {
        "function_call": ((), NO_FUNCTIONS),
        "audio": ((), "is not supported: this server only reads and writes text"),
        "refusal": ((), "is not supported: send the text as content"),
    }

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    function_call: dict | None = None
    audio: dict | None = None
    refusal: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name for it
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:  # a speaker's name (AutoGen, multi-agent chats): the template may use it
            message["name"] = self.name
        if self.tool_calls:  # an assistant's past calls, and a tool's result (tierlm.generation.tools)
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def check_tool_calls(self, where: str) -> None:
        for i, call in enumerate(self.tool_calls or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                param = f"{where}tool_calls[{i}]"
                message = (
                    f"{param} must be {{'id': ..., 'type': 'function', 'function': {{'name', 'arguments'}}}}"
                )
                raise APIError(400, f"{message}, got {short_repr(call)}", param)
        if self.tool_calls and self.role != "assistant":
            raise APIError(400, f"{where}tool_calls is an assistant message's field", f"{where}tool_calls")


class ChatCompletionRequest(_Common):
    LIMITS: ClassVar[dict[str, tuple[tuple, str]]] = {
        **_Common.LIMITS,
        "functions": (([],), NO_FUNCTIONS),
        "function_call": (("none",), NO_FUNCTIONS),
        "modalities": ((["text"],), "must be ['text']: this server only writes text"),
        "audio": ((), "is not supported: this server only writes text"),
        "service_tier": (("auto", "default"), "must be 'auto' or 'default': this server has one tier"),
        "reasoning_effort": ((), "is not supported: the model has no reasoning mode"),
        "verbosity": ((), "is not supported: the model has no verbosity setting"),
        "web_search_options": ((), "is not supported: this server does not search the web"),
    }

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    # vLLM's: how the chat template ends the prompt (both true is an error, as in vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template
    chat_template: Text | None = None  # vLLM's: this request's template (--trust-request-chat-template)
    documents: list[dict[str, Text]] | None = None  # vLLM's: the template's `documents` (RAG templates)
    echo: bool = False  # vLLM's echo of the last message: not supported, refused when true
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per answer
    functions: list[dict] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # accepted, with no effect on the answer: a latency hint and OpenAI-side bookkeeping
    prediction: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError(400, "messages must contain at least one message", "messages")
        if self.echo:
            raise APIError(400, "echo is not supported on chat completions, got true", "echo")
        if self.add_generation_prompt and self.continue_final_message:
            message = "continue_final_message continues the last message: set add_generation_prompt to false"
            raise APIError(400, message, "continue_final_message")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        for i, message in enumerate(self.messages):
            refuse_unless_default(message, message.LIMITS, f"messages[{i}].")
            message.check_tool_calls(f"messages[{i}].")
            if message.content is None and not message.tool_calls:  # an assistant's may be null beside calls
                param = f"messages[{i}].content"
                raise APIError(400, f"{param} is required (a {message.role} message needs its text)", param)
            if message.content == []:
                param = f"messages[{i}].content"
                raise APIError(400, f"{param} must hold at least one text part, got []", param)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field requested_max_tokens came from, for errors."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the model's template (lm-evaluation-harness's
    remote tokenizer reads the prompt form)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Text | None = None
    documents: list[dict[str, Text]] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        for i, message in enumerate(self.messages or ()):
            refuse_unless_default(message, message.LIMITS, f"messages[{i}].")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    tokens: list[int]


# --- responses: documented in /openapi.json, built as plain dicts by responses.py ------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error: `{"error": {...}}` as OpenAI's API answers it."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Answer(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string a "stop" finish ended on


class ChatCompletion(_Answer):
    """The non-streamed chat answer; with `"stream": true` the answer is server-sent events instead."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class CompletionLogprobs(BaseModel):
    """Per token (the prompt's too with `echo`, its first null): text, log probability, the top ones."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string a "stop" finish ended on


class Completion(_Answer):
    """The non-streamed completion; with `"stream": true` the answer is server-sent events instead."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: None


class Detokenized(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int


class Health(BaseModel):
    """`status` is "ok", or "shutting_down" (with a 503) once the server drains."""

    model_config = ConfigDict(extra="allow")

    status: Literal["ok", "shutting_down"]
    model: str
