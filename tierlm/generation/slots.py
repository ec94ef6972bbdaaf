"""Rows of a static cache: a view that prefills some rows only, and the copy of a prefill to sibling rows."""

from __future__ import annotations

import torch

from tierlm import kernels
from tierlm.cache import StaticCache, StaticLayerView
from tierlm.models.masks import attention_mask_4d


class RowsView:
    """Some rows (a slice of the batch) of a StaticCache, for a forward that fills only those rows.

    Writes go through to the cache; reads see the first `length` slots, as StaticCache's own do.
    """

    kind = "static"
    is_compileable = False

    def __init__(self, cache: StaticCache, rows: slice) -> None:
        self.cache, self.rows = cache, rows
        self.keys = [k[rows] for k in cache.keys]
        self.values = [v[rows] for v in cache.values]
        self.valid = cache.valid[rows]

    def mark_valid(
        self, slots: torch.Tensor, new_valid: torch.Tensor, length: int | None = None
    ) -> torch.Tensor:
        self.valid.index_copy_(1, slots, new_valid)
        return self.valid[:, :length]

    def sliding_mask(self, key_valid: torch.Tensor, slots: torch.Tensor, window: int) -> torch.Tensor | None:
        return self.cache.sliding_mask(key_valid, slots, window)  # its rows' columns are their positions

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, length: int | None = None
    ):
        self.keys[layer].index_copy_(2, slots, k)
        self.values[layer].index_copy_(2, slots, v)
        return self.keys[layer][:, :, :length], self.values[layer][:, :, :length]

    def copy_to_siblings(self, n: int, width: int) -> None:
        """Rows come in groups of n (this view holds each group's first): copy its first `width` slots to
        the other n - 1 rows of its group, so n samples share one prefill."""
        c = self.cache
        groups = c.batch // n
        for t in (*c.keys, *c.values):
            grouped = t.view(groups, n, *t.shape[1:])
            grouped[:, 1:, :, :width] = grouped[:, :1, :, :width]
        valid = c.valid.view(groups, n, -1)
        valid[:, 1:, :width] = valid[:, :1, :width]


class SlotCache:
    """The first `rows` rows of a StaticCache whose rows each write at a slot of their own (continuous
    batching: a row's slot is its own position, whoever else is in the batch).

    A decode step is called with `slots` = [scratch], one column shared by the batch: each row's new K/V
    goes to the scratch column, where the row's query sees it (the decoder lets every query see its own
    column), and to its own slot (`row_slots`). A row's own slot becomes valid only after the step
    (`commit`), so its token counts once. The scratch column is past every slot a row has written, so
    what is left there is overwritten before it is ever valid.

    A compiled step writes both in the step (`SlotLayerView`). An eager one (`eager=True`) writes only the
    scratch column, as a static cache's step writes its one slot, so its layers attend through tierlm's
    fused rotary-attention kernel and run as layer programs (tierlm.models.programs); `commit` then copies
    the column to each row's own slot (`ScratchLayerView`).
    """

    kind = "static"
    is_compileable = True

    def __init__(self, cache: StaticCache, rows: int, eager: bool = False) -> None:
        if cache.rings:
            raise ValueError("rows at positions of their own need sliding layers without rings (rings=False)")
        # not marked static: a step only reads it, and its values change between steps (rows join and
        # leave), where a frozen whole step folds what it computes from a static input into a constant (a
        # sliding layer's window, `sliding_mask`, went stale so)
        row_slots = torch.zeros(rows, 1, dtype=torch.long, device=cache.valid.device)
        keys, values = [k[:rows] for k in cache.keys], [v[:rows] for v in cache.values]
        self._hold(keys, values, cache.valid[:rows], row_slots, ScratchLayerView if eager else SlotLayerView)
        self.cache = cache

    @classmethod
    def over(cls, state) -> SlotCache:
        """A SlotCache over the tensors `state()` lists (a packaged step's inputs), with no big cache."""
        layers = (len(state) - 2) // 2
        cache = cls.__new__(cls)
        cache._hold(list(state[:layers]), list(state[layers : 2 * layers]), state[-2], state[-1])
        cache.cache = None
        return cache

    def _hold(self, keys, values, valid: torch.Tensor, row_slots: torch.Tensor, view=None) -> None:
        self.batch, self.max_len = valid.shape
        self.keys, self.values, self.valid, self.row_slots = keys, values, valid, row_slots
        self.views = [(view or SlotLayerView)(k, v, row_slots) for k, v in zip(keys, values)]
        self._copy_column = _column_copier(keys[0]) if view is ScratchLayerView else None

    def state(self) -> list[torch.Tensor]:
        """Every tensor a decode step reads or writes: keys and values per layer (contiguous views of the
        first rows of the big cache, written in place), validity and each row's slot (read only)."""
        return [*self.keys, *self.values, self.valid, self.row_slots]

    def mark_valid(
        self, slots: torch.Tensor, new_valid: torch.Tensor, length: int | None = None
    ) -> torch.Tensor:
        return self.valid[:, :length]  # this step's tokens are seen at the scratch column

    def sliding_mask(self, key_valid: torch.Tensor, slots: torch.Tensor, window: int) -> torch.Tensor:
        """A sliding layer's mask at a decode step: each row sees its valid keys in the window before its own
        position (row_slots), and this step's key at the scratch column, as HF's window counts them."""
        cols = torch.arange(key_valid.shape[1], device=key_valid.device)
        return attention_mask_4d(key_valid & (cols > self.row_slots - window), slots)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, length: int | None = None
    ):
        return self.views[layer].update(layer, k, v, slots, length)

    def commit(self, active: torch.Tensor, scratch: int) -> None:
        """After a step at slot `scratch` (its scratch column): the slots the `active` rows [rows] bool just
        wrote hold valid keys from now on (an eager step's are copied there from the scratch column first)."""
        if self._copy_column is not None:  # every layer's ScratchLayerView.keep in one call
            self._copy_column([*self.keys, *self.values], self.row_slots, scratch)
        else:
            for view in self.views:
                view.keep(scratch)
        self.valid.scatter_(1, self.row_slots, active[:, None])


class SlotLayerView:
    """One layer of a SlotCache (also the compiled layer body's view: it never reads the layer index).

    Eager decode writes each row's new column by indexing (index_put_); compiled steps keep scatter_,
    which inductor lowers to a plain store (and AOT packages were exported with). Aten's CPU scatter_
    took 0.4-0.75 ms for 16 rows of a 3 x 512 x 64 bf16 layer, 2.8 ms in a real step, against 0.026 ms
    indexed (Zen 3, 2 threads): 60 of them made a 16-row continuous decode step of the default model
    ~360 ms, against ~130 ms for a static cache's step of the same rows.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, row_slots: torch.Tensor) -> None:
        self.keys, self.values, self.row_slots = keys, values, row_slots
        self._rows = torch.arange(keys.shape[0], device=keys.device)

    def update(
        self, _layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, length: int | None = None
    ):
        eager = not torch.compiler.is_compiling()  # k, v [rows, heads, 1, head_dim]: a decode step's
        where = self.row_slots[:, 0] if eager else self.row_slots[:, None, :, None].expand_as(k)
        for store, new in ((self.keys, k), (self.values, v)):
            if eager:  # the row's own slot: row i's new column goes to its slot row_slots[i]
                store[self._rows, :, where] = new[:, :, 0]
            else:
                store.scatter_(2, where, new)
            store.index_copy_(2, slots, new)  # the scratch column, where this step's queries see it
        return self.keys[:, :, :length], self.values[:, :, :length]

    def keep(self, _scratch: int) -> None:
        """After a step: each row's own slot holds its K/V already (`update` wrote it)."""


class ScratchLayerView(StaticLayerView):
    """One layer of an eager SlotCache: a decode step writes at the scratch column only, as a static cache's
    step writes at its slot (a StaticLayerView's `decode_slots`, `attended` and `update`, so the step may
    attend through `layers.rope_attention`, which writes there itself), and `keep` copies the column to
    each row's own slot after the step (where tierlm's CPU kernels run, `SlotCache.commit` does every
    layer's copy in one call of their `copy_column` instead). On the default model (int4, 1 row, Zen 5) an
    eager continuous step took 8.8 ms through aten's rotary and the module tree, against 6.0 ms for a
    static cache's."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, row_slots: torch.Tensor) -> None:
        super().__init__(keys, values)
        self.row_slots = row_slots
        self._rows = torch.arange(keys.shape[0], device=keys.device)

    def keep(self, scratch: int) -> None:
        """Copy the scratch column to each row's own slot (row i's to row_slots[i]). A Python int: a tensor
        index would be read back from the device (a sync on a GPU); where a row's slot is the scratch
        column itself, the same bytes are written back."""
        where = self.row_slots[:, 0]
        for store in (self.keys, self.values):
            store[self._rows, :, where] = store[:, :, scratch]


def _column_copier(store: torch.Tensor):
    """tierlm's CPU op that does every ScratchLayerView's `keep` in one call (0.3 ms a step at one row in 60
    indexing ops, Zen 5), where this process uses tierlm's kernels and the cache is on the CPU; else None."""
    ops = kernels.selected() if store.device.type == "cpu" else None
    return None if ops is None else ops.copy_column


def copy_rows(cache: StaticCache, source: int, targets: list[int], width: int) -> None:
    """Copy row `source`'s first `width` slots (K/V and validity) to rows `targets` (n samples of a prompt)."""
    if not targets:
        return
    index = torch.tensor(targets, dtype=torch.long, device=cache.valid.device)
    for t in (*cache.keys, *cache.values):
        t[index, :, :width] = t[source, :, :width]
    cache.valid[index, :width] = cache.valid[source, :width]
