"""The continuous-batching worker: requests join the running batch at any decode step and leave it when done."""

from __future__ import annotations

from collections import Counter

from tierlm.generation.continuous import Sequence, SlotBatch, Update
from tierlm.server.batcher import SHUTDOWN_MESSAGE, Event, Job, Request, Scheduler, logger

# The continuous batch's counters /stats reports (SlotBatch.stats).
BATCH_STATS = (
    "joined_running_batch",
    "left_running_batch",
    "decode_steps",
    "prefill_chunks",
    "prefills_together",
)


class ContinuousScheduler(Scheduler):
    """A Scheduler whose worker keeps one batch of `max_batch_size` rows (padded to a power of two when the
    decode step compiles): a queued request takes free rows at once, its prefill runs in chunks between
    the decode steps of the rows already running, and each row leaves as soon as it finishes.

    When its compiled steps come from AOT packages (`Model.use_compiled_packages`), `start()` sizes the
    batch's cache for a request of `max_model_len` tokens (else of `default_max_tokens`) and loads (or
    builds) the packaged step of every row count before it returns, so the server reports healthy only once
    it can decode without compiling; only a longer request than that (no max_model_len) grows it later.
    """

    batching = "continuous"

    def __init__(
        self, model, *, default_max_tokens: int = 1024, prefill_together: bool = False, **kwargs
    ) -> None:
        super().__init__(model, **kwargs)
        self.prefill_together = prefill_together  # SlotBatch's: off, a request's tokens are its solo run's
        self._stats.update(dict.fromkeys(BATCH_STATS, 0))  # /stats has every key before the first request
        self.default_max_tokens = default_max_tokens
        self._batch: SlotBatch | None = None
        self._beams: list[Job] = []  # beam searches, each a generation of its own beside the batch

    def start(self) -> None:
        if self._working is None and not self._stopped and self._batch is None:
            try:
                self.compute.call(self.prepare, report=logger.info)
            except BaseException:
                self.compute.close()  # no worker will run: the thread (and its OpenMP team) ends
                raise
        super().start()

    def prepare(self, report=None) -> dict[int, str]:
        """Make the worker's batch now: with packaged steps, load (or build) them, one `report` line each
        (`start()` does this before the worker runs; `tierlm compile --serve` only this). Returns how each
        row count's compiled step came to be (empty when nothing compiles)."""
        self._batch = self._new_batch(report)
        return dict(self._batch.steps)

    def _work(self) -> None:
        batch, self._batch = self._batch or self._new_batch(), None  # a failed step's batch is not kept
        while batch.busy or self._beams or self._wait_for_pending():
            self._join(batch)
            for job in list(self._beams):  # one unit of each beam search per step of the batch
                if not self._advance(job):
                    self._beams.remove(job)
                    self._end(job)
            if not batch.busy:
                continue
            try:
                updates = batch.advance()
            except Exception as err:  # a failed step must not take the worker down
                self._fail(self._running, err)
                self._release(list(self._running))
                batch = self._new_batch()
                continue
            self._dispatch(updates)
            self._cancel_leavers(batch)
            self._record_stats(batch)

    def _new_batch(self, report=None) -> SlotBatch:
        config = self.base_config.replace(n=1, stop=())
        batch = SlotBatch(self.model, self.max_batch_size, config, self.prefill_together)
        if batch.packaged:  # its cache starts at the length its packages are for (loaded once, then reused)
            exact = self.max_model_len is not None  # the one length it ever needs: no bucket's spare slots
            needed = self.context if exact else min(self.default_max_tokens, self.context)
            if report is not None:
                sizes = ", ".join(str(1 << i) for i in range(batch.slots.bit_length()))
                report(f"compiled steps for continuous batches of {sizes} rows, cache for {needed} tokens:")
            batch.prepare(needed, report, exact)
            with self._cond:
                self._stats["compiled_steps"] = {str(k): v for k, v in sorted(batch.steps.items())}
        return batch

    def _join(self, batch: SlotBatch) -> None:
        """Move queued requests into free rows, oldest first, while their n choices fit."""
        with self._cond:
            self._fail_pending_past_deadline()
            while self._pending and (self._pending[0].config.num_beams > 1 or batch.fits(self._pending[0].n)):
                r = self._pending.pop(0)
                if r.config.num_beams > 1:
                    self._start_beams(r)
                    continue
                try:
                    batch.join(Sequence(r, r.prompt_ids, r.config, r.stops))
                except Exception as err:
                    self._fail([r], err)
                    continue
                self._running.append(r)
                self._stats["batches"] += 1 if not self._running[:-1] else 0
                busy = sum(row is not None for row in batch.rows)  # a finished choice's row is free again
                self._stats["max_batch_size_seen"] = max(self._stats["max_batch_size_seen"], busy)

    def _start_beams(self, r: Request) -> None:
        """A beam search runs beside the batch, eagerly, on a cache of its own (the batch's compiled steps
        are bound to the batch's cache and rows)."""
        r.config = r.config.replace(disable_compile=True)
        try:
            job = self._plan([r])
            job.own_cache = True
            job.gen = self.model.start(job.rows, job.config, own_cache=True)
        except Exception as err:
            self._fail([r], err)
            return
        self._running.append(r)
        self._beams.append(job)

    def _dispatch(self, updates: list[Update]) -> None:
        for u in updates:
            r: Request = u.key
            r.tokens += u.token is not None
            logprobs = (u.logprob,) if u.logprob is not None else ()
            if u.text or logprobs or u.prompt_logprobs:
                r.emit(
                    Event(
                        "delta",
                        u.text,
                        tokens=u.tokens,
                        index=r.index + u.choice,
                        logprobs=logprobs,
                        prompt_logprobs=u.prompt_logprobs,
                    )
                )
            if u.finished:
                self._record_finish(u.finish_reason, u.tokens)
                done = Event(
                    "done",
                    finish_reason=u.finish_reason,
                    stop_reason=u.stop_reason,
                    completion_tokens=u.tokens,
                    index=r.index + u.choice,
                )
                r.emit(done)
                if r.ended:
                    self._release([r])

    def _cancel_leavers(self, batch: SlotBatch) -> None:
        """Requests whose client left, or still running at the shutdown deadline, end at their next step."""
        late = self._past_deadline()
        for r in list(self._running):
            if r.cancelled or late:
                if late and not r.cancelled:
                    r.emit(Event("error", text=SHUTDOWN_MESSAGE))
                batch.cancel(r)

    def _record_stats(self, batch: SlotBatch) -> None:
        with self._cond:
            for key in BATCH_STATS:
                self._stats[key] = batch.stats[key]
            self._batch_sizes = Counter(batch.decoding_rows)  # how many rows each decode step ran
            if batch.steps:  # rows -> "loaded package <key> (...)", "built package ...", or JIT
                self._stats["compiled_steps"] = {str(k): v for k, v in sorted(batch.steps.items())}
