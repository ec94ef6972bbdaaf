"""build_app() wires the model, the worker thread and the routes; run_server() serves it with uvicorn."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tierlm.generation.config import GenerationConfig
from tierlm.server.batcher import Scheduler
from tierlm.server.compute import release_openmp_team
from tierlm.server.continuous import ContinuousScheduler
from tierlm.server.errors import GuardMiddleware, install_error_handlers
from tierlm.server.routes import ServerState, router

if TYPE_CHECKING:
    from tierlm.model import Model

logger = logging.getLogger("tierlm.server")

LOG_LEVEL = "info"


def default_model_name(model: Model) -> str:
    """The name clients address the model by: its file or folder name without a .gguf suffix."""
    path = Path(getattr(model, "path", "") or "model")
    return path.name.removesuffix(".gguf")


def build_app(
    model: Model,
    *,
    model_name: str | None = None,
    max_batch_size: int = 8,
    api_key: str | None = None,
    max_queue: int = 64,
    max_body_bytes: int = 1_000_000,
    generation_config: GenerationConfig | None = None,
    default_max_tokens: int = 1024,
    batching: str = "continuous",
    max_model_len: int | None = None,
    trust_request_chat_template: bool = False,
    prefill_together: bool = False,
) -> FastAPI:
    """An OpenAI-compatible app serving `model`; its worker thread runs while the app's lifespan does.

    `generation_config` carries the server-wide settings (cache, compile_config); requests set sampling.
    `default_max_tokens` caps chat completions that do not say how many tokens they want.
    `batching`: "continuous" (requests join and leave the running batch at every step) or "static" (a
    request that arrives while every running batch decodes waits for one to end).
    `max_model_len` (vLLM's): the longest prompt + answer accepted, at most the model's context; with
    compiled steps, the cache and its steps are sized for it as the server starts.
    `trust_request_chat_template` (vLLM's): a chat request may bring its own `chat_template` (else a 400).
    `prefill_together` (continuous batching): requests that arrive together prefill in one padded forward,
    one pass over the weights, at the cost of batch invariance (off: each request's greedy and seeded tokens
    are its solo run's whatever else the server is doing, where the decode step's kernels are row-exact).
    The worker decodes on a thread of its own; the calling thread, which loaded `model`, has its OpenMP
    team freed (`release_openmp_team`): torch work on two threads halves a CPU decode's speed
    (tierlm.server.compute). Parallel torch ops it runs later make a new team, which slows the worker's.
    """
    _check_servable(model, max_body_bytes, default_max_tokens)
    scheduler = make_scheduler(
        model,
        batching,
        max_batch_size=max_batch_size,
        max_queue=max_queue,
        base_config=generation_config,
        default_max_tokens=default_max_tokens,
        max_model_len=max_model_len,
        prefill_together=prefill_together,
    )
    release_openmp_team()  # this thread loaded the model (and prepared packaged steps); the worker decodes
    name = model_name or default_model_name(model)
    app = FastAPI(title="tierlm", lifespan=_lifespan(scheduler, name), docs_url=None, redoc_url=None)
    app.state.tierlm = ServerState(model, scheduler, name, default_max_tokens, trust_request_chat_template)
    app.include_router(router)
    app.openapi = lambda: app.openapi_schema or _openapi_schema(app, name)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


def _check_servable(model: Model, max_body_bytes: int, default_max_tokens: int) -> None:
    if getattr(model, "tokenizer", None) is None:
        raise ValueError(
            "the server needs a model with a tokenizer (tokenizer.json or GGUF tokenizer metadata)"
        )
    if max_body_bytes < 1 or default_max_tokens < 1:
        raise ValueError("max_body_bytes and default_max_tokens must be >= 1")


def make_scheduler(
    model: Model, batching: str, *, default_max_tokens: int, prefill_together: bool = False, **kwargs
) -> Scheduler:
    """The worker for `batching` ("continuous" or "static"), its packaged steps loaded or built now when it
    compiles them. `kwargs`: max_batch_size, max_queue, base_config."""
    schedulers = {"continuous": ContinuousScheduler, "static": Scheduler}
    if batching not in schedulers:
        raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
    if batching == "static":
        return Scheduler(model, **kwargs)
    # The continuous worker sizes its cache at start-up for a request of default_max_tokens (tierlm.aot).
    scheduler = ContinuousScheduler(
        model, default_max_tokens=default_max_tokens, prefill_together=prefill_together, **kwargs
    )
    if getattr(model, "packages", None) is not None:
        # Load or build the packaged steps now, not in uvicorn's lifespan: a failed build is then the CLI's
        # one-line error (not a traceback and exit 3), and Ctrl-C stops a cold build.
        scheduler.prepare(report=logger.info)
    return scheduler


def _lifespan(scheduler: Scheduler, name: str):
    """The app's lifespan: the worker thread runs while it does."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        logger.info(
            "serving %s (%s batching, max_batch_size=%d, max_queue=%d)",
            name,
            scheduler.batching,
            scheduler.max_batch_size,
            scheduler.max_queue,
        )
        yield
        await asyncio.to_thread(scheduler.stop)

    return lifespan


def _openapi_schema(app: FastAPI, model_name: str) -> dict:
    """FastAPI's schema without its 422 answers (validation errors are 400s in the OpenAI shape), with the
    served model's name as the example of every `model` field."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for operation in (op for path in schema["paths"].values() for op in path.values()):
        operation["responses"].pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        components[request]["properties"]["model"]["examples"] = [model_name]
    app.openapi_schema = schema
    return schema


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown (SIGINT/SIGTERM) first lets in-flight requests finish for a grace
    period; streams still running after it end with an error chunk saying the server is shutting down."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace_s: float) -> None:
        super().__init__(config)
        self.scheduler, self.grace_s = scheduler, grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("shutting down: in-flight requests have %.1f s to finish", self.grace_s)
        self.scheduler.begin_drain(self.grace_s)
        await super().shutdown(sockets)


def make_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    shutdown_grace_s: float = 10.0,
    log_level: str = LOG_LEVEL,
) -> DrainingServer:
    """A uvicorn server for an app from build_app(); `.run()` blocks, `.should_exit = True` stops it."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_grace_s + 5,  # the grace period, then time to send error chunks
    )
    return DrainingServer(config, app.state.tierlm.scheduler, shutdown_grace_s)


def run_server(model: Model, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    """Serve `model` until SIGINT/SIGTERM. make_server's keywords (shutdown_grace_s, log_level) go to it, all
    others to build_app (model_name, max_batch_size, ...)."""
    server_kwargs = {key: kwargs.pop(key) for key in ("shutdown_grace_s", "log_level") if key in kwargs}
    app = build_app(model, **kwargs)
    _log_to_stderr(server_kwargs.get("log_level", LOG_LEVEL))
    make_server(app, host, port, **server_kwargs).run()


def _log_to_stderr(level: str) -> None:
    """Show the server's own log lines next to uvicorn's, through a handler of its own only when none of
    its ancestors (the CLI's `tierlm` logger, the root) has one: a second handler prints every line twice."""
    logger.setLevel(level.upper())
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)
