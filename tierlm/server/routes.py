"""The endpoints: health and stats, the model list, completions and chat completions, and vLLM's tokenizer
endpoints (/tokenize, /detokenize, /tokenizer_info)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from tierlm import cpu
from tierlm.errors import RequestError
from tierlm.generation.tools import ToolUse, history_use, tool_use
from tierlm.server import settings
from tierlm.server.batcher import Scheduler
from tierlm.server.errors import APIError
from tierlm.server.events import QueueFull, Request, ShuttingDown
from tierlm.server.responses import EventStreamResponse, Reply, collect, event_stream
from tierlm.server.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    Detokenized,
    DetokenizeRequest,
    ErrorBody,
    Health,
    ModelCard,
    ModelList,
    Tokenized,
    TokenizeRequest,
    TokenizerInfo,
    _Common,
)

if TYPE_CHECKING:
    from tierlm.model import Model

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerState:
    """What the endpoints share: the model, its scheduler and the name clients address it by."""

    model: Model
    scheduler: Scheduler
    model_name: str
    default_max_tokens: int
    trust_request_chat_template: bool = False  # vLLM's flag: a request may bring its own chat template
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def context(self) -> int:
        return self.scheduler.context

    @property
    def context_named(self) -> str:
        """How errors name the context: the model's, or the server's max_model_len."""
        capped = self.scheduler.context < self.model.config.max_position_embeddings
        return (
            f"the server's max_model_len is {self.context}"
            if capped
            else f"the model's context is {self.context}"
        )


router = APIRouter()
_ERRORS = {
    400: "Invalid request: not JSON, a missing field, a value of the wrong type or out of range (these are "
    "400s, never 422s), or a field the server cannot honour (`param` names it)",
    401: "Missing or wrong API key, when the server was started with one",
    404: "The model does not exist (code `model_not_found`)",
    413: "The request body is over the server's limit",
    500: "Generation failed",
    503: "The queue is full (code `queue_full`, retry after `Retry-After` seconds) "
    "or the server is shutting down (code `server_shutting_down`)",
}
_EVENT = {  # one server-sent event (OpenAPI before 3.2 has `schema` describe each event of a stream)
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "A JSON chunk (`chat.completion.chunk` or `text_completion`), or an error body, "
            "then `[DONE]`",
        }
    },
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait (queue_full)", "schema": {"type": "integer"}}}


def _documented(success: type, *statuses: int, stream: bool = False) -> dict:
    """OpenAPI `responses`: the 200 body (or event stream) and each error status in the OpenAI shape."""
    ok: dict = {"model": success, "description": "Success"}
    if stream:
        ok["description"] = "The answer; with `stream: true`, server-sent events ending in `data: [DONE]`"
        ok["content"] = {"text/event-stream": {"schema": _EVENT}}
    out: dict = {200: ok}
    for status in statuses:
        out[status] = {"model": ErrorBody, "description": _ERRORS[status]}
    if 503 in statuses:
        out[503]["headers"] = _RETRY_AFTER
    return out


def _generation_route(path: str, answer: type):
    """A POST route that generates: `answer` or its stream, and every error a generation can meet."""
    return router.post(
        path, response_model=None, responses=_documented(answer, 400, 401, 404, 413, 500, 503, stream=True)
    )


def _state(http: HTTPRequest) -> ServerState:
    return http.app.state.tierlm


@router.get("/health", response_model=None, responses={200: {"model": Health}, 503: {"model": Health}})
async def health(http: HTTPRequest) -> JSONResponse:
    state = _state(http)
    if state.scheduler.draining:
        return JSONResponse({"status": "shutting_down", "model": state.model_name}, 503)
    return JSONResponse({"status": "ok", "model": state.model_name, **state.scheduler.stats()})


@router.get("/stats")
async def stats(http: HTTPRequest) -> dict:
    return {**_state(http).scheduler.stats(), "cpu": cpu.detect().as_dict()}


@router.get("/v1/models", response_model=None, responses=_documented(ModelList, 401))
async def list_models(http: HTTPRequest) -> dict:
    return {"object": "list", "data": [_model_card(_state(http))]}


@router.get("/v1/models/{model_id:path}", response_model=None, responses=_documented(ModelCard, 401, 404))
async def get_model(model_id: str, http: HTTPRequest) -> dict:
    state = _state(http)
    _check_model(state, model_id)
    return _model_card(state)


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        message = f"model {name!r} does not exist; this server serves {state.model_name!r}"
        raise APIError(404, message, "model", "model_not_found")


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tierlm"}


# what a chat template's context holds already (documents: the request's field), or the server refuses
# (tools): not for chat_template_kwargs to set
_TEMPLATE_OWN = ("messages", "add_generation_prompt", "continue_final_message", "tools", "documents")


def _template_text(state: ServerState, body, use: ToolUse | None = None) -> str:
    """The chat of `body` (a chat completion or a /tokenize of messages) rendered by the model's template,
    or the request's `chat_template` where the server trusts requests' templates, with vLLM's `documents`
    and chat_template_kwargs as more variables."""
    if body.chat_template is not None and not state.trust_request_chat_template:
        message = "chat_template in a request needs a server started with --trust-request-chat-template"
        raise APIError(400, message, "chat_template")
    extra = body.chat_template_kwargs or {}
    own = next((k for k in extra if k in _TEMPLATE_OWN or k == "chat_template"), None)
    if own is not None:
        message = f"chat_template_kwargs cannot set {own!r}: it is the request's own field, or refused"
        raise APIError(400, message, "chat_template_kwargs")
    messages = [m.as_template_input() for m in body.messages]
    if use is None and any("tool_calls" in m or m["role"] == "tool" for m in messages):
        use = history_use(body.chat_template or state.model.tokenizer.chat_template)
    if use is not None:  # past calls, tool results and the tools as the template's family writes them
        messages = use.template_messages(messages)
        if use.tools and use.renders_tools:
            extra = {**extra, "tools": [t.as_dict() for t in use.tools]}
    try:
        return state.model.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template=body.chat_template,
            documents=body.documents,
            **extra,
        )
    except ValueError as err:
        raise APIError(400, str(err), "messages") from err


@router.post("/tokenize", response_model=None, responses=_documented(Tokenized, 400, 401, 404))
async def tokenize(body: TokenizeRequest, http: HTTPRequest) -> dict:
    """vLLM's: the token ids of a prompt (special tokens added unless add_special_tokens is false) or of chat
    messages rendered by the model's template."""
    state = _state(http)
    if body.model is not None:
        _check_model(state, body.model)
    body.check()
    tok = state.model.tokenizer
    if body.messages is not None:
        text = _template_text(state, body)
        ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await asyncio.to_thread(tok.encode, body.prompt, add)
    return {"count": len(ids), "max_model_len": state.context, "tokens": ids, "token_strs": None}


@router.post("/detokenize", response_model=None, responses=_documented(Detokenized, 400, 401, 404))
async def detokenize(body: DetokenizeRequest, http: HTTPRequest) -> dict:
    """vLLM's: the text of token ids, special tokens included."""
    state = _state(http)
    if body.model is not None:
        _check_model(state, body.model)
    ids = settings.prompt_token_ids(state, body.tokens, "tokens")
    return {"prompt": state.model.tokenizer.decode(ids, skip_special_tokens=False)}


@router.get("/tokenizer_info", response_model=None, responses=_documented(TokenizerInfo, 401))
async def tokenizer_info(http: HTTPRequest) -> dict:
    """vLLM's: the special tokens' text and the chat template (lm-evaluation-harness's remote tokenizer)."""
    state = _state(http)
    tok = state.model.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tok.decode([token_id], skip_special_tokens=False)

    return {
        "tokenizer_class": "tierlm",
        "eos_token": text((*tok.eos_token_ids, None)[0]),
        "bos_token": text(tok.bos_token_id),
        "pad_token": text(tok.pad_token_id),
        "chat_template": tok.chat_template,
        "model_max_length": state.context,
    }


@_generation_route("/v1/completions", Completion)
async def completions(body: CompletionRequest, http: HTTPRequest):
    state = _checked_state(http, body)
    prompts = body.prompts()
    many = len(prompts) > 1
    rows, texts = [], []
    for i, prompt in enumerate(prompts):
        param = f"prompt[{i}]" if many else "prompt"
        if isinstance(prompt, list):
            ids = settings.prompt_token_ids(state, prompt, param)
            text = state.model.tokenizer.decode(ids, skip_special_tokens=False) if body.echo else ""
        else:  # off the event loop: a long prompt takes a while to encode
            ids, text = await asyncio.to_thread(state.model.tokenizer.encode, prompt), prompt
        if len(cut := settings.truncated(state, body, ids)) < len(ids):  # the echo is what the model reads
            ids, text = cut, state.model.tokenizer.decode(cut, skip_special_tokens=False) if body.echo else ""
        rows.append(ids)
        texts.append(text)
    limits = [
        settings.max_tokens(
            state, len(ids), body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt", "max_tokens"
        )
        for ids in rows
    ]
    n = body.n or 1
    echo_logprobs = body.logprobs if body.echo else None
    prompt_top = max((k for k in (echo_logprobs, body.prompt_logprobs) if k is not None), default=None)
    configs = [settings.request_config(state, body, m, body.logprobs, prompt_top) for m in limits]
    reply = _reply(
        state,
        body,
        chat=False,
        prompt_tokens=sum(len(ids) for ids in rows),
        choices=len(rows) * n,
        prompts=[(ids, text) for ids, text in zip(rows, texts) for _ in range(n)],
        echo=bool(body.echo),
        top=body.logprobs,
    )
    return await _respond(state, http, body, rows, configs, reply)


@_generation_route("/v1/chat/completions", ChatCompletion)
async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
    state = _checked_state(http, body)
    use = _tool_use(state, body)
    ids = settings.truncated(state, body, await asyncio.to_thread(_chat_prompt_ids, state, body, use))
    max_tokens = settings.max_tokens(
        state,
        len(ids),
        body.requested_max_tokens,
        state.default_max_tokens,
        "messages",
        body.max_tokens_field,
    )
    top = (body.top_logprobs or 0) if body.logprobs else None
    reply = _reply(state, body, chat=True, prompt_tokens=len(ids), choices=body.n or 1, top=top, tool_use=use)
    config = settings.request_config(state, body, max_tokens, top, body.prompt_logprobs)
    if use is not None:  # the answer is generated under the calls' grammar
        try:
            config = config.replace(response_format=use.response_format())
            settings.check_closable(state, body, config)
        except RequestError as err:  # a schema the grammar refuses; a model without end-of-sequence token
            raise APIError(400, str(err), "tools") from err
    return await _respond(state, http, body, [ids], [config], reply)


def _tool_use(state: ServerState, body: ChatCompletionRequest) -> ToolUse | None:
    template = body.chat_template or state.model.tokenizer.chat_template
    try:
        use = tool_use(body.tools, body.tool_choice, body.parallel_tool_calls, template)
    except RequestError as err:
        raise APIError(
            400, str(err), "tool_choice" if str(err).startswith("tool_choice") else "tools"
        ) from err
    if use is not None and body.parsed_response_format is not None:
        message = "response_format and tools each constrain the answer: send one (or tool_choice 'none')"
        raise APIError(400, message, "response_format")
    return use


def _reply(state: ServerState, body: _Common, **shape) -> Reply:
    """The response's identity: the served model's name, the request's usage option, the tokenizer."""
    return Reply(
        model=state.model_name,
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
        tokenizer=state.model.tokenizer,
        token_ids=bool(body.return_tokens_as_token_ids),
        skip_special=body.skip_special_tokens is not False,
        prompt_top=body.prompt_logprobs,
        **shape,
    )


def _chat_prompt_ids(state: ServerState, body: ChatCompletionRequest, use: ToolUse | None) -> list[int]:
    text = _template_text(state, body, use)
    # the template writes its own special tokens; as transformers does, encode without adding more
    return state.model.tokenizer.encode(text, add_special_tokens=False)


def _checked_state(http: HTTPRequest, body: _Common) -> ServerState:
    """The server's state, once the request's model, options and n are ones it serves."""
    state = _state(http)
    _check_model(state, body.model)
    body.check_supported()
    rows = state.scheduler.max_batch_size
    if (body.n or 1) > rows:
        message = f"n must be <= {rows}: each choice takes a row of the server's batch (max_batch_size)"
        raise APIError(400, f"{message}, got {body.n}", "n")
    return state


async def _respond(state: ServerState, http: HTTPRequest, body: _Common, rows, configs, reply: Reply):
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    requests = []
    for i, (ids, config) in enumerate(zip(rows, configs)):
        stops = body.stops()
        request = Request(list(ids), config.max_new_tokens, stops, config, loop, queue, index=i * config.n)
        requests.append(request)
    try:
        for request in requests:
            state.scheduler.submit(request)
    except (QueueFull, ShuttingDown) as err:
        for request in requests:
            state.scheduler.cancel(request)
        code = "queue_full" if isinstance(err, QueueFull) else "server_shutting_down"
        raise APIError(503, str(err), code=code) from err
    if body.stream:

        def on_close() -> None:
            for request in requests:
                state.scheduler.cancel(request)

        return EventStreamResponse(event_stream(requests, reply), on_close)
    return await collect(state.scheduler, requests, http, reply)
