"""`TierlmRouter`: the HTTP front of `tierlm serve --replicas N`, served by uvicorn in the `tierlm serve`
process itself (the Ray driver). It forwards each request to one replica through a Ray Serve
DeploymentHandle and answers `/health` and `/stats` for all of them; see ray_app.py for the whole picture.

Why not a Ray Serve ingress deployment behind Ray's HTTP proxy: each Ray Serve hop costs milliseconds on a
small machine (benchmarks/ray_hops.py: proxy -> ingress -> replica 9-10 ms on a 2-core Zen 4, a handle call
from this process 1.5 ms), and the proxy would be a hop of its own before the router's. Ray is imported only
inside functions.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from tierlm.server.errors import GuardMiddleware, error_body
from tierlm.server.ray_replica import REPLICA_HEADER

logger = logging.getLogger("tierlm.server")

ROUTER_NAME = "router"  # the header's value on answers the router gives itself (health, stats, its errors)
BROADCAST_TIMEOUT_S = 5.0  # a replica that does not answer /health or /stats within this counts as down
# How the front's requests travel (Ray Serve's handle options; every replica runs the gRPC server they use):
# over gRPC rather than as Ray object references, pickled rather than cloudpickled. GET /v1/models through
# one replica, 2-core Zen 4: 7.1 ms by reference, 3.9 ms this way (0.7 ms without Ray).
DIRECT_CALLS = {"_by_reference": False, "request_serialization": "pickle", "response_serialization": "pickle"}


def _unavailable_errors() -> tuple[type[BaseException], ...]:
    """What a handle call raises when its replica died or cannot take requests: the client gets a 503."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, BackPressureError)


class TierlmRouter:
    """The front: forwards each HTTP request to one replica, answers /health and /stats for all of them.

    `replicas` is an uninitialized DeploymentHandle of the replica deployment. The router binds it to the
    event loop that serves HTTP when that loop starts (lifespan startup): Ray Serve then picks replicas on
    this loop, with no hand-off to a thread of its own (1.5 against 2.3 ms a request, benchmarks/ray_hops.py).
    Everything that uses the handle runs on that loop; `run()` submits a coroutine to it from another thread.
    """

    def __init__(self, replicas, expected: int, api_key: str | None, max_body_bytes: int) -> None:
        self.replicas, self.expected = replicas, expected
        self.stream = None  # the streaming handle, made on the serving loop
        self.loop: asyncio.AbstractEventLoop | None = None
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.unavailable = _unavailable_errors()
        self.counts = {"requests": 0, "replica_failures": 0}
        self.draining = False

    def asgi_app(self) -> GuardMiddleware:
        return GuardMiddleware(self._asgi, api_key=self.api_key, max_body_bytes=self.max_body_bytes)

    def _bind(self) -> None:
        """Bind the handle to the running loop (Ray Serve's own knob; a Ray without it, or a handle already
        initialized, keeps what it has)."""
        self.loop = asyncio.get_running_loop()
        try:
            self.replicas._init(_run_router_in_separate_loop=False)
        except (AttributeError, TypeError, RuntimeError) as err:
            logger.info("the replica handle keeps Ray Serve's default router loop (%s)", err)
        try:  # requests and chunks go over the replica's gRPC server, pickled (plain dicts and bytes)
            self.stream = self.replicas.options(stream=True, **DIRECT_CALLS)
        except TypeError as err:
            logger.info("the replica handle keeps Ray Serve's default transport (%s)", err)
            self.stream = self.replicas.options(stream=True)

    def run(self, coroutine, timeout: float) -> Any:
        """Run `coroutine` on the serving loop from another thread; its result, or TimeoutError."""
        if self.loop is None:
            raise RuntimeError("the router is not serving yet")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    async def _asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                self._bind()
                await send({"type": "lifespan.startup.complete"})
            await self.replicas.shutdown_async()  # its router lives on this loop, which ends here
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

    async def _broadcast(self, method: str, *args) -> list:
        """Every live replica's answer to `method`; a replica that failed or timed out is left out."""
        try:
            results = await self.replicas.broadcast(method, *args).results_async(
                timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True
            )
        except (TimeoutError, *self.unavailable):  # no replica answered (none is up, or all timed out)
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

    async def drain(self, grace_s: float) -> None:
        """Graceful shutdown: replicas refuse new requests and give those in flight `grace_s` to finish (then
        end them with an error, as the single-process server does); returns when none is left or after it."""
        self.draining = True  # from now on the front answers new requests with the shutdown error itself
        draining = {a["replica"] for a in await self._broadcast("begin_drain", grace_s)}
        deadline = self.loop.time() + grace_s + 2
        while self.loop.time() < deadline:
            stats = await self._broadcast("replica_stats")
            idle = {s["replica"] for s in stats if not s.get("running") and not s.get("queued")}
            if draining <= idle:  # a replica that did not answer is not known to be idle
                return
            await asyncio.sleep(0.1)

    async def forward(self, scope, receive, send) -> None:
        """One request to one replica, its answer copied back; a client that leaves (uvicorn says so through
        `receive`, not `send`) cancels the call, and the replica's app sees the disconnect."""
        self.counts["requests"] += 1
        if self.draining:
            error = error_body(503, "the server is shutting down", code="server_shutting_down")
            await _send_json(send, 503, error)
            return
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
        relay = asyncio.ensure_future(self._relay(chunks, send))
        gone = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if relay.done():
                relay.result()  # its exception, if any
        finally:
            gone.cancel()
            if not relay.done():  # the client left (or this request was cancelled): what it raises is moot
                relay.add_done_callback(lambda task: task.cancelled() or task.exception())
                relay.cancel()
            chunks.cancel()  # a no-op when the stream ended; else the replica stops generating (best effort:
            # Ray Serve cancels a call still being assigned, or one whose replica the relay already holds)

    async def _relay(self, chunks, send) -> None:
        """Copy the replica's answer to `send`; a replica that died under it ends it with a 503."""
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


async def _disconnect(receive) -> None:
    """Returns when the client has gone (after the request body, `receive` has nothing else to say)."""
    while (await receive())["type"] != "http.disconnect":
        pass


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
