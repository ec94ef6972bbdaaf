"""The worker thread: groups queued requests into batches and streams each row back to its asyncio queue."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierlm.generation.config import GenerationConfig

if TYPE_CHECKING:
    from tierlm.model import Model

logger = logging.getLogger("tierlm.server")

SHUTDOWN_MESSAGE = "the server is shutting down; the request was not completed"
# Requests that arrive together should share a batch: wait until none came for QUIET_S, at most WINDOW_S.
BATCH_QUIET_S, BATCH_WINDOW_S = 0.003, 0.02


class QueueFull(Exception):
    """More requests are waiting than the server queues."""


class ShuttingDown(Exception):
    """The server no longer accepts requests."""


@dataclass(frozen=True)
class Sampling:
    """The settings rows of one batch must share: greedy rows always batch together."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def key(self) -> tuple | None:
        """Batching key; None when the request must run alone (a seeded sample is reproducible only solo)."""
        if self.greedy:
            return ("greedy",)
        if self.seed is not None:
            return None
        return ("sample", self.temperature, self.top_p)

    def config(self, base: GenerationConfig, max_new_tokens: int) -> GenerationConfig:
        if self.greedy:
            return base.replace(max_new_tokens=max_new_tokens, do_sample=False, stop=(), seed=None)
        return base.replace(
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=(),
        )


@dataclass(frozen=True)
class Event:
    """What the worker tells a request: a text delta, its end ("done"), or a failure ("error")."""

    kind: str
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One queued generation; `queue` lives on the asyncio side and receives Events."""

    prompt_ids: list[int]
    max_tokens: int
    stops: tuple[str, ...]
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False  # set by the asyncio side when the client goes away
    ended: bool = False  # a "done" or "error" event was sent
    tokens: int = 0

    def emit(self, event: Event) -> None:
        """Hand an event to the request's event loop; never blocks the worker."""
        if self.ended:
            return
        self.ended = event.kind != "delta"
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Scheduler:
    """Owns the model on one worker thread; the asyncio side only submits and cancels requests."""

    def __init__(
        self,
        model: Model,
        *,
        max_batch_size: int = 8,
        max_queue: int = 64,
        base_config: GenerationConfig | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model = model
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.base_config = base_config or GenerationConfig()
        self.context = model.config.max_position_embeddings
        self._cond = threading.Condition()
        self._pending: list[Request] = []
        self._running: list[Request] = []
        self._draining = False
        self._deadline: float | None = None  # after this, unfinished requests end with an error
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._stats = {
            "batches": 0,
            "max_batch_size_seen": 0,
            "generated_tokens": 0,
            "requests": 0,
            "padding_rows": 0,  # rows added to round compiled batches up to a power of two
        }
        self._batch_sizes: Counter[int] = Counter()
        self._finish_reasons: Counter[str] = Counter()

    # --- asyncio side -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._work, name="tierlm-worker", daemon=True)
            self._thread.start()

    def submit(self, request: Request) -> None:
        self.start()  # normally started by the app's lifespan; this covers servers that skip it
        with self._cond:
            if self._draining or self._stopped:
                raise ShuttingDown(SHUTDOWN_MESSAGE)
            if len(self._pending) >= self.max_queue:
                raise QueueFull(
                    f"the server is busy: {len(self._pending)} requests are already queued "
                    f"(max_queue={self.max_queue}); retry later"
                )
            self._pending.append(request)
            self._stats["requests"] += 1
            self._cond.notify()

    def cancel(self, request: Request) -> None:
        """The client went away: drop the request if queued, else end its row at the next step."""
        with self._cond:
            request.cancelled = True
            if request in self._pending:
                self._pending.remove(request)
                self._finish_reasons["cancelled"] += 1
                request.emit(Event("done", finish_reason="cancelled"))

    def begin_drain(self, grace_s: float) -> None:
        """Refuse new requests; let the ones in flight run for `grace_s` more seconds, then end them."""
        with self._cond:
            self._draining = True
            deadline = time.monotonic() + grace_s
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """End everything still in flight with an error and join the worker."""
        self.begin_drain(0.0)
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def draining(self) -> bool:
        return self._draining

    def stats(self) -> dict:
        with self._cond:
            return {
                **self._stats,
                "batch_sizes": {str(k): v for k, v in sorted(self._batch_sizes.items())},
                "finish_reasons": dict(self._finish_reasons),
                "queued": len(self._pending),
                "running": len(self._running),
                "max_batch_size": self.max_batch_size,
                "max_queue": self.max_queue,
            }

    # --- worker thread ----------------------------------------------------------------------

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._run(batch)
            except Exception as err:  # a failed batch must not take the worker down
                logger.exception("batch of %d rows failed", len(batch))
                for r in batch:
                    r.emit(Event("error", text=f"generation failed: {type(err).__name__}: {err}"))
            finally:
                with self._cond:
                    self._running = []

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _next_batch(self) -> list[Request] | None:
        """Block until a batch is ready; None once stopped. Requests past the shutdown deadline fail."""
        while True:
            with self._cond:
                while True:
                    self._fail_pending_past_deadline()
                    if self._stopped:
                        return None
                    if self._pending:
                        break
                    self._cond.wait(0.1 if self._deadline is not None else None)
            self._gather_arrivals()
            with self._cond:
                self._fail_pending_past_deadline()
                if self._pending:  # clients may have left meanwhile
                    self._running = self._take_batch()
                    return self._running

    def _fail_pending_past_deadline(self) -> None:
        if self._past_deadline():
            for r in self._pending:
                r.emit(Event("error", text=SHUTDOWN_MESSAGE))
            self._pending.clear()

    def _gather_arrivals(self) -> None:
        """Wait while requests keep arriving (a burst of clients), up to BATCH_WINDOW_S or a full batch."""
        end, seen = time.monotonic() + BATCH_WINDOW_S, -1
        while time.monotonic() < end:
            with self._cond:
                if len(self._pending) in (seen, 0) or len(self._pending) >= self.max_batch_size:
                    return
                seen = len(self._pending)
            time.sleep(BATCH_QUIET_S)

    def _take_batch(self) -> list[Request]:
        """The oldest request and the queued ones that can share its batch (settings and cache length)."""
        head = self._pending[0]
        batch, key = [head], head.sampling.key()
        width, longest = len(head.prompt_ids), head.max_tokens
        for r in self._pending[1:]:
            if key is None or len(batch) == self.max_batch_size:
                break
            w, n = max(width, len(r.prompt_ids)), max(longest, r.max_tokens)
            if r.sampling.key() == key and w + n <= self.context:
                batch.append(r)
                width, longest = w, n
        for r in batch:
            self._pending.remove(r)
        return batch

    def _run(self, batch: list[Request]) -> None:
        size = len(batch)
        self._record_batch(size)
        start = time.perf_counter()
        config = batch[0].sampling.config(self.base_config, max(r.max_tokens for r in batch))
        rows = [r.prompt_ids for r in batch]
        limits = [r.max_tokens for r in batch]
        stops = [r.stops for r in batch]
        if config.compile_config is not None and not config.disable_compile:
            # A compiled step is built per batch size: round up to a power of two (1, 2, 4, 8, ...) with
            # one-token copies of the first prompt, so at most log2(max batch) + 1 shapes ever compile.
            extra = (1 << (size - 1).bit_length()) - size
            rows, limits, stops = rows + [rows[0]] * extra, limits + [1] * extra, stops + [()] * extra
            with self._cond:
                self._stats["padding_rows"] += extra
        gen = self.model.start(rows, config, row_max_new_tokens=limits, row_stops=stops)
        for row, delta, finished, reason in gen.stream():
            if row >= size:  # a padding row
                continue
            r = batch[row]
            r.tokens += 1
            if (r.cancelled or self._past_deadline()) and not finished:
                gen.cancel(row)
                if not r.cancelled:
                    r.emit(Event("error", text=SHUTDOWN_MESSAGE))
            if delta:
                r.emit(Event("delta", text=delta))
            if finished:
                self._record_finish(reason, r.tokens)
                r.emit(Event("done", finish_reason=reason, completion_tokens=r.tokens))
        tokens = sum(r.tokens for r in batch)
        logger.info("batch of %d rows: %d tokens in %.2f s", size, tokens, time.perf_counter() - start)

    def _record_batch(self, size: int) -> None:
        with self._cond:
            self._stats["batches"] += 1
            self._stats["max_batch_size_seen"] = max(self._stats["max_batch_size_seen"], size)
            self._batch_sizes[size] += 1

    def _record_finish(self, reason: str, tokens: int) -> None:
        with self._cond:
            self._finish_reasons[reason] += 1
            self._stats["generated_tokens"] += tokens
