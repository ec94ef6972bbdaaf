"""A server decodes on one OS thread whose OpenMP team is the process's only one (tierlm.server.compute): the
thread that loaded the model has its team freed by build_app. Two threads that have run parallel torch ops
hold two teams, and GNU OpenMP then makes both sleep between parallel loops: a CPU decode at half speed
(measured in tierlm.server.compute's docstring; speed is a benchmark's, the threads are what is tested)."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch
from fastapi.testclient import TestClient
from test_server import NAME, write_served_model

import tierlm
import tierlm.server
from tierlm.cli import main
from tierlm.server import build_app
from tierlm.server.compute import ComputeThread


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_served_model(tmp_path_factory.mktemp("threads") / "tiny")


def record_forward_threads(model) -> list[int]:
    """The thread of every forward of `model`'s decoder from here on (prefill chunks and decode steps)."""
    threads: list[int] = []
    model.decoder.register_forward_pre_hook(lambda *_: threads.append(threading.get_ident()))
    return threads


def tasks() -> set[int]:
    """The process's OS threads."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def parallel_op() -> None:
    torch.ones(1 << 24).add_(1)  # at::parallel_for over 16M elements: the calling thread's team runs it


def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_tierlm_serve_decodes_on_one_thread_and_frees_the_loading_threads_team(
    tiny_dir, monkeypatch, batching
):
    """`tierlm serve` loads the model on its main thread; build_app frees that thread's OpenMP team (after
    its parallel ops), and every forward runs on the worker's thread."""
    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: no OpenMP team")
    served: dict = {}

    def run_server(model, host, port, **kwargs):
        """Instead of uvicorn: the app run_server would serve, one request through its lifespan."""
        threads = record_forward_threads(model)
        parallel_op()  # this thread has a team (the tiny model's load may not have needed one)
        before = tasks()
        app = build_app(model, **kwargs)
        wait_until(
            lambda: len(before - tasks()) >= torch.get_num_threads() - 1 or not _gnu_openmp(), "no team freed"
        )
        served["freed"] = before - tasks()
        with TestClient(app) as client:
            body = {"model": NAME, "prompt": "Hello", "max_tokens": 5, "temperature": 0}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            served["scheduler"], served["threads"] = client.app.state.tierlm.scheduler, threads

    monkeypatch.setattr(tierlm.server, "run_server", run_server)
    code = main(
        ["serve", "--model", str(tiny_dir), "--dtype", "float32", "--port", "0", "--batching", batching]
    )
    assert code == 0
    assert served["scheduler"].batching == batching
    if not _gnu_openmp():
        pytest.skip("torch's OpenMP is not GNU OpenMP here: no team is freed")
    assert len(served["freed"]) >= torch.get_num_threads() - 1  # the main thread's team
    workers = set(served["threads"])
    assert len(served["threads"]) >= 5 and len(workers) == 1  # the prefill and 4 steps, on one thread
    assert workers != {threading.get_ident()}


def test_stopped_servers_leave_no_thread_or_model_behind(tiny_dir):
    """A server's worker thread ends when its app's lifespan does, and holds nothing of its model after."""
    models = []
    before = tasks()
    for _ in range(3):
        model = tierlm.load(tiny_dir, dtype="float32")
        with TestClient(build_app(model)) as client:
            body = {"model": NAME, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
        models.append(weakref.ref(model))
        del model, client
    wait_until(lambda: tasks() <= before, f"threads left: {tasks() - before}")
    gc.collect()
    assert [m() for m in models] == [None, None, None]


def test_a_compute_thread_runs_jobs_in_order_and_hands_back_errors():
    compute = ComputeThread(name="tierlm-test")
    order: list[int] = []
    futures = [compute.submit(order.append, i) for i in range(5)]
    assert [f.result(10) for f in futures] == [None] * 5 and order == list(range(5))
    with pytest.raises(ValueError, match="bad job"):
        compute.call(lambda: (_ for _ in ()).throw(ValueError("bad job")))
    assert compute.call(lambda: compute.call(threading.get_ident)) == compute.ident  # a job calling another
    assert compute.call(torch.get_num_threads) == torch.get_num_threads()
    native = compute.call(threading.get_native_id)
    compute.close()
    wait_until(lambda: native not in tasks(), "the closed thread did not end")
    with pytest.raises(RuntimeError, match="closed"):
        compute.submit(print)


def test_build_app_frees_the_openmp_team_of_the_thread_that_calls_it(tiny_dir):
    """The thread that loaded the model and builds the app has its team freed: its threads end, and a
    parallel op it runs later makes a new team."""
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one torch thread: no OpenMP team")
    compute = ComputeThread(name="tierlm-test")
    model = compute.call(tierlm.load, tiny_dir, dtype="float32")
    compute.call(parallel_op)  # the thread's team exists, whether or not the load made it
    if not _gnu_openmp():
        pytest.skip("torch's OpenMP is not GNU OpenMP here")
    before = tasks()
    app = compute.call(build_app, model)
    wait_until(lambda: len(before - tasks()) >= threads - 1, "the team's threads did not end")
    after = tasks()
    compute.call(parallel_op)
    assert len(tasks() - after) == threads - 1  # a new team
    compute.close()
    del app


def _gnu_openmp() -> bool:
    from tierlm.server.compute import _omp_pause

    return _omp_pause() is not None
