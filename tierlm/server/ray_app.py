"""`tierlm serve --replicas N`: the OpenAI server as a Ray Serve application, N model replicas behind a router.

Each replica (`TierlmReplica`, a Ray actor of its own) loads the model and runs `build_app(model, ...)`, the
single-process server's FastAPI app with its own worker thread, in process; requests reach it as ASGI calls
through a DeploymentHandle and stream back message by message. The router (`TierlmRouter`) is the HTTP front:
uvicorn serves it in the `tierlm serve` process itself (the Ray driver, which owns the application's
lifetime anyway), on a socket bound before anything is deployed. It forwards every route to one replica,
which Ray Serve's handle picks (power of two choices over queue lengths), and answers `/health` and `/stats`
itself by asking every replica (`DeploymentHandle.broadcast`). So routes, validation, errors and streaming
are the single-process server's own; what Ray adds is which replica answers (the `x-tierlm-replica`
header), a 503 when that replica dies under a request, and replacing it. Ray Serve's HTTP proxy is not
started: a request crosses one Ray hop (front -> replica), not three (proxy -> ingress -> replica).

The replica is ray_replica.py, the router ray_router.py; this module holds what every replica is given
(`ReplicaSpec`), the placement check, and the application's lifetime (start Ray, bind, deploy, serve,
drain, stop).

Ray is optional (`pip install 'tierlm[ray]'`): these modules import it only inside functions, and nothing
imports them unless `--replicas` is given, so the single-process server never needs it.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

# Re-exported: the header that names the replica which answered, and its value on the router's own answers.
from tierlm.server.ray_replica import REPLICA_HEADER as REPLICA_HEADER
from tierlm.server.ray_replica import TierlmReplica
from tierlm.server.ray_router import BROADCAST_TIMEOUT_S, TierlmRouter
from tierlm.server.ray_router import ROUTER_NAME as ROUTER_NAME

logger = logging.getLogger("tierlm.server")

APP_NAME = "tierlm"
REPLICA = "TierlmReplica"
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20  # requests and chunks are small; Ray's default takes 30% of RAM
# Ray Serve's own switch for lower per-request overhead (user code and the handle's router on the replica's
# event loop, buffered request logs, gRPC between deployments). Direct ingress (ingress replicas with HTTP
# ports of their own) stays off: the replicas are no ingress, the front in this process is the one way in.
LOCAL_SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
RAY_MISSING = "tierlm serve --replicas needs Ray Serve, which is not installed: pip install 'tierlm[ray]'"


def import_ray():
    """(ray, ray.serve), or a one-line error naming the extra to install."""
    try:
        import ray
        from ray import serve
    except ImportError as err:
        raise RuntimeError(f"{RAY_MISSING} ({err})") from None
    return ray, serve


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica loads and serves: tierlm.load's and build_app's keywords, and its Ray resources."""

    load_kwargs: dict = field(default_factory=dict)
    app_kwargs: dict = field(default_factory=dict)
    cpus: float = 1.0
    gpus: float = 0.0

    def __post_init__(self) -> None:
        if self.cpus <= 0:
            raise ValueError(f"--replica-cpus must be > 0, got {self.cpus:g}")
        if self.gpus < 0:
            raise ValueError(f"--replica-gpus must be >= 0, got {self.gpus:g}")

    @property
    def threads(self) -> int:
        """torch threads per replica: the CPUs it reserved (Ray reserves, it does not pin)."""
        return max(1, int(self.cpus))

    @property
    def max_ongoing(self) -> int:
        """Requests Ray Serve may send one replica at once: what its worker runs and queues. The rest wait in
        the router, so each replica's queue stays short and new requests go to the least busy one."""
        batch, queue = self.app_kwargs.get("max_batch_size", 8), self.app_kwargs.get("max_queue", 64)
        return max(1, batch * 4 + queue)  # the worker runs up to 4 batches in turns (batcher.py)


# --- placement: fail before deploying, never wait for resources that do not exist -------------------------


def check_resources(nodes: list[dict[str, float]], replicas: int, cpus: float, gpus: float) -> None:
    """Raise a one-line ValueError unless `replicas` replicas of (cpus, gpus) fit on `nodes` (each node's
    total resources): a replica lives on one node, so each node holds floor(its CPUs / cpus) of them."""
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")

    def fits(node: dict[str, float]) -> int:
        n = math.floor(node.get("CPU", 0.0) / cpus + 1e-9)
        return min(n, math.floor(node.get("GPU", 0.0) / gpus + 1e-9)) if gpus > 0 else n

    placeable = sum(fits(node) for node in nodes)
    if placeable >= replicas:
        return
    total_cpus = sum(node.get("CPU", 0.0) for node in nodes)
    total_gpus = sum(node.get("GPU", 0.0) for node in nodes)
    asked = f"{replicas} x {cpus:g} CPU" + (f" + {gpus:g} GPU" if gpus else "")
    has = f"{total_cpus:g} CPUs" + (f" and {total_gpus:g} GPUs" if gpus else "")
    raise ValueError(
        f"--replicas {replicas} cannot be placed: they need {asked}, but the Ray cluster has {has} on "
        f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} (room for {placeable}); "
        "lower --replicas or --replica-cpus/--replica-gpus, or add nodes"
    )


def cluster_nodes(ray) -> list[dict[str, float]]:
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


# --- the application and its lifetime --------------------------------------------------------------------------


def application(replicas: int, spec: ReplicaSpec):
    """The Ray Serve application: `replicas` replicas of `spec` (no HTTP route: the front calls them)."""
    _ray, serve = import_ray()
    replica = serve.deployment(
        TierlmReplica,
        name=REPLICA,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": spec.cpus, "num_gpus": spec.gpus},
        max_ongoing_requests=spec.max_ongoing,
        graceful_shutdown_timeout_s=5,  # drain() has already let requests finish
        graceful_shutdown_wait_loop_s=0.2,
        health_check_period_s=2,
        max_constructor_retry_count=2,  # a model that does not load fails the deployment, not retries forever
    )
    return replica.bind(spec)


def start_ray(address: str | None, *, num_cpus: int | None = None, object_store_bytes: int | None = None):
    """Join the cluster at `address`, or start a local Ray instance (no dashboard, a small object store)."""
    ray, _serve = import_ray()
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    else:
        # The local instance's processes (and the replicas they start) inherit the environment at ray.init.
        saved = {key: os.environ.get(key) for key in LOCAL_SERVE_ENV}
        os.environ.update({key: os.environ.get(key) or value for key, value in LOCAL_SERVE_ENV.items()})
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                object_store_memory=object_store_bytes or LOCAL_OBJECT_STORE_BYTES,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return ray


class Front:
    """The router served over HTTP by uvicorn on a thread of this process. The socket is bound when the
    front is made, before anything is deployed, so a port in use refuses early and changes nothing."""

    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
            self.socket.listen(2048)  # reserved from here on (connections wait until uvicorn serves them)
        except OSError as err:
            self.socket.close()
            raise RuntimeError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
        bound = self.socket.getsockname()[1]  # port 0: the one the kernel picked
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{bound}"
        self.router: TierlmRouter | None = None
        self.server = self.thread = None

    def start(self, router: TierlmRouter, timeout: float = 30.0) -> None:
        """Serve `router` from a daemon thread; returns once it accepts connections."""
        import uvicorn

        config = uvicorn.Config(
            router.asgi_app(), log_level="warning", lifespan="on", timeout_graceful_shutdown=5
        )
        self.router, self.server = router, uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="tierlm-front", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP front on {self.url} did not start")
            time.sleep(0.02)

    def drain(self, grace_s: float) -> None:
        """The replicas refuse new requests; those in flight get `grace_s` to finish (TierlmRouter.drain)."""
        if self.router is not None and self.router.loop is not None:
            try:
                self.router.run(self.router.drain(grace_s), timeout=grace_s + 2 * BROADCAST_TIMEOUT_S + 5)
            except TimeoutError:
                logger.warning("the drain did not finish in time; stopping anyway")

    def close(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(15)
        self.socket.close()


def deploy(replicas: int, spec: ReplicaSpec, host: str = "127.0.0.1", port: int = 8000) -> Front:
    """Check placement and bind the port, deploy, wait until every replica has loaded, then serve HTTP."""
    front = prepare(replicas, spec, host, port)
    try:
        launch(replicas, spec, front)
    except BaseException:
        front.close()
        raise
    return front


def prepare(replicas: int, spec: ReplicaSpec, host: str, port: int) -> Front:
    """Everything that can refuse before the cluster changes: placement, the port, the name."""
    ray, serve = import_ray()
    check_resources(cluster_nodes(ray), replicas, spec.cpus, spec.gpus)
    front = Front(host, port)
    try:
        serve.start(proxy_location="Disabled")  # no HTTP proxy: the front is this process's
        if APP_NAME in serve.status().applications:
            raise RuntimeError(
                f"an application named {APP_NAME!r} already runs on this Ray cluster: stop its tierlm serve first"
            )
    except BaseException:
        front.close()
        raise
    return front


def launch(replicas: int, spec: ReplicaSpec, front: Front) -> None:
    """Deploy the replicas, wait until every one has loaded, then start the HTTP front over them."""
    _ray, serve = import_ray()
    target = serve.RunTarget(target=application(replicas, spec), name=APP_NAME, route_prefix=None)
    serve.run_many([target], wait_for_applications_running=False)
    _wait_running(serve)
    app_kwargs = spec.app_kwargs
    max_body = app_kwargs.get("max_body_bytes", 1_000_000)
    front.start(TierlmRouter(replica_handle(), replicas, app_kwargs.get("api_key"), max_body))


def replica_handle():
    """A handle of the replica deployment that is the caller's own: not Ray Serve's cached one, which
    `serve.shutdown()` would shut down on whatever loop it was bound to (the front's, closed by then)."""
    import_ray()
    from ray.serve.handle import DeploymentHandle

    return DeploymentHandle(REPLICA, APP_NAME)


def _wait_running(serve) -> None:
    """Until the application runs; a one-line error when it failed (a replica's constructor raised). Replicas
    Ray Serve has not scheduled after 30 s (resources the pre-check counted are in use elsewhere, or workers
    slow to start) are said once on stderr, with Ray's reason, and waited for."""
    said = False
    while True:
        app = serve.status().applications.get(APP_NAME)
        status = str(getattr(app, "status", ""))
        if status.endswith("RUNNING"):
            return
        messages = [d.message for d in app.deployments.values()] + [app.message] if app else []
        if status.endswith("DEPLOY_FAILED"):
            detail = next((m for m in messages if m), status)
            lines = [line.strip() for line in detail.splitlines() if line.strip()]
            raise RuntimeError(f"the replicas failed to start: {lines[-1] if lines else status}")
        unscheduled = next((m for m in messages if "to be scheduled" in (m or "")), None)
        if unscheduled and not said:
            logger.warning("still waiting for the replicas: %s", unscheduled.strip().splitlines()[0])
            said = True
        time.sleep(0.5)


def stop(front: Front | None, *, keep_cluster: bool, delete: bool = True) -> None:
    """Delete the application (if `delete`: it is ours; on a local instance stop Serve), then close the front
    (its loop outlives the application, so Ray Serve's updates to its handle still land) and leave Ray."""
    ray, serve = import_ray()
    try:
        if keep_cluster:
            if delete:
                serve.delete(APP_NAME)
        else:
            serve.shutdown()
    finally:
        try:
            if front is not None:
                front.close()
        finally:
            ray.shutdown()


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def serve_replicas(
    replicas: int,
    spec: ReplicaSpec,
    *,
    ray_address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_grace_s: float = 10.0,
) -> None:
    """`tierlm serve --replicas N`: deploy, serve until SIGINT/SIGTERM, drain, stop."""
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    signal.signal(signal.SIGTERM, _interrupt)  # while deploying, SIGTERM stops as Ctrl-C does: the finally
    start_ray(ray_address)  # below deletes what was deployed
    front = None
    try:
        front = prepare(replicas, spec, host, port)  # from here on the application is ours to delete
        launch(replicas, spec, front)
        logger.warning("serving on %s with %d replicas (Ctrl-C stops)", front.url, replicas)
        stopping = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopping.set())
        while not stopping.wait(1.0):
            pass
        logger.warning("shutting down: in-flight requests have %.1f s to finish", shutdown_grace_s)
        front.drain(shutdown_grace_s)
    finally:
        stop(front, keep_cluster=bool(ray_address), delete=front is not None)
