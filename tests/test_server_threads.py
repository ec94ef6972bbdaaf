"""A server's torch work runs on one OS thread (tierlm.server.compute): the model's load, its compiled steps'
start-up and every decode step. Two threads that run torch ops hold two OpenMP teams, and GNU OpenMP then
makes both sleep between parallel loops: a CPU decode at half speed (measured in tierlm.server.compute's
docstring; speed is a benchmark's, the thread is what is tested here)."""

from __future__ import annotations

import threading

import pytest
import torch
from fastapi.testclient import TestClient
from test_server import NAME, write_served_model

import tierlm
import tierlm.cli.serve
import tierlm.server
from tierlm.cli import main
from tierlm.server import ComputeThread, build_app


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_served_model(tmp_path_factory.mktemp("threads") / "tiny")


def record_forward_threads(model) -> list[int]:
    """The thread of every forward of `model`'s decoder from here on (prefill chunks and decode steps)."""
    threads: list[int] = []
    model.decoder.register_forward_pre_hook(lambda *_: threads.append(threading.get_ident()))
    return threads


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_tierlm_serve_loads_and_decodes_on_the_thread_of_its_worker(tiny_dir, monkeypatch, batching):
    loads: list[int] = []
    load = tierlm.cli.serve.load_model

    def recorded_load(args):
        loads.append(threading.get_ident())
        return load(args)

    served: dict = {}

    def run_server(model, host, port, **kwargs):
        """Instead of uvicorn: the app run_server would serve, one request through its lifespan."""
        threads = record_forward_threads(model)
        with TestClient(build_app(model, **kwargs)) as client:
            body = {"model": NAME, "prompt": "Hello", "max_tokens": 5, "temperature": 0}
            response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        served.update(compute=kwargs["compute"], threads=threads, scheduler=client.app.state.tierlm.scheduler)

    monkeypatch.setattr(tierlm.cli.serve, "load_model", recorded_load)
    monkeypatch.setattr(tierlm.server, "run_server", run_server)
    code = main(
        ["serve", "--model", str(tiny_dir), "--dtype", "float32", "--port", "0", "--batching", batching]
    )
    assert code == 0
    assert served["scheduler"].batching == batching
    compute = served["compute"]
    assert isinstance(compute, ComputeThread) and loads == [compute.ident]
    assert len(served["threads"]) >= 5 and set(served["threads"]) == {compute.ident}  # prefill + 4 steps
    assert compute.ident != threading.get_ident()


def test_a_compute_thread_runs_jobs_in_order_and_hands_back_errors():
    compute = ComputeThread(name="tierlm-test")
    order: list[int] = []
    futures = [compute.submit(order.append, i) for i in range(5)]
    assert [f.result(10) for f in futures] == [None] * 5 and order == list(range(5))
    with pytest.raises(ValueError, match="bad job"):
        compute.call(lambda: (_ for _ in ()).throw(ValueError("bad job")))
    assert compute.call(lambda: compute.call(threading.get_ident)) == compute.ident  # a job calling another
    assert compute.call(torch.get_num_threads) == torch.get_num_threads()


def test_releasing_a_threads_openmp_team_ends_the_teams_threads():
    """build_app(model) without a ComputeThread frees its caller's OpenMP team (the caller loaded the model;
    the worker's own thread decodes): the team's threads end, and a parallel op makes a new team."""
    import os
    import time

    from tierlm.server.compute import release_openmp_team

    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one torch thread: no OpenMP team")

    def tasks() -> set[int]:
        return {int(t) for t in os.listdir("/proc/self/task")}

    def parallel_op() -> None:
        torch.ones(1 << 24).add_(1)  # at::parallel_for over 16M elements: the calling thread's team runs it

    compute = ComputeThread(name="tierlm-test")
    compute.call(lambda: None)
    before = tasks()
    compute.call(parallel_op)
    team = tasks() - before
    assert len(team) == threads - 1, (team, threads)  # the calling thread is the team's first
    if not compute.call(release_openmp_team):
        pytest.skip("torch's OpenMP is not GNU OpenMP here")
    deadline = time.monotonic() + 10
    while team & tasks():
        assert time.monotonic() < deadline, "the team's threads did not end"
        time.sleep(0.01)
    compute.call(parallel_op)
    assert len(tasks() - before) == threads - 1  # a new team
