"""Turning a request's worker events into OpenAI responses: whole JSON bodies or server-sent event streams."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tierlm.server.batcher import SHUTDOWN_MESSAGE, Event, Request, Scheduler
from tierlm.server.errors import APIError, error_body


@dataclass
class Reply:
    """Identity and shape of one response: chat ("chat.completion") or text ("text_completion")."""

    chat: bool
    model: str
    prompt_tokens: int
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def usage(self, completion_tokens: int) -> dict:
        total = self.prompt_tokens + completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": total,
        }

    def body(self, text: str, finish_reason: str | None, completion_tokens: int) -> dict:
        """The non-streamed response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [choice], "usage": self.usage(completion_tokens)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict:
        """One streamed chunk carrying a text delta and/or the finish reason."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, completion_tokens: int) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage(completion_tokens)}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def failure(event: Event) -> APIError:
    """The error a failed request answers with: 503 when the server is shutting down, else 500."""
    if event.text == SHUTDOWN_MESSAGE:
        return APIError(503, event.text, code="server_shutting_down")
    return APIError(500, event.text, code="generation_failed")


async def collect(scheduler: Scheduler, request: Request, http: HTTPRequest, reply: Reply) -> dict:
    """Wait for the whole generation; a client that disconnects meanwhile cancels it."""
    watcher = asyncio.create_task(_cancel_on_disconnect(scheduler, request, http.receive))
    parts: list[str] = []
    event: Event | None = None
    try:
        while (event := await request.queue.get()).kind == "delta":
            parts.append(event.text)
    finally:
        watcher.cancel()
        if event is None or event.kind == "delta":
            scheduler.cancel(request)
    if event.kind == "error":
        raise failure(event)
    return reply.body("".join(parts), event.finish_reason, event.completion_tokens)


async def _cancel_on_disconnect(scheduler: Scheduler, request: Request, receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scheduler.cancel(request)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def event_stream(request: Request, reply: Reply) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    if reply.chat:
        yield _sse(reply.chunk(role=True))
    while (event := await request.queue.get()).kind == "delta":
        yield _sse(reply.chunk(event.text))
    if event.kind == "error":
        err = failure(event)
        yield _sse(error_body(err.status, err.message, code=err.code))
    else:
        yield _sse(reply.chunk(None if reply.chat else "", event.finish_reason))
        if reply.include_usage:
            yield _sse(reply.usage_chunk(event.completion_tokens))
    yield _sse("[DONE]")


class EventStreamResponse(StreamingResponse):
    """A streaming response that runs `on_close` however the stream ends (done, disconnect, error)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
