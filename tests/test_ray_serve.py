"""`tierlm serve --replicas`: the OpenAI server as Ray Serve replicas on a local Ray instance, served for real on
loopback: answers equal the single-process server's, replicas share the load, a killed replica costs its own
requests a 503 and is replaced, placement that cannot fit is a one-line error, shutdown drains."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import NAME, free_port, serve, tiny_dir  # noqa: F401 (tiny_dir is a fixture)

import tierlm
from tierlm import cli
from tierlm.server import ray_app

HEADER = ray_app.REPLICA_HEADER
PROMPTS = [f"Request number {i}: " + "tiny words " * (i % 5) for i in range(16)]
needs_ray = pytest.mark.skipif(
    __import__("importlib").util.find_spec("ray") is None, reason="the tierlm[ray] extra is not installed"
)


def chat_body(prompt: str, max_tokens: int = 12, **fields) -> dict:
    messages = [{"role": "user", "content": prompt}]
    return {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}


def post(url: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout, trust_env=False)


def get(url: str, path: str) -> httpx.Response:
    return httpx.get(f"{url}{path}", timeout=30, trust_env=False)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.2)
    return result


def stream_events(url: str, body: dict, timeout: float = 120) -> tuple[httpx.Response, list[str]]:
    """A streamed chat completion: the response (headers) and its `data:` payloads."""
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=timeout, trust_env=False
    ) as response:
        if response.status_code != 200:
            response.read()
            return response, []
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return response, events


def served_by(responses: list[httpx.Response]) -> set[str]:
    return {r.headers[HEADER] for r in responses}


def check_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert error["message"]


# --- a local Ray instance with two replicas of the tiny model, for the whole module ---------------------------


@pytest.fixture(scope="module")
def front(tiny_dir) -> Iterator[ray_app.Front]:  # noqa: F811
    """The HTTP front (in this process) over 2 replicas on a local Ray instance."""
    spec = ray_app.ReplicaSpec(
        load_kwargs={"path": str(tiny_dir), "dtype": "float32"}, app_kwargs={"model_name": NAME}, cpus=1
    )
    ray_app.start_ray(None, num_cpus=2, object_store_bytes=128 * 2**20)
    served = None
    try:
        served = ray_app.deploy(2, spec, port=free_port())
        yield served
    finally:
        ray_app.stop(served, keep_cluster=False)


@pytest.fixture(scope="module")
def cluster(front) -> str:
    return front.url


@pytest.fixture(scope="module")
def single_process_answers(tiny_dir) -> list[str]:  # noqa: F811
    """Each prompt's greedy answer from the single-process server, one request at a time."""
    with serve(tierlm.load(tiny_dir, dtype="float32")) as live:
        return [post(live.url, chat_body(p)).json()["choices"][0]["message"]["content"] for p in PROMPTS]


def replica_stats(url: str) -> dict[str, dict]:
    return get(url, "/stats").json()["replicas"]


def healthy_replicas(url: str) -> set[str] | None:
    """The replicas' names when /health says all of them are healthy, else None."""
    response = get(url, "/health")
    body = response.json()
    assert response.headers[HEADER] == ray_app.ROUTER_NAME  # the router's own answer
    if response.status_code != 200:
        return None
    assert body["status"] == "ok" and body["healthy_replicas"] == body["expected_replicas"] == 2
    return set(body["replicas"])


# --- answers, load sharing, streaming, health and stats ---------------------------------------------------


@needs_ray
def test_two_replicas_answer_sixteen_clients_as_the_single_process_server(cluster, single_process_answers):
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda p: post(cluster, chat_body(p)), PROMPTS))
    assert [r.status_code for r in responses] == [200] * 16
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == single_process_answers
    names = healthy_replicas(cluster)
    assert served_by(responses) == names and len(names) == 2  # both replicas served some

    stats = get(cluster, "/stats").json()
    assert set(stats["replicas"]) == names
    assert all(s["requests"] > 0 and s["pid"] != os.getpid() for s in stats["replicas"].values())
    per_replica = [s["requests"] for s in stats["replicas"].values()]
    assert stats["totals"]["requests"] == sum(per_replica) >= 16
    assert stats["totals"]["generated_tokens"] == sum(
        s["generated_tokens"] for s in stats["replicas"].values()
    )


@needs_ray
def test_streamed_answer_through_ray_equals_the_non_streamed_one(cluster):
    body = chat_body("Hello, world! How are you today?", max_tokens=20)
    whole = post(cluster, body)
    with httpx.stream(
        "POST", f"{cluster}/v1/chat/completions", json={**body, "stream": True}, timeout=60, trust_env=False
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.headers[HEADER] in healthy_replicas(cluster)
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == whole.json()["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@needs_ray
def test_errors_keep_the_single_process_shape_and_name_the_replica(cluster):
    response = post(cluster, {**chat_body("hi"), "model": "nope"})
    check_openai_error(response, 404, "model_not_found")
    assert response.headers[HEADER] in healthy_replicas(cluster)


@needs_ray
def test_a_client_that_leaves_mid_stream_cancels_its_generation_on_the_replica(cluster):
    body = {**chat_body("A very long answer, please.", max_tokens=3000), "stream": True}
    with httpx.stream(
        "POST", f"{cluster}/v1/chat/completions", json=body, timeout=60, trust_env=False
    ) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    # closed after the first event: the router cancels the handle call, the replica's app sees the disconnect

    def cancelled_and_idle() -> bool:
        totals = get(cluster, "/stats").json()["totals"]
        return totals.get("finish_reasons", {}).get("cancelled", 0) >= 1 and totals["running"] == 0

    wait_until(cancelled_and_idle, 60, "the generation to be cancelled")


# --- faults ------------------------------------------------------------------------------------------------


@needs_ray
def test_a_killed_replica_fails_its_requests_with_503_and_is_replaced(cluster):
    before = healthy_replicas(cluster)
    assert before is not None
    victim_name, victim = next(iter(replica_stats(cluster).items()))
    long = [chat_body(p, max_tokens=400) for p in PROMPTS]  # long enough to be running when the kill comes
    with ThreadPoolExecutor(16) as pool:
        whole = [pool.submit(post, cluster, body, 120) for body in long[:8]]
        streamed = [pool.submit(stream_events, cluster, body, 120) for body in long[8:]]
        wait_until(
            lambda: replica_stats(cluster).get(victim_name, {}).get("running"), 60, "a running request"
        )
        os.kill(victim["pid"], signal.SIGKILL)
        responses = [f.result(timeout=150) for f in whole]  # none hangs
        streams = [f.result(timeout=150) for f in streamed]
    failed = [r for r in responses if r.status_code != 200]
    for response in failed:
        check_openai_error(response, 503, "replica_unavailable")
        assert response.headers.get("retry-after") == "1"
    assert all(r.headers[HEADER] != victim_name for r in responses if r.status_code == 200)
    broken = 0
    for response, events in streams:  # a stream that had begun ends with the error event, then [DONE]
        if response.status_code != 200:  # one that had not is a 503 like any request
            check_openai_error(response, 503, "replica_unavailable")
            broken += 1
            continue
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if "error" in last:
            assert last["error"]["code"] == "replica_unavailable" and response.headers[HEADER] == victim_name
            broken += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert failed or broken, "the killed replica was running requests: they must fail"

    after = wait_until(lambda: healthy_replicas(cluster), 150, "two healthy replicas again")
    assert victim_name not in after and len(after) == 2  # Ray Serve started a new replica

    seen: set[str] = set()
    for _round in range(6):  # both replicas, the new one included, take requests
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda p: post(cluster, chat_body(p)), PROMPTS[:8]))
        assert all(r.status_code == 200 for r in responses)
        seen |= served_by(responses)
        if seen == after:
            break
    assert seen == after


# --- placement and the optional extra ---------------------------------------------------------------------------


def test_the_front_holds_its_port_from_the_start_and_a_port_in_use_is_refused():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"cannot listen on 127.0.0.1:{port}: Address already in use"):
            ray_app.Front("127.0.0.1", port)
    front = ray_app.Front("127.0.0.1", 0)  # made before deploying: nobody else may take the port meanwhile
    try:
        port = front.socket.getsockname()[1]
        assert front.url == f"http://127.0.0.1:{port}" and port != 0  # the log names the port clients use
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
                other.listen()
    finally:
        front.close()


def test_placement_counts_replicas_per_node():
    two_nodes = [{"CPU": 3.0}, {"CPU": 3.0, "GPU": 1.0}]
    ray_app.check_resources(two_nodes, 2, cpus=2, gpus=0)
    ray_app.check_resources(two_nodes, 1, cpus=1, gpus=1)
    with pytest.raises(
        ValueError, match=r"need 3 x 2 CPU, but the Ray cluster has 6 CPUs on 2 nodes \(room for 2\)"
    ):
        ray_app.check_resources(two_nodes, 3, cpus=2, gpus=0)  # 6 CPUs in all, but 3 halves do not fit
    with pytest.raises(ValueError, match=r"2 x 1 CPU \+ 1 GPU.*1 GPUs"):
        ray_app.check_resources(two_nodes, 2, cpus=1, gpus=1)


@needs_ray
def test_more_cpus_than_the_machine_has_is_a_one_line_error(tiny_dir):  # noqa: F811
    cpus = os.cpu_count()
    argv = ["serve", "--model", str(tiny_dir), "--replicas", "2", "--replica-cpus", str(cpus)]
    argv += ["--port", str(free_port())]
    done = subprocess.run(
        [sys.executable, "-m", "tierlm.cli", *argv], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert sum(line.startswith("tierlm: error") for line in lines) == 1, done.stderr
    assert lines[-1].startswith(f"tierlm: error: --replicas 2 cannot be placed: they need 2 x {cpus} CPU")


@needs_ray
def test_joining_a_cluster_with_too_few_cpus_is_a_one_line_error(cluster, tiny_dir):  # noqa: F811
    import ray

    address = ray.get_runtime_context().gcs_address  # the module's running instance: 2 CPUs
    argv = ["serve", "--model", str(tiny_dir), "--ray-address", address, "--replicas", "3"]
    done = subprocess.run(
        [sys.executable, "-m", "tierlm.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert sum(line.startswith("tierlm: error") for line in lines) == 1, done.stderr
    assert lines[-1].startswith("tierlm: error: --replicas 3 cannot be placed: they need 3 x 1 CPU")
    assert healthy_replicas(cluster) is not None  # the cluster and its application are untouched


def test_without_ray_serve_replicas_is_a_one_line_error_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    assert cli.main(["serve", "--replicas", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tierlm: error: ") and "tierlm[ray]" in err


def test_the_single_process_server_does_not_import_ray():
    code = "import sys, tierlm.cli, tierlm.server.ray_app; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# --- graceful shutdown (last: it drains the module's replicas) -----------------------------------------------


@needs_ray
def test_shutdown_drains_running_requests_and_refuses_new_ones(front, cluster):
    wait_until(lambda: healthy_replicas(cluster), 150, "two healthy replicas")
    first_chunk = threading.Event()
    result: dict = {}

    def streamed() -> None:
        body = {**chat_body("A long answer, please.", max_tokens=200), "stream": True}
        with httpx.stream(
            "POST", f"{cluster}/v1/chat/completions", json=body, timeout=120, trust_env=False
        ) as stream:
            lines = []
            for line in stream.iter_lines():
                first_chunk.set()
                lines.append(line)
        result["events"] = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]

    def drain() -> None:
        try:
            front.drain(60.0)
            result["running_after_drain"] = get(cluster, "/stats").json()["totals"]["running"]
        except BaseException as err:  # noqa: BLE001 (reported by the assertion below)
            result["drain_error"] = err

    client = threading.Thread(target=streamed)
    client.start()
    assert first_chunk.wait(60)
    draining = threading.Thread(target=drain)
    draining.start()
    wait_until(lambda: get(cluster, "/health").json()["status"] == "shutting_down", 30, "the drain to begin")
    check_openai_error(post(cluster, chat_body("too late")), 503, "server_shutting_down")
    client.join(120)
    draining.join(120)
    assert not client.is_alive() and not draining.is_alive()
    assert "drain_error" not in result, result.get("drain_error")
    assert result["running_after_drain"] == 0  # the drain returned once the running request had finished
    events = result["events"]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # it ran to the end
