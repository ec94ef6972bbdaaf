"""Prefill (eager) and the decode loop: sampling, stopping, streaming. No tokenizer here but the stream."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import torch

from tierlm.generation.config import GenerationConfig
from tierlm.generation.sampling import apply_repetition_penalty, mark_seen, sample_next, suppress_tokens

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


class Sampler:
    """Logits -> next tokens, holding the per-row state the processors need (seen tokens, RNG)."""

    def __init__(self, config: GenerationConfig, batch: Batch, vocab: int, eos: torch.Tensor) -> None:
        self.config, self.eos = config, eos
        device = batch.ids.device
        self.generator = None
        if config.seed is not None and not config.greedy:
            self.generator = torch.Generator(device=device).manual_seed(config.seed)
        self.seen = None
        if config.repetition_penalty != 1.0:
            self.seen = torch.zeros(batch.ids.shape[0], vocab, dtype=torch.bool, device=device)
            mark_seen(self.seen, torch.where(batch.mask, batch.ids, batch.ids[:, -1:]))

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        c = self.config
        if self.seen is not None:
            logits = apply_repetition_penalty(logits, self.seen, c.repetition_penalty)
        if step < c.min_new_tokens:
            logits = suppress_tokens(logits, self.eos)
        tokens = sample_next(
            logits,
            greedy=c.greedy,
            temperature=c.temperature,
            top_k=c.top_k,
            top_p=c.top_p,
            min_p=c.min_p,
            generator=self.generator,
        )
        if self.seen is not None:
            mark_seen(self.seen, tokens)
        return tokens


def run_decode(
    prefill: Generator[list[StepEvent], None, torch.Tensor],
    step: DecodeStep,
    batch: Batch,
    config: GenerationConfig,
    eos_ids: tuple[int, ...],
    pad_id: int,
    vocab: int,
    state: LoopState,
    should_stop: Callable[[int], bool] | None = None,
) -> Iterator[list[StepEvent]]:
    """Yield, per step, one event per still-running row; first [] for each prefill chunk but the last.

    `prefill` yields [] after each chunk of the prompt but the last and returns the last token's logits.
    `step(tokens, positions, slots, length)` gives next-token logits; `length` is the number of cache
    slots in use after the step (eager steps may read only those).

    The only host sync per step reads the new tokens (for EOS and stop strings).
    """
    b, width = batch.ids.shape
    device = batch.ids.device
    eos = torch.tensor(eos_ids or (-1,), dtype=torch.long, device=device)
    sampler = Sampler(config, batch, vocab, eos)
    limits = state.limits or [config.max_new_tokens] * b
    state.tokens = [[] for _ in range(b)]
    state.finish_reasons = [None] * b
    running = [True] * b

    logits = yield from prefill  # a unit of work per chunk, so a caller can interleave other generations
    start = time.perf_counter()
    tokens = sampler(logits, 0)
    positions = (batch.mask.sum(-1, keepdim=True) - 1).clone()  # rotary position of each row's last token
    slots = torch.tensor([width], device=device)
    host = tokens.tolist()
    state.prefill_seconds += time.perf_counter() - start  # the chunks add their own time
    start = time.perf_counter()
    eos_set = set(eos_ids)
    pad = torch.full((b,), pad_id, dtype=torch.long, device=device)
    done, n_done = None, 0  # device mask of finished rows, rebuilt only when a row finishes
    for i in range(max(limits)):
        events = []
        for row in range(b):
            if not running[row]:
                continue
            state.tokens[row].append(host[row])
            reason = None
            stop_hit = should_stop is not None and should_stop(row)  # sees every token, EOS included
            if stop_hit or host[row] in eos_set:  # EOS cannot be sampled before min_new_tokens
                reason = "stop"
            elif row in state.cancelled:
                reason = "cancelled"
            elif i + 1 >= limits[row]:
                reason = "length"
            if reason is not None:
                running[row] = False
                state.finish_reasons[row] = reason
            events.append(StepEvent(row, host[row], reason is not None, reason))
        yield events
        if not any(running):
            break
        if running.count(False) != n_done:
            n_done = running.count(False)
            done = torch.tensor([not r for r in running], device=device)
        positions += 1
        logits = step(tokens[:, None], positions, slots, width + i + 1)
        slots += 1
        tokens = sampler(logits, i + 1)
        if done is not None:
            tokens = torch.where(done, pad, tokens)
        host = tokens.tolist()
        state.decode_steps += 1
    state.decode_seconds = time.perf_counter() - start
