"""KV caches with one contract: mark_valid() records which slots hold real tokens, update() stores K/V.

`static` preallocates max_len slots written in place with index_copy_ (compilable, fixed shapes);
`dynamic` grows by concatenation. Both give the same tokens.
"""

from __future__ import annotations

import torch

from tierlm.config import ModelConfig

CACHE_BUCKET = 256  # static caches round up to a power of two >= this, so short runs share one graph


def bucket_length(needed: int, limit: int) -> int:
    """The static cache length for `needed` slots: the next power of two >= CACHE_BUCKET, capped at limit."""
    size = CACHE_BUCKET
    while size < needed:
        size *= 2
    return min(size, max(limit, needed))


class StaticCache:
    """Preallocated K/V of shape [batch, kv_heads, max_len, head_dim] per layer."""

    is_compileable = True
    kind = "static"

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device) -> None:
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.batch, self.max_len = batch, max_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.limit = max_len  # eager decoding may read only the first `limit` slots (a Python int)
        for t in (*self.keys, *self.values, self.valid):
            torch._dynamo.mark_static_address(t)
        self.views = [StaticLayerView(k, v, max_len) for k, v in zip(self.keys, self.values)]

    def reset(self) -> None:
        self.valid.zero_()  # stale K/V stay behind the mask; they are finite, so they are harmless
        self.limit = self.max_len

    def mark_valid(self, slots: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
        self.valid.index_copy_(1, slots, new_valid)
        return self.valid[:, : self.limit]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        self.keys[layer].index_copy_(2, slots, k)
        self.values[layer].index_copy_(2, slots, v)
        return self.keys[layer][:, :, : self.limit], self.values[layer][:, :, : self.limit]


class StaticLayerView:
    """One layer's static K/V, for a compiled layer body shared by all layers (it never reads the index)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, limit: int) -> None:
        self.keys, self.values, self.limit = keys, values, limit

    def update(self, _layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        self.keys.index_copy_(2, slots, k)
        self.values.index_copy_(2, slots, v)
        return self.keys, self.values


class DynamicCache:
    """K/V that grow with each call; slots must be the next consecutive positions."""

    is_compileable = False
    kind = "dynamic"

    def __init__(self, cfg: ModelConfig, batch: int, device) -> None:
        self.keys: list[torch.Tensor | None] = [None] * cfg.num_layers
        self.values: list[torch.Tensor | None] = [None] * cfg.num_layers
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)

    def mark_valid(self, slots: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
        self.valid = torch.cat((self.valid, new_valid.to(torch.bool)), dim=1)
        return self.valid

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        if self.keys[layer] is not None:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v
