"""Prefill (eager) and the decode loop: sampling, stopping, streaming. No tokenizer here but the stream."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import torch

from tierlm.errors import RequestError
from tierlm.generation.config import GenerationConfig
from tierlm.generation.sampling import (
    apply_penalties,
    apply_repetition_penalty_rows,
    draw,
    mark_seen,
    suppress_where,
    token_logprobs,
    warp_rows,
)

DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class Batch:
    """Left-padded prompts: ids and mask [b, S]."""

    ids: torch.Tensor
    mask: torch.Tensor


def left_pad(prompts: list[list[int]], pad_id: int, device) -> Batch:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = True
    return Batch(ids.to(device), mask.to(device))


@dataclass
class StepEvent:
    """What one decode step produced for one row."""

    row: int
    token: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"


@dataclass
class LoopState:
    """Per-row progress that the caller (stop strings, streaming) may need to inspect."""

    tokens: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    limits: list[int] = field(default_factory=list)  # per-row max_new_tokens (default: the config's)
    cancelled: set[int] = field(default_factory=set)  # rows to end at the next step boundary
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)  # per row, when the config asks

    def start_rows(self, rows: int) -> None:
        """No tokens, log probabilities or finish reasons yet for any of `rows` rows."""
        self.tokens = [[] for _ in range(rows)]
        self.logprobs = [[] for _ in range(rows)]
        self.finish_reasons = [None] * rows


SEED_STRIDE = 0x9E3779B97F4A7C15  # choice i of a seeded request draws from seed + i * this (mod 2**64)


def row_seed(seed: int, choice: int) -> int:
    """The seed of sample `choice` of a request seeded with `seed`: choice 0 keeps the request's own."""
    return (seed + choice * SEED_STRIDE) % 2**64


@dataclass
class TokenLogprob:
    """A token's log probability (log-softmax of the raw float32 logits) and the most likely tokens there."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # a prompt token's: 1 + the tokens more likely there (vLLM's prompt_logprobs)


class Sampler:
    """Logits -> next tokens for rows that each have their own settings (a GenerationConfig per row) and
    their own state (tokens seen, counts, RNG), so a row samples the same tokens whatever rows it shares
    a batch with. Settings are [rows, 1] tensors; filters no row uses are skipped."""

    def __init__(self, rows: int, vocab: int, eos: torch.Tensor, device) -> None:
        self.vocab, self.device = vocab, device
        self.eos_ids = tuple(eos.tolist())
        self.ends: list[frozenset[int]] = [frozenset(self.eos_ids)] * rows  # the tokens that end each row

        def full(value, dtype=torch.float32):
            return torch.full((rows, 1), value, dtype=dtype, device=device)

        self.temperature, self.min_p = full(1.0), full(0.0)
        self.top_p = full(1.0, torch.float64)  # 1 - top_p rounds once, as transformers' float threshold does
        self.top_k = full(0, torch.long)
        self.repetition, self.presence, self.frequency = full(1.0), full(0.0), full(0.0)
        self.sampled = torch.zeros(rows, dtype=torch.bool, device=device)
        self.steps, self.min_new = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
        self.configs: list[GenerationConfig | None] = [None] * rows
        self.generators: list[torch.Generator | None] = [None] * rows
        # [rows, vocab], made once a row needs them (`_set_tables`)
        self.seen = self.counts = self.bias = self.early = self.barred = None
        self.grammar = None  # a grammar.GrammarMask, set before set_row when a row has a response_format
        self.bad_words = None  # a bad_words.BadWords, set before set_row where there is a tokenizer

    def set_row(
        self,
        row: int,
        config: GenerationConfig,
        prompt: list[int],
        choice: int = 0,
        budget: int | None = None,
    ) -> None:
        """Give `row` to a new sequence: its settings, its prompt (for the repetition penalty), its RNG; a
        structured answer closes within `budget` new tokens (default: the config's max_new_tokens)."""
        self.configs[row] = c = config
        self.temperature[row] = c.temperature if not c.greedy else 1.0
        self.top_k[row], self.top_p[row], self.min_p[row] = c.top_k, c.top_p, c.min_p
        self.repetition[row], self.presence[row] = c.repetition_penalty, c.presence_penalty
        self.frequency[row], self.sampled[row] = c.frequency_penalty, not c.greedy
        self.steps[row], self.min_new[row] = 0, c.min_new_tokens
        self.ends[row] = frozenset((() if c.ignore_eos else self.eos_ids) + c.stop_token_ids)
        self.generators[row] = None
        if not c.greedy:  # unseeded rows draw their seed from torch's global RNG, so manual_seed still rules
            seed = row_seed(c.seed, choice) if c.seed is not None else int(torch.randint(2**62, ()).item())
            self.generators[row] = torch.Generator(device=self.device).manual_seed(seed)
        self._set_tables(row, c, prompt)
        if self.grammar is not None:
            self.grammar.set_row(row, c.response_format, c.max_new_tokens if budget is None else budget)
        if self.bad_words is not None:
            self.bad_words.set_row(row, c.bad_words)
        elif c.bad_words:
            raise RequestError("bad_words need a tokenizer; this model has none")

    def _set_tables(self, row: int, c: GenerationConfig, prompt: list[int]) -> None:
        """The row's lines of the [rows, vocab] tables: tokens seen (repetition penalty), counts (presence and
        frequency), logit bias, what it may not sample before min_new_tokens (EOS even with ignore_eos, and
        its stop_token_ids, as vLLM's min_tokens masks them), what allowed_token_ids bars."""
        if (seen := self._row_table("seen", row, torch.bool, c.repetition_penalty != 1.0)) is not None:
            mark_seen(seen[row : row + 1], torch.tensor(prompt, device=self.device))
        self._row_table("counts", row, torch.float32, bool(c.presence_penalty or c.frequency_penalty))
        if (
            bias := self._row_table("bias", row, torch.float32, bool(c.logit_bias))
        ) is not None and c.logit_bias:
            ids, values = zip(*c.logit_bias)
            bias[row, list(ids)] = torch.tensor(values, device=self.device)
        banned = (self.eos_ids + c.stop_token_ids) if c.min_new_tokens else ()
        if (early := self._row_table("early", row, torch.bool, bool(banned))) is not None:
            early[row, list(banned)] = True
        allowed = c.allowed_token_ids
        barred = self._row_table("barred", row, torch.bool, allowed is not None, allowed is not None)
        if barred is not None and allowed is not None:
            barred[row, list(allowed)] = False

    def _row_table(self, name: str, row: int, dtype, needed: bool, fill=0) -> torch.Tensor | None:
        """Table `name`, made once a row needs it, with `row`'s line set to `fill`; None while none does."""
        table = getattr(self, name)
        if needed and table is None:
            table = self._table(dtype)
            setattr(self, name, table)
        if table is not None:
            table[row] = fill
        return table

    def ends_with(self, row: int, token: int) -> bool:
        """Whether `token` ends `row`: an EOS (unless the row ignores EOS) or one of its stop_token_ids."""
        return token in self.ends[row]

    def _table(self, dtype) -> torch.Tensor:
        return torch.zeros(len(self.configs), self.vocab, dtype=dtype, device=self.device)

    def __call__(self, logits: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """Next tokens [len(rows)] for logits [len(rows), vocab] of `rows` (all rows when None)."""
        rows = list(range(len(self.configs))) if rows is None else rows
        index = torch.tensor(rows, device=self.device)

        def pick(table: torch.Tensor) -> torch.Tensor:
            return table if len(rows) == len(self.configs) else table[index]

        configs = [self.configs[r] for r in rows]
        logits = logits.float()
        if self.bias is not None:  # before the penalties, as transformers' sequence_bias and vLLM apply it
            logits = logits + pick(self.bias)
        if self.barred is not None:  # allowed_token_ids
            logits = suppress_where(logits, pick(self.barred))
        if self.seen is not None:
            logits = apply_repetition_penalty_rows(logits, pick(self.seen), pick(self.repetition))
        if self.counts is not None:
            logits = apply_penalties(logits, pick(self.counts), pick(self.presence), pick(self.frequency))
        if self.early is not None and any(c.min_new_tokens for c in configs):  # no EOS before min_new_tokens
            early = (self.steps[index.cpu()] < self.min_new[index.cpu()]).to(logits.device)[:, None]
            logits = suppress_where(logits, early & pick(self.early))
        bad = self.bad_words is not None and self.bad_words.active
        if bad:
            logits = self.bad_words.apply(logits, rows)
        if self.grammar is not None:  # structured output: what a row's grammar forbids gets -inf
            logits = self.grammar.apply(logits, rows)
        tokens = logits.argmax(dim=-1)
        sampled = [c for c in configs if not c.greedy]
        if sampled:  # the filters run when a sampled row asks for them (a greedy row's settings are unused)
            warped = warp_rows(
                logits,
                pick(self.temperature),
                pick(self.top_k),
                pick(self.top_p),
                pick(self.min_p),
                cut=any(c.top_k > 0 or c.top_p < 1 for c in sampled),
                floor=any(c.min_p > 0 for c in sampled),
            )
            noise = torch.ones_like(warped)
            for i, row in enumerate(rows):
                if self.generators[row] is not None:
                    noise[i].exponential_(1, generator=self.generators[row])
            tokens = torch.where(pick(self.sampled), draw(warped.softmax(dim=-1), noise), tokens)
        host = None
        if self.grammar is not None and self.grammar.budgeted(rows):  # answers that must close in budget
            host = tokens.tolist()  # the loop reads them next anyway: no extra wait
            kept = self.grammar.within_budget(rows, host, self.steps[index.cpu()].tolist())
            if kept is not None:
                host, tokens = kept, torch.tensor(kept, dtype=tokens.dtype, device=tokens.device)
        self._record(index, tokens)
        if self.grammar is not None or bad:
            host = tokens.tolist() if host is None else host
            if self.grammar is not None:
                self.grammar.advance(rows, host)
            if bad:
                self.bad_words.advance(rows, host)
        return tokens

    def complete(self, row: int) -> bool:
        """True once `row`'s response_format grammar has matched a whole document: the row ends."""
        return self.grammar is not None and self.grammar.complete(row)

    def end_reason(self, row: int) -> str:
        """Why a row that ends by EOS, a stop or its complete grammar ends: "length" where its budget forced
        its structured answer closed, else "stop"."""
        return "length" if self.grammar is not None and self.grammar.closed_by_budget(row) else "stop"

    def _record(self, index: torch.Tensor, tokens: torch.Tensor) -> None:
        self.steps[index.cpu()] += 1
        if self.seen is not None:
            self.seen[index, tokens] = True
        if self.counts is not None:
            self.counts.index_put_(
                (index, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True
            )

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, rows: list[int] | None = None):
        """Per row of `rows` that asked for them, its TokenLogprob (None for the others)."""
        rows = list(range(len(self.configs))) if rows is None else rows
        wanted = [self.configs[r].logprobs for r in rows]
        if all(n is None for n in wanted):
            return [None] * len(rows)
        chosen, values, ids = token_logprobs(logits, tokens, max(n or 0 for n in wanted))
        chosen, values, ids, host = chosen.tolist(), values.tolist(), ids.tolist(), tokens.tolist()
        return [
            None if n is None else TokenLogprob(host[i], chosen[i], list(zip(ids[i][:n], values[i][:n])))
            for i, n in enumerate(wanted)
        ]


def run_decode(
    prefill: Generator[list[StepEvent], None, torch.Tensor],
    step: DecodeStep,
    batch: Batch,
    sampler: Sampler,
    pad_id: int,
    state: LoopState,
    should_stop: Callable[[int], bool] | None = None,
) -> Iterator[list[StepEvent]]:
    """Yield, per step, one event per still-running row; first [] for each prefill chunk but the last.

    `prefill` yields [] after each chunk of the prompt but the last and returns the last token's logits.
    `step(tokens, positions, slots, length)` gives next-token logits; `length` is the number of cache
    slots in use after the step (eager steps may read only those). `state.limits` holds each row's
    max_new_tokens; `sampler` each row's settings.

    The only host sync per step reads the new tokens (for EOS and stop strings), and the log
    probabilities when a row asked for them.
    """
    b, width = batch.ids.shape
    device = batch.ids.device
    state.start_rows(b)
    running = [True] * b

    logits = yield from prefill  # a unit of work per chunk, so a caller can interleave other generations
    start = time.perf_counter()
    tokens, logprobs, host = _sample(sampler, logits, None, None)
    positions = (batch.mask.sum(-1, keepdim=True) - 1).clone()  # rotary position of each row's last token
    slots = torch.tensor([width], device=device)
    state.prefill_seconds += time.perf_counter() - start  # the chunks add their own time
    start = time.perf_counter()
    pad = torch.full((b,), pad_id, dtype=torch.long, device=device)
    done, n_done = None, 0  # device mask of finished rows, rebuilt only when a row finishes
    for i in range(max(state.limits)):
        events = [
            _row_event(state, sampler, row, host[row], logprobs[row], i, should_stop)
            for row in range(b)
            if running[row]
        ]
        for event in events:
            running[event.row] = not event.finished
        yield events
        if not any(running):
            break
        if running.count(False) != n_done:
            n_done = running.count(False)
            done = torch.tensor([not r for r in running], device=device)
        positions += 1
        logits = step(tokens[:, None], positions, slots, width + i + 1)
        slots += 1
        tokens, logprobs, host = _sample(sampler, logits, done, pad)
        state.decode_steps += 1
    state.decode_seconds = time.perf_counter() - start


def _sample(sampler: Sampler, logits: torch.Tensor, done: torch.Tensor | None, pad: torch.Tensor | None):
    """A step's tokens (`pad` in the rows `done` marks finished), their log probabilities when asked, and the
    tokens on the host: the step's one sync."""
    tokens = sampler(logits)
    if done is not None:
        tokens = torch.where(done, pad, tokens)
    return tokens, sampler.logprobs(logits, tokens), tokens.tolist()


def _row_event(
    state: LoopState,
    sampler: Sampler,
    row: int,
    token: int,
    logprob: TokenLogprob | None,
    i: int,
    should_stop: Callable[[int], bool] | None,
) -> StepEvent:
    """Record the row's `i`-th new token, and say whether, and why, the row ends with it."""
    state.tokens[row].append(token)
    if logprob is not None:
        state.logprobs[row].append(logprob)
    reason = None
    stop_hit = should_stop is not None and should_stop(row)  # sees every token, an ending one included
    # an ending token (EOS, stop_token_ids) cannot be sampled before min_new_tokens
    if stop_hit or sampler.ends_with(row, token) or sampler.complete(row):
        reason = sampler.end_reason(row)
    elif row in state.cancelled:
        reason = "cancelled"
    elif i + 1 >= state.limits[row]:
        reason = "length"
    if reason is not None:
        state.finish_reasons[row] = reason
    return StepEvent(row, token, reason is not None, reason)
