"""Turning a request's worker events into OpenAI responses: whole JSON bodies or server-sent event streams.

One response may hold several choices (n samples of each of several prompts): their events share one queue
and carry the choice's index."""

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

from tierlm.generation.loop import TokenLogprob
from tierlm.generation.tools import ToolUse
from tierlm.server.batcher import SHUTDOWN_MESSAGE, Event, Request, Scheduler
from tierlm.server.errors import APIError, error_body
from tierlm.tokenizer.pieces import piece_text


@dataclass
class Choice:
    """What one choice has produced so far."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    completion_tokens: int = 0
    tokens: int = 0  # so far, for a chunk's usage (vLLM's continuous_usage_stats)
    started: bool = False  # its echo (prompt text and log probabilities) went out
    prompt: list[TokenLogprob | None] | None = None  # its prompt's log probabilities, when asked
    # a completion's text_offset: characters so far, the tokens counted, how many of them are the echoed
    # prompt (its text keeps special tokens, the generated text does not), and the stream decoder counting
    # them (a token inside a character adds none until the character is whole, as the text is sent)
    offset: int = 0
    counted: int = 0
    echoed: int = 0
    counter: object = None
    # with tools, a stream holds its text back while it may still become calls: "" (undecided), "text" or
    # "calls"; the log probability entries held meanwhile
    mode: str = ""
    held: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Reply:
    """Identity and shape of one response: chat ("chat.completion") or text ("text_completion").

    `prompts` holds, per choice, its prompt ids and text (for `echo`); `top` is the number of top log
    probabilities asked for (None: no log probabilities at all); `echo` repeats the prompt (completions).
    """

    chat: bool
    model: str
    prompt_tokens: int
    include_usage: bool = False
    continuous_usage: bool = False  # every chunk carries the usage so far (vLLM's continuous_usage_stats)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    choices: int = 1
    prompts: list[tuple[list[int], str]] = field(default_factory=list)
    echo: bool = False
    top: int | None = None
    tokenizer: object = None
    token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)
    skip_special: bool = True  # the answer's text leaves special tokens out (vLLM's skip_special_tokens)
    prompt_top: int | None = None  # vLLM's prompt_logprobs: top tokens per prompt token (None: not asked)
    tool_use: ToolUse | None = None  # the request's tools: answers are parsed for calls

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.state = [Choice() for _ in range(self.choices)]

    def usage(self, completion_tokens: int) -> dict:
        total = self.prompt_tokens + completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": total,
        }

    # --- events -> choices --------------------------------------------------------------------------

    def add(self, event: Event) -> tuple[str, list]:
        """Record a delta event on its choice; returns the text and log probability entries it adds
        (with the echoed prompt first, on a choice's first event)."""
        c = self.state[event.index]
        c.tokens = max(c.tokens, event.tokens)
        text, entries = event.text, list(event.logprobs)
        if event.prompt_logprobs is not None:
            c.prompt = event.prompt_logprobs
        if not c.started:
            c.started = True
            if self.echo:
                ids, prompt_text = self.prompts[event.index]
                text = prompt_text + text
                if event.prompt_logprobs is not None:
                    first = TokenLogprob(ids[0], None, [])  # the first prompt token has no log probability
                    entries = [first, *event.prompt_logprobs[1:], *entries]
                    c.echoed = len(ids)
        c.parts.append(text)
        c.logprobs.extend(entries)
        return text, entries

    def finish(self, event: Event) -> None:
        c = self.state[event.index]
        c.finish_reason, c.completion_tokens = event.finish_reason, event.completion_tokens
        c.stop_reason, c.tokens = event.stop_reason, event.completion_tokens
        if not c.started and self.echo:  # nothing was generated: the echo still goes out
            self.add(Event("delta", index=event.index))

    # --- log probabilities in OpenAI's two shapes ----------------------------------------------------

    def _token(self, token: int) -> str:
        """A token's text for logprobs: "bytes:\\xNN.." for a token inside a character, as OpenAI writes it."""
        return piece_text(self.tokenizer.token_bytes(token))

    def _name(self, token: int) -> str:
        """How logprobs name a token: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
        return f"token_id:{token}" if self.token_ids else self._token(token)

    def _logprobs(self, entries: list[TokenLogprob], choice: Choice) -> dict | None:
        if self.top is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens = [self._token(e.token) for e in entries]
        offsets = []  # where each token's text starts in the choice's text
        for e, own in zip(entries, tokens):
            answer = choice.counted >= choice.echoed  # the echoed prompt's tokens come first
            if choice.counter is None or choice.counted == choice.echoed:
                if choice.counter is not None:  # the prompt's last characters, then the answer's
                    choice.offset += len(choice.counter.flush())
                skip = answer and self.skip_special
                choice.counter = self.tokenizer.stream_decoder(skip_special_tokens=skip)
            delta = choice.counter.push(e.token)
            # a whole token ends the text it completes (after the U+FFFD of broken bytes before it); a
            # token inside a character starts where the text sent so far ends
            whole = own and "\ufffd" not in own and delta.endswith(own)
            offsets.append(choice.offset + (len(delta) - len(own) if whole else 0))
            choice.offset += len(delta)
            choice.counted += 1
        tops = []
        for e in entries:
            top = None
            if e.logprob is not None:  # the chosen token too, as vLLM answers
                top = {}
                for t, v in [*e.top[: self.top], (e.token, e.logprob)]:
                    top.setdefault(self._name(t), v)  # tokens that decode alike keep the likelier
            tops.append(top)
        return {
            "tokens": [self._name(e.token) for e in entries] if self.token_ids else tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _prompt_logprobs(self, c: Choice) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: per prompt token (the first: None) its id -> logprob, rank and text, and
        the prompt_top most likely tokens there, ranked 1, 2, ..."""
        out: list[dict | None] = []
        for e in c.prompt or ():
            if e is None:
                out.append(None)
                continue
            ranked = [
                (e.token, e.logprob, e.rank),
                *((t, v, i + 1) for i, (t, v) in enumerate(e.top[: self.prompt_top])),
            ]
            entry: dict = {}
            for token, logprob, rank in ranked:
                entry.setdefault(
                    str(token), {"logprob": logprob, "rank": rank, "decoded_token": self._name(token)}
                )
            out.append(entry)
        return out

    def _chat_entry(self, e: TokenLogprob) -> dict:
        def one(token: int, logprob: float) -> dict:
            raw = self.tokenizer.token_bytes(token)  # the token's own bytes: they rebuild split characters
            return {"token": self._name(token), "logprob": logprob, "bytes": list(raw)}

        return {**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top[: self.top]]}

    # --- bodies ------------------------------------------------------------------------------------

    def body(self) -> dict:
        """The non-streamed response."""
        choices = []
        for index, c in enumerate(self.state):
            c.offset, c.counted, c.counter = 0, 0, None
            logprobs = self._logprobs(c.logprobs, c)
            text = "".join(c.parts)
            reason = c.finish_reason
            if self.chat:
                message: dict = {"role": "assistant", "content": text}
                content, calls = self.tool_use.parse(text) if self.tool_use else (text, [])
                if calls:
                    message = {
                        "role": "assistant",
                        "content": content,
                        "tool_calls": [x.as_dict() for x in calls],
                    }
                    reason = "tool_calls" if reason == "stop" else reason
                choice = {"index": index, "message": message, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": text, "logprobs": logprobs}
            choice["finish_reason"], choice["stop_reason"] = reason, c.stop_reason
            if self.prompt_top is not None and not self.chat:
                choice["prompt_logprobs"] = self._prompt_logprobs(c)
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        tokens = sum(c.completion_tokens for c in self.state)
        body = {**self._head(kind), "choices": choices, "usage": self.usage(tokens)}
        if self.prompt_top is not None and self.chat:  # one prompt: vLLM answers it beside the choices
            body["prompt_logprobs"] = self._prompt_logprobs(self.state[0])
        return body

    def chunk(
        self,
        text: str | None = None,
        finish_reason: str | None = None,
        role: bool = False,
        index: int = 0,
        entries: list[TokenLogprob] | None = None,
    ) -> dict:
        """One streamed chunk carrying a text delta (and its tokens' log probabilities) or the finish reason."""
        logprobs = self._logprobs(entries, self.state[index]) if entries else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:  # with continuous_usage, the choice's tokens so far
            out["usage"] = self.usage(self.state[index].tokens) if self.continuous_usage else None
        return out

    def route(self, index: int, text: str, entries: list[TokenLogprob]) -> tuple[str, list] | None:
        """With tools, what of a streamed delta goes out now as text: None while the answer may still be calls
        (held), the held text with this delta once it cannot be."""
        c = self.state[index]
        if c.mode == "text":
            return text, entries
        c.held.extend(entries)
        whole, opener = "".join(c.parts), self.tool_use.form.opener()  # as strict as the grammar and parse()
        if c.mode == "calls" or opener.startswith(whole):
            return None
        if whole.startswith(opener):
            c.mode = "calls"
            return None
        c.mode, held = "text", c.held
        c.held = []
        return "".join(c.parts), held

    def end_chunks(self, index: int) -> list[dict]:
        """With tools, the chunks that end a streamed choice: its calls (each whole, with its index, id and
        name), or the text it held back."""
        c = self.state[index]
        content, calls = self.tool_use.parse("".join(c.parts)) if c.mode != "text" else ("", [])
        if not calls:
            text, c.mode = ("".join(c.parts) if c.mode != "text" else ""), "text"
            return [self.chunk(text, index=index, entries=c.held)] if text else []
        deltas = [{"index": i, **call.as_dict()} for i, call in enumerate(calls)]
        chunk = self.chunk(index=index, entries=c.held)
        chunk["choices"][0]["delta"] = {"content": content, "tool_calls": deltas}
        return [chunk]

    def usage_chunk(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        tokens = sum(c.completion_tokens for c in self.state)
        return {**self._head(kind), "choices": [], "usage": self.usage(tokens)}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def failure(event: Event) -> APIError:
    """The error a failed request answers with: 503 when the server is shutting down, else 500."""
    if event.text == SHUTDOWN_MESSAGE:
        return APIError(503, event.text, code="server_shutting_down")
    return APIError(500, event.text, code="generation_failed")


async def collect(scheduler: Scheduler, requests: list[Request], http: HTTPRequest, reply: Reply) -> dict:
    """Wait for every choice; a client that disconnects meanwhile cancels them."""
    watcher = asyncio.create_task(_cancel_on_disconnect(scheduler, requests, http.receive))
    queue, left = requests[0].queue, reply.choices
    event: Event | None = None
    try:
        while left:
            event = await queue.get()
            if event.kind == "error":
                break
            if event.kind == "delta":
                reply.add(event)
            else:
                reply.finish(event)
                left -= 1
    finally:
        watcher.cancel()
        if left:
            for r in requests:
                scheduler.cancel(r)
    if event is not None and event.kind == "error":
        raise failure(event)
    return reply.body()


async def _cancel_on_disconnect(scheduler: Scheduler, requests: list[Request], receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    for r in requests:
        scheduler.cancel(r)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def event_stream(requests: list[Request], reply: Reply) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    if reply.chat:
        for index in range(reply.choices):
            yield _sse(reply.chunk(role=True, index=index))
    queue, left = requests[0].queue, reply.choices
    while left:
        event = await queue.get()
        if event.kind == "error":
            err = failure(event)
            yield _sse(error_body(err.status, err.message, code=err.code))
            break
        if event.kind == "delta":
            text, entries = reply.add(event)
            if reply.tool_use is not None and (out := reply.route(event.index, text, entries)) is None:
                continue  # may still be calls: held
            if reply.tool_use is not None:
                text, entries = out
            yield _sse(reply.chunk(text, index=event.index, entries=entries))
            continue
        left -= 1
        if not reply.state[event.index].started and reply.echo:
            text, entries = reply.add(Event("delta", index=event.index))
            yield _sse(reply.chunk(text, index=event.index, entries=entries))
        reply.finish(event)
        reason = event.finish_reason
        if reply.tool_use is not None:
            for chunk in reply.end_chunks(event.index):
                if chunk["choices"][0]["delta"].get("tool_calls") and reason == "stop":
                    reason = "tool_calls"
                yield _sse(chunk)
        end = reply.chunk(None if reply.chat else "", reason, index=event.index)
        end["choices"][0]["stop_reason"] = event.stop_reason  # vLLM's, in the chunk that ends a choice
        yield _sse(end)
    else:
        if reply.include_usage:
            yield _sse(reply.usage_chunk())
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
