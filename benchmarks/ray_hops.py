"""What Ray Serve's hops add to a request on this machine, with no model behind them: the floor under the
router overhead that `benchmarks/serve.py --replicas` measures.

A local Ray instance (2 CPUs, the environment `tierlm serve --replicas` sets: ray_app.LOCAL_SERVE_ENV) runs
a leaf deployment that answers at once, and an ingress deployment (a raw ASGI app) behind Ray's HTTP proxy.
Routes:
- proxy -> ingress: the ingress answers itself (client -> Ray's HTTP proxy -> ingress replica);
- proxy -> ingress -> leaf: the ingress asks the leaf through a DeploymentHandle, one call or a stream (the
  shape tierlm's router had as a Ray Serve ingress deployment);
- tierlm's front -> leaf: `ray_app.Front` serving `TierlmRouter` from this process (the Ray driver) over the
  leaf's handle, as `tierlm serve --replicas` does now: one Ray hop;
- the same with Ray Serve's default router loop (a thread of its own) instead of the serving loop.
Each is timed over HTTP keep-alive on loopback (median of `--requests`), against a bare uvicorn server
answering the same bytes from a thread of this process (no Ray).

    python benchmarks/ray_hops.py [--requests 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import statistics
import threading
import time

import torch

BODY = b'{"ok":1}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def _lifespan(receive, send) -> None:
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def _answer(send, headers=HEADERS, body=BODY) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Bare:
    """The same answer from a plain ASGI app (the no-Ray baseline)."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        await _answer(send)


def deployments(serve):
    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Leaf:
        async def unary(self, request: dict) -> dict:
            return {"headers": HEADERS, "body": BODY}

        async def stream(self, request: dict):
            yield {"headers": HEADERS, "body": BODY}

        async def handle_http(self, request: dict):  # TierlmReplica's: the response start with its body
            yield {"status": 200, "headers": HEADERS, "body": BODY, "more": False}

    class Ingress:
        def __init__(self, leaf) -> None:
            self.leaf, self.streaming = leaf, leaf.options(stream=True)

        def __serve_build_asgi_app__(self):
            ingress = self

            class App:
                async def __call__(self, scope, receive, send) -> None:
                    await ingress.asgi(scope, receive, send)

            return App()

        async def asgi(self, scope, receive, send) -> None:
            if scope["type"] == "lifespan":
                return await _lifespan(receive, send)
            path = scope["path"]
            if path.endswith("/direct"):
                return await _answer(send)
            if path.endswith("/unary"):
                answer = await self.leaf.unary.remote({"path": path})
                return await _answer(send, answer["headers"], answer["body"])
            chunks = self.streaming.stream.remote({"path": path})
            head = await chunks.__anext__()
            await _answer(send, head["headers"], head["body"])
            async for _ in chunks:
                pass

    ingress = serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)(
        serve.ingress()(Ingress)
    )
    return ingress.bind(Leaf.bind())


def tierlm_front(serve, port: int, separate_loop: bool):
    """tierlm's own front (ray_app.Front, TierlmRouter) over the leaf's handle, served from this process."""
    from tierlm.server.ray_app import Front
    from tierlm.server.ray_router import TierlmRouter

    class Router(TierlmRouter):
        def _bind(self) -> None:
            if separate_loop:  # leave the handle to Ray Serve's default: its router on a loop of its own
                self.replicas._init(_run_router_in_separate_loop=True)
            super()._bind()

    from ray.serve.handle import DeploymentHandle

    front = Front("127.0.0.1", port)
    front.start(Router(DeploymentHandle("Leaf", "hops"), 1, None, 1_000_000))  # a handle of its own
    return front


def median_ms(port: int, path: str, n: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    times = []
    for i in range(n + 10):
        start = time.perf_counter()
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status}")
        if i >= 10:  # warm-up
            times.append((time.perf_counter() - start) * 1e3)
    conn.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8351)
    args = parser.parse_args()

    from tierlm.server.ray_app import LOCAL_SERVE_ENV

    for key, value in LOCAL_SERVE_ENV.items():  # read by Ray Serve's constants at import; as tierlm serve
        os.environ.setdefault(key, value)  # does, a value the user set stays
    import ray
    import uvicorn
    from ray import serve

    bare = uvicorn.Server(uvicorn.Config(Bare(), host="127.0.0.1", port=args.port + 1, log_level="error"))
    threading.Thread(target=bare.run, daemon=True).start()
    while not bare.started:
        time.sleep(0.05)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = {
        "no Ray (uvicorn)": [],
        "/direct": [],
        "/unary": [],
        "/stream": [],
        "front": [],
        "front, thread": [],
    }
    fronts = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(deployments(serve), name="hops", route_prefix="/")
        fronts.append(tierlm_front(serve, args.port + 2, False))
        fronts.append(tierlm_front(serve, args.port + 3, True))
        for _ in range(args.rounds):
            rows["no Ray (uvicorn)"].append(median_ms(args.port + 1, "/", args.requests))
            for path in ("/direct", "/unary", "/stream"):
                rows[path].append(median_ms(args.port, path, args.requests))
            rows["front"].append(median_ms(args.port + 2, "/v1/models", args.requests))
            rows["front, thread"].append(median_ms(args.port + 3, "/v1/models", args.requests))
    finally:
        serve.shutdown()
        for front in fronts:
            front.close()
        ray.shutdown()
        bare.should_exit = True

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = {key: os.environ[key] for key in LOCAL_SERVE_ENV}
    print(
        f"cpu: {cpu}, {os.cpu_count()} CPUs, torch.backends.cpu.get_cpu_capability() = "
        f"{torch.backends.cpu.get_cpu_capability()}; ray {ray.__version__}; {env}"
    )
    print(f"median ms of {args.requests} GETs (HTTP keep-alive, loopback); median of {args.rounds} rounds")
    base = statistics.median(rows["no Ray (uvicorn)"])
    print(f"{'route':<58} {'ms':>7} {'added ms':>9}")
    what = {
        "no Ray (uvicorn)": "no Ray (uvicorn)",
        "/direct": "proxy -> ingress",
        "/unary": "proxy -> ingress -> leaf (unary)",
        "/stream": "proxy -> ingress -> leaf (stream)",
        "front": "tierlm's front -> leaf (stream; tierlm serve --replicas)",
        "front, thread": "tierlm's front -> leaf (stream), router on its own loop",
    }
    for key, values in rows.items():
        ms = statistics.median(values)
        print(f"{what[key]:<58} {ms:7.2f} {ms - base:9.2f}")


if __name__ == "__main__":
    main()
