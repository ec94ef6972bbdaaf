"""OpenAI-shaped errors: the exception, its JSON body, FastAPI handlers and the auth / body-size guard."""

from __future__ import annotations

import asyncio
import hmac
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",  # OpenAI's type for an unknown model or route (code model_not_found ...)
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_overloaded",
}
_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "literal"}
RETRY_AFTER_S = 1  # what a client told the queue is full should wait before it tries again
DRAIN_WAIT_S = 2.0  # a body already over the limit by its Content-Length: the longest wait for its next piece


class APIError(Exception):
    """An error the client caused (or must wait out), answered as `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code if code is not None else _CODES.get(status)

    @property
    def headers(self) -> dict[str, str] | None:
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        if self.code == "queue_full":
            return {"Retry-After": str(RETRY_AFTER_S)}
        return None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code if code is not None else _CODES.get(status),
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), err.status, err.headers)


def _param(loc: tuple) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages[0].content"."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part.split("-")[0] in _TYPE_TAGS:
            continue  # a union member's tag, not a field
        else:
            out += f".{part}" if out else part
    return out or None


def short_repr(value: object, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters: error messages quote what the client sent."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    # Of a union's errors, the one that is more than "not this type" says what is wrong; else the deepest
    # (content: [{"text": null}] is wrong at content[0].text, not in being a list rather than a string)
    first = next(
        (e for e in errors if not e["type"].endswith("_type")),
        max(errors, key=lambda e: len(e.get("loc", ()))),
    )
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        return error_response(APIError(400, message))
    message = first["msg"]
    if not param and first.get("type") == "missing":  # no body at all
        message = "the request body is empty: send a JSON object"
    elif not param and first.get("type") == "model_attributes_type":
        message = "the request body must be a JSON object"
        if isinstance(first.get("input"), bytes):  # not parsed: JSON needs its content type (CSRF guard)
            message += " sent with the header 'Content-Type: application/json'"
    elif param and first.get("type") != "missing":
        message = f"{param}: {message}, got {short_repr(first.get('input'))}"
    elif param:
        message = f"{param} is required"
    return error_response(APIError(400, message, param))


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if exc.status_code == 404:
        message = f"unknown route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    return error_response(APIError(exc.status_code, message))


async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises the exception after this answer, and uvicorn logs its traceback once.
    return JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}: {exc}"), 500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Exception, _unexpected)


class GuardMiddleware:
    """Checks the API key on /v1 routes and caps the request body before the app sees it."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self.api_key = None if api_key is None else api_key.encode("utf-8", "surrogateescape")  # argv bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"].startswith("/v1") and not self._authorized(scope):
            message = "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
            await error_response(APIError(401, message))(scope, receive, send)
            return
        messages = await self._read_body(scope, receive)
        if messages is None:
            message = f"the request body is larger than the limit of {self.max_body_bytes} bytes"
            await error_response(APIError(413, message))(scope, receive, send)
            return
        await self.app(scope, _replay(messages, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        """Compared as bytes in constant time: a header may carry any byte, a str compare would raise."""
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key or b"")

    async def _read_body(self, scope: Scope, receive: Receive) -> list[Message] | None:
        """The body messages, or None when the body is over the limit (drained so the client reads a 413)."""
        length = dict(scope["headers"]).get(b"content-length", b"")
        declared = int(length) if length.isdigit() else 0
        drain_limit = 8 * self.max_body_bytes  # past this, stop reading a client that will not stop
        if declared > drain_limit:
            return None
        messages, total = [], 0
        while True:
            if declared > self.max_body_bytes:  # over the limit by its header: drained only while it comes
                try:
                    message = await asyncio.wait_for(receive(), DRAIN_WAIT_S)
                except asyncio.TimeoutError:  # a client that declared more than it sends gets its 413 now
                    return None
            else:
                message = await receive()
            total += len(message.get("body", b""))
            if total <= self.max_body_bytes:
                messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body") or total > drain_limit:
                break
        return messages if total <= self.max_body_bytes and declared <= self.max_body_bytes else None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive() that first returns the buffered body, then the connection's own messages."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
