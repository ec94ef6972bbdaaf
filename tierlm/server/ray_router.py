"""`TierlmRouter`: the HTTP ingress of `tierlm serve --replicas N`. It forwards each request to one replica and
answers `/health` and `/stats` for all of them; see ray_app.py for the whole picture.

Ray is imported only inside its methods (they run in a Ray actor).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tierlm.server.errors import GuardMiddleware, error_body
from tierlm.server.ray_replica import REPLICA_HEADER

logger = logging.getLogger("tierlm.server")

ROUTER_NAME = "router"  # the header's value on answers the router gives itself (health, stats, its errors)
BROADCAST_TIMEOUT_S = 5.0  # a replica that does not answer /health or /stats within this counts as down


def _unavailable_errors() -> tuple[type[BaseException], ...]:
    """What a handle call raises when its replica died or cannot take requests: the client gets a 503."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, BackPressureError)


class TierlmRouter:
    """The ingress: forwards each HTTP request to one replica, answers /health and /stats for all of them."""

    def __init__(self, replicas, expected: int, api_key: str | None, max_body_bytes: int) -> None:
        self.replicas, self.expected = replicas, expected
        self.stream = replicas.options(stream=True)
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.unavailable = _unavailable_errors()
        self.counts = {"requests": 0, "replica_failures": 0}

    def __serve_build_asgi_app__(self):
        return GuardMiddleware(self._asgi, api_key=self.api_key, max_body_bytes=self.max_body_bytes)

    async def _asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        if scope["method"] == "GET" and scope["path"] == "/health":
            status, body = await self.health()
            await _send_json(send, status, body)
        elif scope["method"] == "GET" and scope["path"] == "/stats":
            await _send_json(send, 200, await self.stats())
        else:
            await self.forward(scope, receive, send)

    async def _broadcast(self, method: str) -> list:
        """Every live replica's answer to `method`; a replica that failed or timed out is left out."""
        try:
            results = await self.replicas.broadcast(method).results_async(
                timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True
            )
        except TimeoutError:
            return []
        return [r for r in results if isinstance(r, dict)]

    async def health(self) -> tuple[int, dict]:
        """200 only when `expected` replicas answer and every one is healthy."""
        answers = await self._broadcast("replica_health")
        healthy = [a for a in answers if a.get("healthy")]
        if healthy and len(healthy) == len(answers) >= self.expected:
            status = "ok"
        elif any(a.get("status") == "shutting_down" for a in answers):
            status = "shutting_down"
        else:
            status = "unavailable"
        body = {
            "status": status,
            "model": next((a["model"] for a in answers if "model" in a), None),
            "replicas": {a["replica"]: a.get("status") for a in answers},
            "expected_replicas": self.expected,
            "healthy_replicas": len(healthy),
        }
        return (200 if status == "ok" else 503), body

    async def stats(self) -> dict:
        answers = await self._broadcast("replica_stats")
        return {
            "replicas": {a["replica"]: a for a in answers},
            "expected_replicas": self.expected,
            "totals": aggregate_stats(answers),
            "router": dict(self.counts),
        }

    async def forward(self, scope, receive, send) -> None:
        self.counts["requests"] += 1
        body = await _read_body(receive)
        request = {
            "method": scope["method"],
            "path": scope["path"],
            "query_string": scope.get("query_string", b""),
            "headers": list(scope.get("headers", [])),
            "scheme": scope.get("scheme", "http"),
            "http_version": scope.get("http_version", "1.1"),
            "client": scope.get("client"),
            "body": body,
        }
        chunks = self.stream.handle_http.remote(request)
        streaming, started = False, False
        try:
            head = await chunks.__anext__()
            await send({"type": "http.response.start", "status": head["status"], "headers": head["headers"]})
            started = True
            streaming = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in head["headers"]
            )
            await send({"type": "http.response.body", "body": head["body"], "more_body": head["more"]})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if head["more"]:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except self.unavailable as err:
            self.counts["replica_failures"] += 1
            message = f"the replica serving this request stopped ({type(err).__name__}); retry the request"
            logger.warning("%s", message)
            error = error_body(503, message, code="replica_unavailable")
            if not started:
                await _send_json(send, 503, error, {"retry-after": "1"})
            elif streaming:  # the stream has begun: end it as the server ends streams it cannot finish
                tail = f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            else:
                raise
        finally:
            chunks.cancel()  # a no-op when the stream ended; else (client gone) the replica stops generating


async def _read_body(receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(parts)


async def _send_json(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(REPLICA_HEADER.encode(), ROUTER_NAME.encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def aggregate_stats(replicas: list[dict]) -> dict:
    """Counters summed over replicas (`max_*` ones take the maximum), counter tables merged key by key."""
    totals: dict[str, Any] = {}
    for stats in replicas:
        for key, value in stats.items():
            if key in ("pid", "cpu") or isinstance(value, bool):
                continue
            if isinstance(value, int):
                totals[key] = (
                    max(totals.get(key, value), value)
                    if key.startswith("max_")
                    else totals.get(key, 0) + value
                )
            elif isinstance(value, dict) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value.values()
            ):
                table = totals.setdefault(key, {})
                for k, v in value.items():
                    table[k] = table.get(k, 0) + v
    return totals
