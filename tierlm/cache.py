"""KV caches with one contract: mark_valid() (and sliding_keys() for a model with sliding layers)
records which slots hold real tokens, update() stores K/V. Both take `length`, the slots attention reads
(the first `length`; None: all of them), an argument of each forward and never state of the cache.

`static` preallocates max_len slots written in place with index_copy_ (compilable, fixed shapes), and a
ring buffer of window slots for each sliding-window layer (Gemma 3); `dynamic` grows by concatenation.
Both give the same tokens.
"""

from __future__ import annotations

import torch

from tierlm.config import ModelConfig
from tierlm.models.masks import attention_mask_4d

CACHE_BUCKET = 256  # static caches round up to a power of two >= this, so short runs share one graph


def bucket_length(needed: int, limit: int) -> int:
    """The static cache length for `needed` slots: the next power of two >= CACHE_BUCKET, capped at limit."""
    size = CACHE_BUCKET
    while size < needed:
        size *= 2
    return min(size, max(limit, needed))


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these tensors keep their addresses across calls (a step writes them in place; CUDA graphs
    are skipped for a graph that mutates inputs not known to be static). It is what
    torch._dynamo.mark_static_address does, without importing torch._dynamo, which imports inductor:
    ~1.5 s of a process that never compiles."""
    for t in tensors:
        t._dynamo_static_input_type = "unguarded"


class StaticCache:
    """Preallocated K/V of shape [batch, kv_heads, max_len, head_dim] per layer; a sliding layer's is a
    ring buffer of min(window, max_len) slots (`RingLayerView`), or with rings=False as long as the others,
    its window a mask (`sliding_mask`): what rows at positions of their own need (continuous batching)."""

    is_compileable = True
    kind = "static"

    def __init__(
        self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device, rings: bool = True
    ) -> None:
        self.batch, self.max_len = batch, max_len
        self.rings = rings and bool(cfg.sliding_layers)  # False: no ring anywhere
        ring = min(cfg.sliding_window, max_len) if self.rings else max_len
        self.ring = ring

        def zeros(i: int) -> torch.Tensor:
            length = ring if cfg.is_sliding(i) else max_len
            return torch.zeros(batch, cfg.num_kv_heads, length, cfg.head_dim, dtype=dtype, device=device)

        self.keys = [zeros(i) for i in range(cfg.num_layers)]
        self.values = [zeros(i) for i in range(cfg.num_layers)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        # What the ring slots hold, shared by every sliding layer: the column (-1: nothing) and validity.
        self.ring_cols = torch.full((ring,), -1, dtype=torch.long, device=device)
        self.ring_valid = torch.zeros(batch, ring, dtype=torch.bool, device=device)
        mark_static(*self.keys, *self.values, self.valid, self.ring_cols, self.ring_valid)
        self.views = [
            RingLayerView(k, v) if self.rings and cfg.is_sliding(i) else StaticLayerView(k, v)
            for i, (k, v) in enumerate(zip(self.keys, self.values))
        ]

    def reset(self) -> None:
        self.valid.zero_()  # stale K/V stay behind the mask; they are finite, so they are harmless
        self.ring_valid.zero_()
        self.ring_cols.fill_(-1)  # a stale column could pass for a query's own key

    def mark_valid(
        self, slots: torch.Tensor, new_valid: torch.Tensor, length: int | None = None
    ) -> torch.Tensor:
        self.valid.index_copy_(1, slots, new_valid)
        return self.valid[:, :length]

    def sliding_mask(self, key_valid: torch.Tensor, slots: torch.Tensor, window: int) -> torch.Tensor | None:
        """A sliding layer's mask where its keys are as long as a full layer's (rings=False): the window cut
        by columns, which are positions up to each row's left padding. None: the layer is a ring
        (`sliding_keys`)."""
        return None if self.rings else attention_mask_4d(key_valid, slots, window=window)

    def sliding_keys(self, slots: torch.Tensor, new_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The columns [L] and validity [b, L] of the keys a sliding layer attends to in this call (what
        RingLayerView.update returns), and the ring's bookkeeping advanced past it. Call once per forward."""
        s = slots.shape[0]
        if s == 1:  # decode: written first, then the ring is read
            self.ring_cols.index_copy_(0, slots % self.ring, slots)
            self.ring_valid.index_copy_(1, slots % self.ring, new_valid)
            return self.ring_cols, self.ring_valid
        cols = torch.cat((self.ring_cols, slots))
        valid = torch.cat((self.ring_valid, new_valid.to(torch.bool)), dim=1)
        keep = min(s, self.ring)  # the chunk's last `ring` columns stay for the next call
        self.ring_cols.index_copy_(0, slots[-keep:] % self.ring, slots[-keep:])
        self.ring_valid.index_copy_(1, slots[-keep:] % self.ring, new_valid[:, -keep:].to(torch.bool))
        return cols, valid

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, length: int | None = None
    ):
        return self.views[layer].update(layer, k, v, slots, length)

    def reorder(self, rows: torch.Tensor, length: int) -> None:
        """Row r takes the keys and values of row rows[r] (beam search: a beam continues another), in the first
        `length` slots (a ring's every slot). Validity stays: the rows that trade are one prompt's beams."""
        moved = (rows != torch.arange(self.batch, device=rows.device)).nonzero().squeeze(1)
        if moved.numel() == 0:
            return
        sources = rows[moved]
        for t in (*self.keys, *self.values):
            written = t[:, :, :length]
            written.index_copy_(0, moved, written.index_select(0, sources))


class RingLayerView:
    """A sliding layer's K/V: a static ring of `ring` slots, column c in slot c % ring (index_copy_).

    A decode step writes its token, then attends over the whole ring (which then holds the last `ring`
    columns). A prefill chunk attends over the ring as it was plus the chunk's own K/V (the window mask
    applies inside the chunk too), then leaves its last `ring` tokens in the ring.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.ring = keys.shape[2]

    def decode_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Where a decode step at `slots` writes its K/V: slot c % ring, as `update` does."""
        return slots % self.ring

    def attended(self, _length: int | None) -> int:
        """A decode step attends over the whole ring, whatever `length` the forward reads."""
        return self.ring

    def update(self, _layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, _length=None):
        """K/V of the ring (and of a prefill chunk): a window, whatever `length` the forward reads."""
        s = slots.shape[0]
        if s == 1:
            self.keys.index_copy_(2, slots % self.ring, k)
            self.values.index_copy_(2, slots % self.ring, v)
            return self.keys, self.values
        all_k, all_v = torch.cat((self.keys, k), dim=2), torch.cat((self.values, v), dim=2)
        keep = min(s, self.ring)
        where = slots[-keep:] % self.ring
        self.keys.index_copy_(2, where, k[:, :, -keep:])
        self.values.index_copy_(2, where, v[:, :, -keep:])
        return all_k, all_v


class StaticLayerView:
    """One layer's static K/V (also a compiled layer body's view: it never reads the layer index)."""

    # update = index_copy_ at `slots` on dim 2, as layers.decode_attention_region does it
    writes_at_slots = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    def decode_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Where a decode step at `slots` writes its K/V (layers.rope_attention writes it there itself)."""
        return slots

    def attended(self, length: int | None) -> int:
        """The slots a decode step reading the first `length` (None: all) attends over."""
        return self.keys.shape[2] if length is None else length

    def update(
        self, _layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, length: int | None = None
    ):
        # layers.decode_attention_region writes a compiled whole step's K/V the same way: change both together
        self.keys.index_copy_(2, slots, k)
        self.values.index_copy_(2, slots, v)
        return self.keys[:, :, :length], self.values[:, :, :length]


class DynamicCache:
    """K/V that grow with each call; slots must be the next consecutive positions."""

    is_compileable = False
    kind = "dynamic"

    def __init__(self, cfg: ModelConfig, batch: int, device) -> None:
        self.keys: list[torch.Tensor | None] = [None] * cfg.num_layers
        self.values: list[torch.Tensor | None] = [None] * cfg.num_layers
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)

    def mark_valid(self, slots: torch.Tensor, new_valid: torch.Tensor, _length=None) -> torch.Tensor:
        """Every key so far: a dynamic cache holds only the slots written (`length` adds nothing)."""
        self.valid = torch.cat((self.valid, new_valid.to(torch.bool)), dim=1)
        return self.valid

    def sliding_keys(self, slots: torch.Tensor, new_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sliding layers keep every key here; the window is the mask's (after mark_valid)."""
        return torch.arange(self.valid.shape[1], device=self.valid.device), self.valid

    def reorder(self, rows: torch.Tensor, _length: int) -> None:
        """Row r takes the keys and values of row rows[r] (StaticCache.reorder)."""
        self.keys = [None if k is None else k.index_select(0, rows) for k in self.keys]
        self.values = [None if v is None else v.index_select(0, rows) for v in self.values]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, _length=None):
        if self.keys[layer] is not None:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v
