"""The decode step as a module torch.export can take: the cache's tensors are its inputs, mutated in place.

Used by tierlm.aot, which exports and packages it. A StaticCache's tensors are swapped for the inputs for
the one traced call; a SlotCache is rebuilt over the inputs themselves (`SlotCache.over`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tierlm.cache import StaticCache
from tierlm.generation.slots import SlotCache


class StepModule(torch.nn.Module):
    """The decode step as a module for torch.export: the cache's tensors are inputs it mutates in place."""

    def __init__(self, decoder: torch.nn.Module, cache: StaticCache | SlotCache) -> None:
        super().__init__()
        self.decoder = decoder
        self.cache = cache

    def forward(self, tokens, positions, slots, *state):
        ones = torch.ones(tokens.shape[0], 1, dtype=torch.bool, device=tokens.device)
        if isinstance(self.cache, SlotCache):  # a SlotCache over the inputs themselves
            cache = SlotCache.over(state)
            logits = self.decoder(tokens, ones, positions=positions, cache=cache, slots=slots)
        else:
            with _swapped(self.cache, state):
                logits = self.decoder(tokens, ones, positions=positions, cache=self.cache, slots=slots)
        return logits[:, -1].float()


def step_kind(cache) -> str:
    """'slots' for continuous batching's SlotCache, else 'static'."""
    return "slots" if isinstance(cache, SlotCache) else "static"


def state_tensors(cache) -> list[torch.Tensor]:
    """Every tensor the cache holds (keys, values, validity, ...), once each, in a stable order: a
    SlotCache's are its views and row slots (`SlotCache.state()`), never the big cache behind them."""
    if isinstance(cache, SlotCache):
        return cache.state()
    seen: dict[int, torch.Tensor] = {}
    for _owner, _name, _index, t in _tensor_slots(cache):
        seen.setdefault(id(t), t)
    return list(seen.values())


def _tensor_slots(obj, depth: int = 0):
    """(owner, attribute, list index or None, tensor) for each tensor in the cache and its layer views."""
    for name, value in vars(obj).items():
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, torch.Tensor):
                yield obj, name, index, item
            elif depth < 2 and type(item).__module__ == StaticCache.__module__:
                yield from _tensor_slots(item, depth + 1)


@contextmanager
def _swapped(cache, tensors):
    """The cache's tensors replaced by `tensors` (same order as state_tensors) for one traced call."""
    slots = list(_tensor_slots(cache))
    order = {id(t): i for i, t in enumerate(state_tensors(cache))}
    put = [(owner, name, index, tensors[order[id(t)]]) for owner, name, index, t in slots]
    try:
        for owner, name, index, t in put:
            _assign(owner, name, index, t)
        yield
    finally:
        for owner, name, index, t in slots:
            _assign(owner, name, index, t)


def _assign(owner, name, index, tensor) -> None:
    if index is None:
        setattr(owner, name, tensor)
    else:
        getattr(owner, name)[index] = tensor
