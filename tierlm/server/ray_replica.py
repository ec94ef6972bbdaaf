"""`TierlmReplica`: one model replica of `tierlm serve --replicas N`, the single-process app driven in process.

Ray is imported only inside its methods (they run in a Ray actor); see ray_app.py for the whole picture.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierlm.server.ray_app import ReplicaSpec

logger = logging.getLogger("tierlm.server")

REPLICA_HEADER = "x-tierlm-replica"


class TierlmReplica:
    """One model replica: `build_app(model)` driven in process; `handle_http` streams one HTTP exchange."""

    async def __init__(self, spec: ReplicaSpec) -> None:
        import torch
        from ray import serve

        from tierlm.model import load
        from tierlm.server.app import build_app

        def build_here():  # build_app frees this thread's OpenMP team: the worker's decodes alone
            return build_app(load(**spec.load_kwargs), **spec.app_kwargs)

        torch.set_num_threads(spec.threads)
        self.name = serve.get_replica_context().replica_id.unique_id
        # loaded, and packaged steps prepared, off the replica's event loop, which stays responsive
        self.app = await asyncio.to_thread(build_here)
        self.scheduler = self.app.state.tierlm.scheduler
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the worker thread, as uvicorn would
        self._background: set[asyncio.Task] = set()
        logger.info("replica %s serving (pid %d)", self.name, os.getpid())

    async def handle_http(self, request: dict):
        """Run one request through the app: yields {"status", "headers", "body", "more"} (the response's start
        with its first body message: a JSON answer is one item), then the rest of the body chunk by chunk."""
        body, sent = request.pop("body"), False
        disconnected = asyncio.Event()
        messages: asyncio.Queue = asyncio.Queue()

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        scope = {
            **request,
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "raw_path": request["path"].encode(),
            "root_path": "",
            "headers": [(bytes(k), bytes(v)) for k, v in request["headers"]],
            "client": tuple(request["client"]) if request.get("client") else None,
            "server": None,
            "state": {},
        }
        task = asyncio.create_task(self.app(scope, receive, messages.put))
        task.add_done_callback(lambda _t: messages.put_nowait(None))
        head = None
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.name.encode())]
                    head = {"status": message["status"], "headers": headers}
                elif message["type"] == "http.response.body":
                    more = bool(message.get("more_body"))
                    if head is not None:
                        yield {**head, "body": message.get("body", b""), "more": more}
                        head = None
                    elif message.get("body"):
                        yield message["body"]
                    if not more:
                        break
        finally:
            disconnected.set()  # a client that went away (the router cancelled us) cancels its generation
            self._background.add(task)
            task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("request ended with %r (already answered by the app)", task.exception())

    async def _get(self, path: str) -> tuple[int, dict]:
        """GET `path` from the app in process: (status, JSON body)."""
        request = {"method": "GET", "path": path, "query_string": b"", "headers": [], "body": b""}
        request.update(scheme="http", http_version="1.1", client=None)
        status, chunks = 500, []
        async for item in self.handle_http(request):
            if isinstance(item, dict):
                status, item = item["status"], item["body"]
            chunks.append(item)
        return status, json.loads(b"".join(chunks) or b"{}")

    async def replica_health(self) -> dict:
        status, body = await self._get("/health")
        return {**body, "replica": self.name, "healthy": status == 200}

    async def replica_stats(self) -> dict:
        _status, body = await self._get("/stats")
        return {"replica": self.name, "pid": os.getpid(), "host": socket.gethostname(), **body}

    async def begin_drain(self, grace_s: float) -> dict:
        """Refuse new requests; those in flight have `grace_s` to finish, as in the single-process server."""
        self.scheduler.begin_drain(grace_s)
        return {"replica": self.name}

    async def __del__(self) -> None:
        await self._lifespan.__aexit__(None, None, None)  # stops the worker thread
