"""Beam search, with the rules of transformers' `generate(num_beams=k)` (greedy beams, its length penalty
and its three `early_stopping` modes), so its sequences and scores are the oracle's.

Each prompt has k rows in the batch (its beams; one prefill copied to all). A step scores every
(beam, token) continuation by the beam's summed log probability plus the token's, keeps the best
`keep` = max(2, 1 + ending tokens) * k of them, continues the best k that do not end, and offers those
among the best k that end (an ending token, or max_new_tokens reached) to the prompt's k finished
hypotheses, scored sum / new_tokens ** length_penalty. The cache's rows then follow their beams
(`reorder`). A prompt is done once no running beam can beat its worst finished hypothesis (the
heuristic of `early_stopping`); the search ends when every prompt is done, when `early_stopping=True` and
every prompt has k finished hypotheses, or when every continuation ends.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass

import torch

from tierlm.generation.config import GenerationConfig
from tierlm.generation.loop import Batch, DecodeStep, LoopState

NEVER = -1.0e9  # the score of a slot no hypothesis fills, and what is added to a candidate ruled out


@dataclass
class Hypothesis:
    """A finished beam: its new tokens, its score, and whether it ended on an ending token."""

    tokens: list[int]
    score: float
    ended: bool


class BeamSearch:
    """The beams of `prompts` prompts, k each: running scores and tokens, and k finished hypotheses per
    prompt (scores [P, k], best first once any finished)."""

    def __init__(self, prompts: int, config: GenerationConfig, ends: tuple[int, ...], device) -> None:
        k, steps = config.num_beams, config.max_new_tokens
        self.k, self.max_new, self.min_new = k, steps, config.min_new_tokens
        self.length_penalty, self.early_stopping = config.length_penalty, config.early_stopping
        self.ends = torch.tensor(ends, dtype=torch.long, device=device)
        self.keep = max(2, 1 + len(ends)) * k
        self.first_k = torch.arange(self.keep, device=device) < k  # only these may finish at a step
        self.running = torch.zeros(prompts, k, device=device)
        self.running[:, 1:] = NEVER  # the beams start equal: continue the first one only
        self.tokens = torch.zeros(prompts, k, steps, dtype=torch.long, device=device)
        self.done_scores = torch.full((prompts, k), NEVER, device=device)
        self.done_tokens = torch.zeros(prompts, k, steps, dtype=torch.long, device=device)
        self.done_lengths = torch.zeros(prompts, k, dtype=torch.long, device=device)
        self.done = torch.zeros(prompts, k, dtype=torch.bool, device=device)
        self.open = torch.ones(prompts, 1, dtype=torch.bool, device=device)  # may still improve
        self.steps = 0

    def advance(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One step from the next-token logits [P * k, vocab] of the running beams: the cache row each new
        beam continues [P * k], the beams' new tokens [P * k], and whether the search goes on."""
        p, k = self.running.shape
        vocab, i = logits.shape[-1], self.steps
        logp = torch.log_softmax(logits.float(), dim=-1)
        if i < self.min_new and self.ends.numel():
            logp[:, self.ends] = -float("inf")  # no ending token before min_new_tokens
        scores = (logp.view(p, k, vocab) + self.running[:, :, None]).view(p, k * vocab)
        top, index = scores.topk(self.keep)
        beam, token = index // vocab, index % vocab
        tokens = self.tokens.gather(1, beam[:, :, None].expand(-1, -1, self.max_new))
        tokens[:, :, i] = token
        if i + 1 >= self.max_new:
            ends = torch.ones_like(token, dtype=torch.bool)
        else:
            ends = torch.isin(token, self.ends)
        ruled_out = top + ends.to(torch.float32) * NEVER  # an ended candidate does not run on
        best = ruled_out.topk(k).indices
        self.tokens = tokens.gather(1, best[:, :, None].expand(-1, -1, self.max_new))
        self.running = ruled_out.gather(1, best)
        self._finish(top, tokens, ends, i + 1)
        self.steps = i + 1
        self._close(i + 1)
        full = self.done.all() & (self.early_stopping is True)
        going = bool(self.open.any() & ~full & ~ends.all())  # the step's one read of the search's state
        rows = torch.arange(p, device=beam.device)[:, None] * k + beam.gather(1, best)
        return rows.view(-1), self.tokens[:, :, i].reshape(-1), going

    def _finish(self, top: torch.Tensor, tokens: torch.Tensor, ends: torch.Tensor, length: int) -> None:
        """Offer the ended candidates among the best k to the finished hypotheses; keep the best k."""
        scores = top / (length**self.length_penalty)
        full = self.done.all(dim=-1, keepdim=True) & (self.early_stopping is True)
        scores = scores + full.to(torch.float32) * NEVER
        scores = scores + (~self.open).to(torch.float32) * NEVER
        offered = ends & self.first_k[None, :]
        scores = scores + (~offered).to(torch.float32) * NEVER
        merged = torch.cat((self.done_scores, scores), dim=1)
        pick = merged.topk(self.k).indices
        self.done_scores = merged.gather(1, pick)
        both = torch.cat((self.done_tokens, tokens), dim=1)
        self.done_tokens = both.gather(1, pick[:, :, None].expand(-1, -1, self.max_new))
        lengths = torch.cat((self.done_lengths, torch.full_like(offered, length, dtype=torch.long)), dim=1)
        self.done_lengths = lengths.gather(1, pick)
        self.done = torch.cat((self.done, offered), dim=1).gather(1, pick)

    def _close(self, length: int) -> None:
        """A prompt stays open while its best running beam, at the length the heuristic assumes, could beat
        the worst of its finished hypotheses (any while fewer than k finished)."""
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_new  # a longer beam scores higher: assume it runs to the end
        best = self.running[:, :1] / (length**self.length_penalty)
        worst = torch.where(self.done, self.done_scores.min(dim=1, keepdim=True).values, NEVER)
        self.open &= (best > worst).any(dim=-1, keepdim=True)

    def best(self, n: int) -> list[list[Hypothesis]]:
        """Each prompt's n best finished hypotheses, best first."""
        scores, lengths = self.done_scores.tolist(), self.done_lengths.tolist()
        tokens = self.done_tokens.tolist()
        ends = set(self.ends.tolist())
        out = []
        for p in range(len(scores)):
            hyps = []
            for j in range(n):
                row = tokens[p][j][: lengths[p][j]]
                hyps.append(Hypothesis(row, scores[p][j], bool(row) and row[-1] in ends))
            out.append(hyps)
        return out


def run_beams(
    prefill: Generator[list, None, torch.Tensor],
    step: DecodeStep,
    batch: Batch,
    search: BeamSearch,
    cache,
    state: LoopState,
) -> Iterator[list]:
    """Prefill, then beam steps until the search ends, yielding [] after each unit of work (a prefill
    chunk, a step), as `loop.run_decode` yields its events. `cache.reorder(rows, length)` makes each row
    continue the beam it was given."""
    b, width = batch.ids.shape
    logits = yield from prefill
    start = time.perf_counter()
    positions = (batch.mask.sum(-1, keepdim=True) - 1).clone()
    slots = torch.tensor([width], device=batch.ids.device)
    for i in range(search.max_new):
        rows, tokens, going = search.advance(logits)
        if not going:
            break
        cache.reorder(rows, width + i)
        positions += 1
        logits = step(tokens[:, None], positions, slots, width + i + 1)
        slots += 1
        state.decode_steps += 1
        yield []
    state.decode_seconds = time.perf_counter() - start
