"""The threads of a server's torch work: `ComputeThread` runs its worker, `release_openmp_team` frees the
OpenMP team of the thread that loaded the model.

torch's CPU ops run their parallel loops on an OpenMP team that belongs to the OS thread calling them.
Every thread that has run one keeps its team, and GNU OpenMP (torch's on Linux) throttles the spin-wait of
all its threads once they outnumber the cores: a team's threads then sleep between parallel loops and
are woken for the next, hundreds of times a token. A server that loaded its model on the main thread
and decoded on a worker thread held two teams and decoded at half speed: the default model (int4, one
row, 2 threads of a Zen 5) took 10.4-11.5 ms a step on the worker against 4.9-6.1 ms where the same
thread had loaded it (and main-thread steps slowed as much once the worker had run). So `build_app`
frees its caller's team once the model is loaded and its compiled steps are prepared there, and the
worker's team is the process's only one while it serves.
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: free the threads, keep nothing
_CLOSE = object()  # the job that ends a ComputeThread
_pause: list = []  # torch's omp_pause_resource_all once found, else empty


class ComputeThread:
    """A daemon thread that runs the callables given to it, one after another, in the order given, until
    `close`. `call` waits for the result (an exception is raised in the caller); `submit` returns a Future.
    """

    def __init__(self, name: str = "tierlm-worker") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        if self._closed:  # its thread ends after the jobs before close(): this one would never run
            raise RuntimeError("this ComputeThread is closed")
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is self._thread:  # already on it (a job calling another)
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """End the thread once the jobs given before are done (its OpenMP team ends with it)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(_CLOSE)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _run(self) -> None:
        while (job := self._jobs.get()) is not _CLOSE:
            future, fn, args, kwargs = job
            del job  # nothing of a finished job (a scheduler, its model) stays referenced while idle
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as err:  # the caller gets it; the thread takes the next job
                    future.set_exception(err)
            del future, fn, args, kwargs


def release_openmp_team() -> bool:
    """Free the calling thread's OpenMP team, so that the process's torch work runs on another thread's team
    alone (a server whose model this thread loaded decodes on its worker). GNU OpenMP's
    `omp_pause_resource_all`, which frees only the calling thread's team (and refuses inside a parallel
    region); the thread makes a new team if it runs a parallel torch op again. Returns whether it did:
    False where torch's OpenMP is not GNU's (LLVM's and Intel's pause the whole runtime; they are left
    alone) or is not found."""
    pause = _omp_pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


def _omp_pause():
    """omp_pause_resource_all as torch's CPU library resolves it, where that is GNU OpenMP's, else None."""
    if not _pause and sys.platform == "linux":
        import torch

        lib_dir = Path(torch.__file__).parent / "lib"
        try:
            maps = Path("/proc/self/maps").read_text()
            torch_cpu = ctypes.CDLL(str(lib_dir / "libtorch_cpu.so"))  # the loaded library's own handle
            pause = torch_cpu.omp_pause_resource_all  # found in its dependencies: the OpenMP it calls
        except (OSError, AttributeError):
            return None
        if "/libgomp" not in maps or "libiomp" in maps or "/libomp" in maps:
            return None
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        _pause.append(pause)
    return _pause[0] if _pause else None
