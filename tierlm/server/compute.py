"""`ComputeThread`: the one OS thread that runs all of a server's torch work.

torch's CPU ops run their parallel loops on an OpenMP team that belongs to the OS thread calling them.
Every thread that has run one keeps its team, and GNU OpenMP (torch's on Linux) throttles the spin-wait of
all its threads once they outnumber the cores: a team's threads then sleep between parallel loops and
are woken for the next, hundreds of times a token. A server that loaded its model on the main thread
and decoded on a worker thread held two teams and decoded at half speed: the default model (int4, one
row, 2 threads of a Zen 5) took 10.4-11.5 ms a step on the worker against 4.9-6.1 ms where the same
thread had loaded it (and main-thread steps slowed as much once the worker had run). So a server
loads its model, builds or loads its compiled steps and runs its scheduler's loop on one ComputeThread.
A server built for a model that the caller's thread loaded (`build_app(model)` without one) frees that
thread's team instead (`release_openmp_team`).
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: free the threads, keep nothing
_gomp: list = []  # torch's GNU OpenMP library once found (ctypes.CDLL), else empty


class ComputeThread:
    """A daemon thread that runs the callables given to it, one after another, in the order given.

    `call` waits for the result (an exception is raised in the caller; Ctrl-C interrupts the wait and,
    the thread being a daemon, does not wait for the work at exit); `submit` returns a Future.
    """

    def __init__(self, name: str = "tierlm-worker") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is self._thread:  # already on it (a job calling another)
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _run(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as err:  # the caller gets it; the thread takes the next job
                future.set_exception(err)
            else:
                future.set_result(result)


def release_openmp_team() -> bool:
    """Free the calling thread's OpenMP team, so that the process's torch work runs on another thread's team
    alone (a server whose model this thread loaded decodes on its worker). GNU OpenMP's
    `omp_pause_resource_all`, called in torch's own libgomp; the thread makes a new team if it runs a
    parallel torch op again. Returns whether it did: False where torch's OpenMP is not GNU's (macOS's
    libomp, a build without OpenMP), which does not throttle its threads this way."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def _libgomp():
    """torch's libgomp, as this process loaded it (/proc/self/maps), or None."""
    if not _gomp:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
        paths = sorted({line.split()[-1] for line in maps.splitlines() if "/libgomp" in line.split()[-1]})
        if len(paths) != 1:  # none loaded yet, or two copies: which one torch calls is unknown
            return None
        lib = ctypes.CDLL(paths[0])  # the loaded library itself: dlopen of its path returns its handle
        if not hasattr(lib, "omp_pause_resource_all"):  # before GCC 9
            return None
        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        _gomp.append(lib)
    return _gomp[0]
