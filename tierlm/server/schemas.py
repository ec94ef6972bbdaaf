"""Request bodies of the OpenAI-compatible API, validated strictly (bad types are errors, not coerced)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tierlm.server.errors import APIError

MAX_STOPS = 4  # as OpenAI's API


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share; unknown OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        """Reject values the server cannot honour rather than silently ignoring them."""
        if self.n not in (None, 1):
            raise APIError(400, f"n must be 1 (only one choice per request is supported), got {self.n}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise APIError(400, f"{name} is not supported; send 0 or leave it out", name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        self.stops()

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


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of must be 1, got {self.best_of}", "best_of")
        if self.logprobs is not None:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: text or token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"only one prompt per request is supported, got {len(p)}", "prompt")
            p = p[0]
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    tools: list[dict] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError(400, "messages must contain at least one message", "messages")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if self.tools:
            raise APIError(400, "tools are not supported", "tools")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
