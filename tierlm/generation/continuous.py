"""Continuous batching: sequences join and leave the rows of one static cache at every decode step.

Each row keeps its own positions (its slots are its rotary positions, whoever else is in the batch) and
its own sampling settings and RNG (`Sampler`), so a sequence's tokens do not depend on its neighbours:
its prefill is the same computation as a solo run's, and its decode steps differ only in which masked
slots the attention reads. Work comes in units, as `Generation.advance()`: a prefill chunk of a joining
sequence (the joining sequences take turns, chunk by chunk), or one decode step of every decoding row;
the two alternate while both are due.

A compiled batch decodes at power-of-two row counts (1, 2, 4, ... up to its slots). When the model's
whole steps come from packages (`Model.use_compiled_packages`, tierlm.aot), `prepare()` sizes the cache
once for the longest request it expects and loads (or builds) the packaged step of each row count, so a
server does its compiling, if any, before it answers. A request longer than that cache grows it, and the
packaged steps of the new length are then loaded or built when first used, on the worker (every running row
waits for a cold build, which is logged: a server's max_model_len sizes the cache for every request it
accepts). Without packages, compiled steps are compiled by torch.compile when first used.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierlm.cache import StaticCache, bucket_length
from tierlm.compile import CompileConfig, CompileDecision, decide, warn_if_skipped
from tierlm.generation.bad_words import BadWords
from tierlm.generation.config import GenerationConfig
from tierlm.generation.grammar import GrammarMask
from tierlm.generation.loop import Sampler, TokenLogprob, left_pad
from tierlm.generation.prompts import PromptLogprobs
from tierlm.generation.run import eos_token_ids
from tierlm.generation.slots import RowsView, SlotCache, copy_rows
from tierlm.generation.text import TextTracker, stop_reason, text_tracker

log = logging.getLogger(__name__)
GROWS = "a %d-token request grows the cache to %d slots: steps load or build now, running rows wait (--max-model-len)"


@dataclass(eq=False)
class Sequence:
    """One request as the batch sees it: a prompt, its settings (n rows sample it), its stop strings."""

    key: object
    prompt: list[int]
    config: GenerationConfig  # sampling, logprobs, prompt_logprobs, n; max_new_tokens is its limit
    stops: tuple[str, ...] = ()
    rows: list[int] = field(default_factory=list)
    prefilled: int = 0
    prompt_lp: PromptLogprobs | None = None
    cancelled: bool = False


@dataclass(eq=False)
class Row:
    seq: Sequence
    choice: int
    tracker: TextTracker
    position: int = 0  # the slot, and rotary position, of the token the row feeds next
    tokens: int = 0
    decoding: bool = False


@dataclass
class Update:
    """What one unit of work produced for one sample of a sequence."""

    key: object
    choice: int
    text: str
    token: int | None
    finished: bool
    finish_reason: str | None
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, when asked
    tokens: int = 0  # the sample's tokens so far
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string a "stop" finish ended on


def compiles(model, config: GenerationConfig) -> bool:
    """Whether a SlotBatch of `model` with `config` decodes through compiled steps (decide()'s answer for the
    static cache it builds, which it gives the SlotCache later too)."""
    uncompilable = model.uncompilable_reasons()
    return decide(
        model.device_map, "static", config, uncompilable=uncompilable, device=str(model.device)
    ).compile


class SlotBatch:
    """`slots` rows of a static cache that grows (by powers of two) to fit the longest sequence."""

    def __init__(self, model, slots: int, config: GenerationConfig, prefill_together: bool = False) -> None:
        """`prefill_together`: sequences that join together prefill in one padded forward (one pass over the
        weights for all of them), whose products then sum over other row counts than a solo prefill's, so a
        row's tokens may differ from its solo run's in low-precision weights; off, each prefills alone and a
        request's tokens are its solo run's whatever else the batch holds (batch invariance)."""
        self.model, self.config, self.capacity = model, config, slots
        self.prefill_together = prefill_together
        if self._compiles():  # compiled steps run at power-of-two row counts: rows past capacity pad them
            slots = 1 << (slots - 1).bit_length()
        self.slots = slots
        tok, cfg = model.tokenizer, model.config
        self.eos_ids = eos_token_ids(model, config)
        self.device = model.device
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)  # may be empty: no EOS
        self.sampler = Sampler(slots, cfg.vocab_size, eos, self.device)
        self.sampler.grammar = GrammarMask(tok, slots, cfg.vocab_size, self.eos_ids)  # built on first use
        self.sampler.bad_words = BadWords(tok, slots)
        self.rows: list[Row | None] = [None] * slots
        self.tokens = torch.zeros(slots, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(slots, 1, dtype=torch.long, device=self.device)
        self.waiting: list[Sequence] = []  # joined, prefill not done yet (oldest first)
        self.cache, self.length = None, 0
        self.decision: CompileDecision | None = None
        self._views: dict[int, tuple[SlotCache, object]] = {}
        self.steps: dict[int, str] = {}  # rows -> how its compiled step came to be (a package, or JIT)
        self._decode_next = False
        self.stats: Counter[str] = Counter()
        self.decoding_rows: Counter[int] = Counter()  # rows decoding -> decode steps (/stats' batch_sizes)

    # --- membership ------------------------------------------------------------------------------

    def _compiles(self) -> bool:
        return compiles(self.model, self.config)

    @property
    def packaged(self) -> bool:
        """Whether the compiled steps come from AOT packages (tierlm.aot), not from torch.compile."""
        packages = getattr(self.model, "packages", None)
        cc = self.config.compile_config or CompileConfig()
        return self._compiles() and packages is not None and packages.applies(cc, SlotCache)

    def prepare(self, needed: int, report: Callable[[str], None] | None = None, exact: bool = False) -> None:
        """Before any request (a server's start-up): size the cache for `needed` slots (exactly, else rounded
        up to a bucket) and, when the steps come from packages, load (or build) the step of every row count
        the batch decodes at, 1, 2, 4, ... up to its slots, with one `report` line each."""
        self._ensure_length(needed, exact)
        if not (self.decision.compile and self.packaged):
            return
        sizes = [1 << i for i in range(self.slots.bit_length())]
        for i, size in enumerate(sizes):
            start = time.perf_counter()
            _cache, step = self._view(size)
            if report is not None:
                report(step.progress(i, len(sizes), time.perf_counter() - start))

    def free_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.rows[: self.capacity]) if r is None]

    @property
    def busy(self) -> bool:
        return any(r is not None for r in self.rows)

    def fits(self, n: int) -> bool:
        return len(self.free_rows()) >= n

    def join(self, seq: Sequence) -> None:
        """Give `seq` n free rows; its prefill runs in the next units of work."""
        rows = self.free_rows()[: seq.config.n]
        if len(rows) < seq.config.n:
            raise ValueError(f"{seq.config.n} rows wanted, {len(rows)} free")
        self._ensure_length(len(seq.prompt) + seq.config.max_new_tokens)
        if self._decoding_rows():
            self.stats["joined_running_batch"] += 1  # membership changed mid-run
        tok = self.model.tokenizer
        for choice, row in enumerate(rows):
            self.rows[row] = Row(seq, choice, text_tracker(tok, seq.stops, seq.config))
            self.sampler.set_row(row, seq.config, seq.prompt, choice)
            with torch.inference_mode(self.cache.valid.is_inference()):  # a cache a generate() run made
                self.cache.valid[row] = False
        seq.rows = rows
        if seq.config.prompt_logprobs is not None:
            ids = torch.tensor([seq.prompt], device=self.device)
            seq.prompt_lp = PromptLogprobs(
                ids, torch.ones_like(ids, dtype=torch.bool), seq.config.prompt_logprobs
            )
        self.waiting.append(seq)
        self.stats["rows_max"] = max(self.stats["rows_max"], self.capacity - len(self.free_rows()))

    def cancel(self, key: object) -> None:
        """End the sequence `key` at its next unit of work."""
        for r in self.rows:
            if r is not None and r.seq.key == key:
                r.seq.cancelled = True

    def _leave(self, row: int) -> None:
        self.rows[row] = None
        if self._decoding_rows():
            self.stats["left_running_batch"] += 1

    def _decoding_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is not None and r.decoding]

    def _ensure_length(self, needed: int, exact: bool = False) -> None:
        """A cache of at least needed + 1 slots (the last is the decode steps' scratch column)."""
        if needed + 1 <= self.length:
            return
        limit = self.model.config.max_position_embeddings + 1
        length = needed + 1 if exact else bucket_length(needed + 1, limit)
        if self.cache is not None and self.decision.compile and self.packaged:
            log.info(GROWS, needed, length)
        cache = self.model.static_cache(self.slots, length, rings=False)  # each row at its own position
        self.model.decoder.ensure_rope(length, self.device)
        if self.cache is not None:  # rows in flight keep what they wrote
            old = self.cache
            with torch.inference_mode(cache.valid.is_inference()):  # a cache a generate() run made
                for new, kept in zip((*cache.keys, *cache.values), (*old.keys, *old.values)):
                    new[:, :, : self.length] = kept
                cache.valid[:, : self.length] = old.valid
        self.cache, self.length = cache, length
        self._views.clear()
        self.steps.clear()
        self.decision = decide(
            self.model.device_map,
            SlotCache(cache, self.slots),
            self.config,
            uncompilable=self.model.uncompilable_reasons(),
            device=str(self.device),
        )
        warn_if_skipped(self.decision, self.config)

    # --- work --------------------------------------------------------------------------------------

    def advance(self) -> list[Update]:
        """One unit of work: a prefill chunk or a decode step, alternating while both are due."""
        with torch.inference_mode():
            decoding = bool(self._decoding_rows())
            if self.waiting and not (decoding and self._decode_next):
                self._decode_next = True
                together = self._whole_prompts() if self.prefill_together else []
                return self._prefill_together(together) if len(together) > 1 else self._prefill_chunk()
            self._decode_next = False
            return self._decode() if decoding else []

    def _prefill_chunk(self) -> list[Update]:
        seq = self.waiting[0]
        if seq.cancelled:
            self.waiting.pop(0)
            return [self._finish(row, "cancelled") for row in seq.rows]
        row, width = seq.rows[0], len(seq.prompt)
        chunk = seq.config.prefill_chunk or width
        start, end = seq.prefilled, min(seq.prefilled + chunk, width)
        view = RowsView(self.cache, slice(row, row + 1))
        ids = torch.tensor([seq.prompt[start:end]], device=self.device)
        slots = torch.arange(start, end, device=self.device)
        logits = self.model.decoder(
            ids,
            attention_mask=torch.ones_like(ids, dtype=torch.bool),
            positions=slots[None],
            cache=view,
            slots=slots,
            last_only=seq.prompt_lp is None,
            length=end,  # read only the slots written so far, as a solo prefill does
        )
        if seq.prompt_lp is not None:
            seq.prompt_lp.add(logits, start)
        seq.prefilled = end
        self.stats["prefill_chunks"] += 1
        if end < width:  # round robin: a short prompt that joined behind a long one waits one chunk, not all
            self.waiting.append(self.waiting.pop(0))
            return []
        self.waiting.pop(0)
        return self._started(seq, logits[:, -1])

    def _whole_prompts(self) -> list[Sequence]:
        """The waiting sequences whose prefill can run together as one batch: not started, one chunk
        long, no prompt log probabilities (which need every position's logits)."""
        return [
            s
            for s in self.waiting
            if s.prefilled == 0
            and not s.cancelled
            and s.prompt_lp is None
            and len(s.prompt) <= (s.config.prefill_chunk or len(s.prompt))
        ]

    def _prefill_together(self, seqs: list[Sequence]) -> list[Update]:
        """Prefill several joining sequences in one forward: left-padded into a scratch cache (each row at
        its own rotary positions 0..n-1, padding masked), then each row's K/V moved to its own row's slots
        0..n-1, where a solo prefill would have written them. One pass over the weights for all of them,
        where one prefill each would read every weight once per sequence (and, widened, convert it)."""
        batch = left_pad([s.prompt for s in seqs], 0, self.device)
        width = batch.ids.shape[1]
        cfg, dtype = self.model.config, self.cache.keys[0].dtype
        scratch = StaticCache(
            cfg, len(seqs), width, dtype, self.device, rings=False
        )  # moved column by column
        positions = (batch.mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = self.model.decoder(
            batch.ids,
            attention_mask=batch.mask,
            positions=positions,
            cache=scratch,
            slots=torch.arange(width, device=self.device),
            last_only=True,
        )
        updates = []
        for i, seq in enumerate(seqs):
            n, row = len(seq.prompt), seq.rows[0]
            for dst, src in zip((*self.cache.keys, *self.cache.values), (*scratch.keys, *scratch.values)):
                dst[row, :, :n] = src[i, :, width - n :]
            self.cache.valid[row, :n] = True
            seq.prefilled = n
            self.waiting.remove(seq)
            updates += self._started(seq, logits[i : i + 1, -1])
        self.stats["prefill_chunks"] += 1
        self.stats["prefills_together"] += len(seqs)
        return updates

    def _started(self, seq: Sequence, last: torch.Tensor) -> list[Update]:
        """A sequence whose prefill is done: its n rows get the prompt's K/V and their first tokens from
        `last`, the logits [1, vocab] after its prompt."""
        width = len(seq.prompt)
        row = seq.rows[0]
        copy_rows(self.cache, row, seq.rows[1:], width)  # n samples share one prefill
        last = last.float().expand(len(seq.rows), -1)
        tokens = self.sampler(last, seq.rows)
        logprobs = self.sampler.logprobs(last, tokens, seq.rows)
        prompt_lp = seq.prompt_lp.rows([seq.config.prompt_logprobs])[0] if seq.prompt_lp else None
        index = torch.tensor(seq.rows, device=self.device)
        self.tokens[index, 0] = tokens
        self.positions[index, 0] = width
        updates = []
        for i, (r, token) in enumerate(zip(seq.rows, tokens.tolist())):
            self.rows[r].position, self.rows[r].decoding = width, True
            updates.append(self._emit(r, token, logprobs[i], prompt_lp))
        return updates

    def _decode(self) -> list[Update]:
        high = max(i for i, r in enumerate(self.rows) if r is not None) + 1
        size = (1 << (high - 1).bit_length()) if self.decision.compile else high  # compiled: fixed shapes
        size = min(size, self.slots)
        cache, step = self._view(size)
        rows = self.rows[:size]
        decoding = [i for i, r in enumerate(rows) if r is not None and r.decoding]
        active = torch.zeros(size, dtype=torch.bool)
        active[decoding] = True
        active = active.to(self.device)
        cache.row_slots.copy_(torch.where(active[:, None], self.positions[:size], self.length - 1))
        if self.decision.compile:
            scratch = self.length - 1
        else:  # past every slot written: decoding rows' positions and prefilling rows' prompt so far
            scratch = max(r.position if r.decoding else r.seq.prefilled for r in rows if r is not None)
        slots = torch.tensor([scratch], device=self.device)
        logits = step(self.tokens[:size], self.positions[:size], slots, scratch + 1)
        cache.commit(active, scratch)
        index = torch.tensor(decoding, device=self.device)
        logits = logits[index]
        tokens = self.sampler(logits, decoding)
        logprobs = self.sampler.logprobs(logits, tokens, decoding)
        self.tokens[index, 0] = tokens
        self.positions[index] += 1
        self.stats["decode_steps"] += 1
        self.decoding_rows[len(decoding)] += 1
        updates = []
        for i, (r, token) in enumerate(zip(decoding, tokens.tolist())):
            self.rows[r].position += 1
            updates.append(self._emit(r, token, logprobs[i]))
        return updates

    def _view(self, size: int):
        """The SlotCache over the first `size` rows and its decode step (compiled if decide() said so)."""
        if size not in self._views:
            cache = SlotCache(self.cache, size, eager=not self.decision.compile)
            if self.decision.compile and self.packaged:  # its inputs are this SlotCache's own tensors
                step = self.model.packages.step(cache, self.config.compile_config or CompileConfig())
                self.steps[size] = step.how
            elif self.decision.compile:
                cache, step = self._jit_step(cache, size)
            else:
                step = self.model.eager_step(cache)
            self._views[size] = (cache, step)
        return self._views[size]

    def _jit_step(self, cache: SlotCache, size: int):
        """(view, step) of the model's torch.compile'd step for `size` rows. The model keeps one such step
        per shape, bound to the cache it was first built for: an earlier batch's SlotCache over this same
        big cache is adopted as this batch's view (its row slots are the ones the step reads); a step bound
        to any other cache would decode someone else's rows, so this batch decodes eagerly instead."""
        step = self.model.compiled_step(cache, self.config.compile_config)
        bound = getattr(step, "cache", cache)
        if bound is cache or (isinstance(bound, SlotCache) and bound.cache is self.cache):
            self.steps[size] = "torch.compile (JIT), compiled on first use"
            return bound, step
        self.steps[size] = "eager: the model's compiled step for this shape is bound to another cache"
        cache = SlotCache(self.cache, size, eager=True)  # its layers run as programs (over the whole cache)
        return cache, self.model.eager_step(cache)

    def _emit(self, row: int, token: int, logprob, prompt_lp=None) -> Update:
        r = self.rows[row]
        r.tokens += 1
        ends = self.sampler.ends_with(row, token)  # EOS or a stop_token_id: its text only if asked, as vLLM's
        if r.tracker.include or not ends:
            r.tracker.push(token)
        reason = None
        if r.tracker.stopped_at is not None or ends or self.sampler.complete(row):
            reason = self.sampler.end_reason(row)
        elif r.seq.cancelled:
            reason = "cancelled"
        elif r.tokens >= r.seq.config.max_new_tokens:
            reason = "length"
        if reason is not None:
            r.tracker.finish()
        text = r.tracker.delta(reason is not None)
        if reason is not None:
            self._leave(row)
        why = stop_reason(r.tracker, r.seq.config, token) if reason == "stop" else None
        return Update(
            r.seq.key, r.choice, text, token, reason is not None, reason, logprob, prompt_lp, r.tokens, why
        )

    def _finish(self, row: int, reason: str) -> Update:
        r = self.rows[row]
        self._leave(row)
        return Update(r.seq.key, r.choice, "", None, True, reason, tokens=r.tokens)
