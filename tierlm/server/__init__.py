"""OpenAI-compatible HTTP API: `build_app(model, ...)` for an ASGI app, `run_server(model, ...)` to serve it."""

from tierlm.server.app import build_app, default_model_name, make_server, run_server

__all__ = ["build_app", "default_model_name", "make_server", "run_server"]
