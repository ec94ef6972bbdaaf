"""The worker thread: groups queued requests into batches and streams each row back to its asyncio queue."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierlm.compile import decide
from tierlm.errors import OptionError
from tierlm.generation.config import GenerationConfig
from tierlm.generation.run import static_cache_length
from tierlm.server.compute import ComputeThread
from tierlm.server.events import SHUTDOWN_MESSAGE, Event, QueueFull, Request, ShuttingDown

if TYPE_CHECKING:
    from tierlm.generation.run import Generation
    from tierlm.model import Model

logger = logging.getLogger("tierlm.server")

# Requests that arrive together should share a batch: wait until none came for QUIET_S, at most WINDOW_S.
BATCH_QUIET_S, BATCH_WINDOW_S = 0.003, 0.02
# Batches the worker runs in turns (each holds its own KV cache); Model keeps as many static caches.
MAX_RUNNING_BATCHES = 4


@dataclass(eq=False)
class Job:
    """A batch of requests and how it runs: rows (padding rows after the requests' own), its generation."""

    requests: list[Request]
    owners: list[tuple[Request, int] | None]  # per row: its request and choice (None: a padding row)
    rows: list[list[int]]
    limits: list[int] | None  # None: the config's max_new_tokens for every row (a beam search)
    stops: list[tuple[str, ...]] | None
    row_configs: list[GenerationConfig] | None
    config: GenerationConfig
    cache_shape: tuple[int, int] | None  # (rows, slots) of the static cache it takes; None if dynamic
    compiles: bool  # may run the compiled decode step, which only the model's own cache of a shape has
    own_cache: bool = False  # a cache of its own: another running batch holds the model's of this shape
    gen: Generation | None = None
    started: float = field(default_factory=time.perf_counter)


def served_context(model: Model, max_model_len: int | None) -> int:
    """The longest prompt + answer a server accepts: max_model_len (vLLM's), at most the model's context."""
    context = model.config.max_position_embeddings
    if max_model_len is None:
        return context
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
        raise OptionError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
    if max_model_len > context:
        raise OptionError(f"max_model_len {max_model_len} exceeds the model's context of {context}")
    return max_model_len


def served_cache_length(model: Model, max_model_len: int | None, default_max_tokens: int = 1024) -> int:
    """The static cache length a server's compiled steps are built for as it starts: its max_model_len
    (every batch then uses it), else a chat request's with the default max_tokens (others build when used)."""
    from tierlm.cache import bucket_length

    if max_model_len is not None:
        return max_model_len
    return bucket_length(default_max_tokens + 1, model.config.max_position_embeddings)


class Scheduler:
    """Owns the model on one worker thread; the asyncio side only submits and cancels requests.

    This one batches statically: requests queue while every running batch decodes, until one ends.
    Its worker's loop, and the torch work of its start-up, run on a ComputeThread of its own, which ends
    when it stops.
    """

    batching = "static"

    def __init__(
        self,
        model: Model,
        *,
        max_batch_size: int = 8,
        max_queue: int = 64,
        base_config: GenerationConfig | None = None,
        max_model_len: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise OptionError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_queue < 0:
            raise OptionError(f"max_queue must be >= 0, got {max_queue}")
        self.model = model
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.base_config = base_config or GenerationConfig()
        self.context = served_context(model, max_model_len)
        self.max_model_len = max_model_len
        self._cond = threading.Condition()
        self._pending: list[Request] = []
        self._running: list[Request] = []
        self._draining = False
        self._deadline: float | None = None  # after this, unfinished requests end with an error
        self._stopped = False
        self._blocked_by: Job | None = None  # the running batch whose static cache the queue's head waits for
        self._compute: ComputeThread | None = None
        self._working: Future | None = None  # the worker's loop, once started
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

    @property
    def compute(self) -> ComputeThread:
        """The thread the worker's loop (and its start-up's torch work) runs on, until `stop`."""
        if self._compute is None:
            self._compute = ComputeThread()
        return self._compute

    def start(self) -> None:
        if self._working is None and not self._stopped:
            self._working = self.compute.submit(self._work)
            self._working.add_done_callback(_report_crash)

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
                for choice in range(request.n):
                    request.emit(Event("done", finish_reason="cancelled", index=request.index + choice))

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
        if self._working is not None:
            wait_for([self._working], timeout)
        if self._compute is not None:  # the thread ends (with its OpenMP team) once its jobs are done
            self._compute.close()

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
                "batching": self.batching,
            }

    # --- worker thread ----------------------------------------------------------------------

    def _work(self) -> None:
        """Run batches in turns, one unit of work (a prefill chunk or a decode step) at a time.

        A batch started while another is still prefilling goes first, so a short prompt waits for one
        chunk of a long one, not for all of it. When every running batch decodes, new requests queue until
        they end (static batching).
        """
        running: list[Job] = []
        while running or self._wait_for_pending():
            if self._may_admit(running) and (job := self._admit(running)) is not None:
                running.insert(0, job)
            if running:
                job = running.pop(0)
                if self._advance(job):
                    running.append(job)
                else:
                    self._end(job)

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _wait_for_pending(self) -> bool:
        """Block until a request is queued; False once stopped. Requests past the shutdown deadline fail."""
        with self._cond:
            while True:
                self._fail_pending_past_deadline()
                if self._stopped:
                    return False
                if self._pending:
                    return True
                self._cond.wait(0.1 if self._deadline is not None else None)

    def _may_admit(self, running: list[Job]) -> bool:
        """Start a batch when idle, or beside running ones while one of them still prefills."""
        if not self._pending or self._blocked_by in running:
            return False
        if not running:
            return True
        return len(running) < MAX_RUNNING_BATCHES and any(not j.gen.prefilled for j in running)

    def _admit(self, running: list[Job]) -> Job | None:
        """Start a batch of queued requests, unless its static cache is the one a running batch holds."""
        self._gather_arrivals()
        with self._cond:
            self._fail_pending_past_deadline()
            if not self._pending:  # clients may have left meanwhile
                return None
            batch = self._take_batch()
            try:
                job = self._plan(batch)
            except Exception as err:
                self._fail(batch, err)
                return None
            # Model.static_cache hands out one cache per (batch, length): two batches alive together must
            # not share it, so a newcomer of a held shape gets a cache of its own, or waits if it compiles.
            holder = next((j for j in running if job.cache_shape and j.cache_shape == job.cache_shape), None)
            if holder is not None and job.compiles:  # compiled steps are bound to the model's cache
                self._pending[:0] = batch
                self._blocked_by = holder
                return None
            job.own_cache = holder is not None
            self._running.extend(batch)
            self._stats["padding_rows"] += sum(o is None for o in job.owners)
        self._record_batch(sum(o is not None for o in job.owners))
        try:
            job.gen = self.model.start(
                job.rows,
                job.config,
                row_max_new_tokens=job.limits,
                row_stops=job.stops,
                own_cache=job.own_cache,
                row_configs=job.row_configs,
            )
        except Exception as err:
            self._fail(batch, err)
            self._release(batch)
            return None
        return job

    def _plan(self, batch: list[Request]) -> Job:
        """The rows, limits and config of a batch, and the static cache shape it will take."""
        if batch[0].config.num_beams > 1:
            return self._plan_beams(batch[0])
        config = self.base_config.replace(max_new_tokens=max(r.max_tokens for r in batch), stop=(), n=1)
        owners = [(r, c) for r in batch for c in range(r.n)]
        rows = [r.prompt_ids for r, _ in owners]
        limits = [r.max_tokens for r, _ in owners]
        stops = [r.stops for r, _ in owners]
        row_configs = [r.choice_config(c) for r, c in owners]
        compiles = self._compiles(config)  # e.g. an offloaded model never compiles, so never pads
        if compiles:
            # A compiled step is built per batch size: round up to a power of two (1, 2, 4, 8, ...) with
            # one-token copies of the first prompt, so at most log2(max batch) + 1 shapes ever compile.
            extra = (1 << (len(rows) - 1).bit_length()) - len(rows)
            rows, limits, stops = rows + [rows[0]] * extra, limits + [1] * extra, stops + [()] * extra
            row_configs += [config.replace(do_sample=False, logprobs=None, prompt_logprobs=None)] * extra
        config = self._sized(config, compiles)
        length = static_cache_length(config, self.model.config, max(len(r) for r in rows))
        shape = (len(rows), length) if length is not None else None
        padded = owners + [None] * (len(rows) - len(owners))
        return Job(batch, padded, rows, limits, stops, row_configs, config, shape, compiles)

    def _plan_beams(self, r: Request) -> Job:
        """A beam search's job: one prompt, its beams the rows (never padded), its n best the choices."""
        compiles = self._compiles(r.config)
        config = self._sized(r.config, compiles)
        length = static_cache_length(config, self.model.config, len(r.prompt_ids))
        shape = (config.num_beams, length) if length is not None else None
        owners = [(r, c) for c in range(r.n)]
        return Job([r], owners, [r.prompt_ids], None, None, None, config, shape, compiles)

    def _compiles(self, config: GenerationConfig) -> bool:
        """The one decision (decide()) for a batch of `config`."""
        model = self.model
        uncompilable = model.uncompilable_reasons()
        cache = config.cache_implementation
        return decide(
            model.device_map, cache, config, uncompilable=uncompilable, device=str(model.device)
        ).compile

    def _sized(self, config: GenerationConfig, compiles: bool) -> GenerationConfig:
        """A compiled batch's cache has the one length built at start (max_model_len), where there is one."""
        if compiles and self.max_model_len is not None and config.cache_implementation != "dynamic":
            return config.replace(max_cache_len=self.max_model_len)
        return config

    def _advance(self, job: Job) -> bool:
        """One unit of the job's work, its deltas sent to the clients; False once the job is over."""
        try:
            updates = job.gen.advance()
        except Exception as err:  # a failed batch must not take the worker down
            self._fail(job.requests, err)
            return False
        if updates is None:
            return False
        for row, delta, finished, reason in updates:
            if job.owners[row] is None:  # a padding row
                continue
            r, choice = job.owners[row]
            r.tokens += 1
            if (r.cancelled or self._past_deadline()) and not finished:
                job.gen.cancel(row)
                if not r.cancelled:
                    r.emit(Event("error", text=SHUTDOWN_MESSAGE))
            emitted = len(job.gen.state.tokens[row])
            logprobs = tuple(job.gen.state.logprobs[row][-1:]) if r.config.logprobs is not None else ()
            first = emitted == 1 or job.gen.search is not None  # a beam's one update is its first
            prompt_lp = job.gen.prompt_logprobs[row] if job.gen.prompt_logprobs and first else None
            if delta or logprobs or prompt_lp:
                r.emit(
                    Event(
                        "delta",
                        delta,
                        tokens=emitted,
                        index=r.index + choice,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_lp,
                    )
                )
            if finished:
                self._record_finish(reason, emitted)
                why = job.gen.stop_reason(row) if reason == "stop" else None
                index = r.index + choice
                r.emit(
                    Event(
                        "done", finish_reason=reason, stop_reason=why, completion_tokens=emitted, index=index
                    )
                )
        beams = job.gen.search is not None  # its choices come at its end: nothing to end one by one
        if (beams or not job.gen.prefilled) and (
            self._past_deadline() or all(r.cancelled for r in job.requests)
        ):
            self._abandon(job)  # nobody waits for the rest of this prompt (or of this search)
            return False
        return True

    def _abandon(self, job: Job) -> None:
        for r in job.requests:
            if not r.cancelled:
                r.emit(Event("error", text=SHUTDOWN_MESSAGE))
            self._record_finish("cancelled", r.tokens)
            for choice in range(r.n):
                r.emit(Event("done", finish_reason="cancelled", index=r.index + choice))

    def _fail(self, batch: list[Request], err: Exception) -> None:
        logger.error("batch of %d rows failed", len(batch), exc_info=err)
        for r in batch:
            r.emit(Event("error", text=f"generation failed: {type(err).__name__}: {err}"))

    def _end(self, job: Job) -> None:
        tokens = sum(r.tokens for r in job.requests)
        elapsed = time.perf_counter() - job.started
        logger.info("batch of %d rows: %d tokens in %.2f s", len(job.requests), tokens, elapsed)
        self._release(job.requests)

    def _release(self, batch: list[Request]) -> None:
        with self._cond:
            self._running = [r for r in self._running if r not in batch]

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
        batch, rows = [head], head.n  # each row its own sampling settings: any requests may share a batch
        width, longest = len(head.prompt_ids), head.max_tokens
        for r in self._pending[1:] if head.config.num_beams == 1 else ():  # a beam search runs alone
            if r.config.num_beams > 1:
                continue
            if rows + r.n > self.max_batch_size:
                break
            w, n = max(width, len(r.prompt_ids)), max(longest, r.max_tokens)
            if w + n <= self.context:
                batch.append(r)
                width, longest, rows = w, n, rows + r.n
        for r in batch:
            self._pending.remove(r)
        return batch

    def _record_batch(self, size: int) -> None:
        with self._cond:
            self._stats["batches"] += 1
            self._stats["max_batch_size_seen"] = max(self._stats["max_batch_size_seen"], size)
            self._batch_sizes[size] += 1

    def _record_finish(self, reason: str, tokens: int) -> None:
        with self._cond:
            self._finish_reasons[reason] += 1
            self._stats["generated_tokens"] += tokens


def _report_crash(working: Future) -> None:
    """The worker's loop ended by an exception it did not handle (a bug): say so, as a thread's crash would."""
    err = working.exception()
    if err is not None:
        logger.error("the worker stopped: %s", err, exc_info=err)
