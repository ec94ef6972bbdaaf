"""No hidden state on the decode path: the cache length attention reads is an argument of the forward,
and the inductor flag a compiled step needs is set only while it traces, under a lock."""

from __future__ import annotations

import threading

import torch

import tierlm
from tierlm import steps
from tierlm.cache import StaticCache
from tierlm.generation.slots import RowsView, SlotCache


def _settings(cache) -> dict:
    """Everything a cache holds that is not a tensor (or a list of them): what a forward could leave behind."""
    return {
        k: v
        for k, v in vars(cache).items()
        if not isinstance(v, torch.Tensor)
        and not (isinstance(v, list) and v and isinstance(v[0], torch.Tensor))
    }


def test_attention_reads_the_length_it_is_given(tiny_checkpoints, attention_lengths):
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32")
    cfg = model.config
    cache = StaticCache(cfg, 1, 64, torch.float32, "cpu")
    model.decoder.ensure_rope(64, "cpu")
    seen = attention_lengths
    ids = torch.tensor([[5, 9, 11, 17, 3]])
    before = _settings(cache)
    with torch.inference_mode():
        model.decoder(ids, cache=cache, slots=torch.arange(5), length=5)
        step = torch.tensor([[7]])
        bounded = model.decoder(
            step, cache=cache, positions=torch.tensor([[5]]), slots=torch.tensor([5]), length=6
        )
        assert seen == [6] * cfg.num_layers  # the one-token step: grouped attention over 6 slots
        k = torch.zeros(1, cfg.num_kv_heads, 1, cfg.head_dim)
        for view in (
            cache,
            RowsView(cache, slice(0, 1)),
            SlotCache(cache, 1),
            SlotCache(cache, 1, eager=True),
        ):
            assert view.mark_valid(torch.tensor([5]), torch.ones(1, 1, dtype=torch.bool), 6).shape[1] == 6
            assert view.update(0, k, k, torch.tensor([5]), 6)[0].shape[2] == 6
    assert _settings(cache) == before  # nothing written into the cache besides its tensors
    whole = StaticCache(cfg, 1, 64, torch.float32, "cpu")
    with torch.inference_mode():
        model.decoder(ids, cache=whole, slots=torch.arange(5))
        seen.clear()
        unbounded = model.decoder(step, cache=whole, positions=torch.tensor([[5]]), slots=torch.tensor([5]))
    assert seen == [64] * cfg.num_layers  # no length: the whole cache
    torch.testing.assert_close(bounded, unbounded)  # the slots past `length` are masked either way


def test_a_compiled_step_sets_freezing_only_while_it_traces_under_the_lock():
    inductor = torch._inductor.config
    calls: list[tuple[bool, bool]] = []

    def compiled(tokens, positions, slots):
        calls.append((inductor.freezing, steps._TRACING.locked()))
        return tokens

    before = inductor.freezing
    step = steps.CompiledStep(compiled, cache=None, freezing=True, skip_guards=True, what="a test step")
    step(1, 2, 3, 4)
    assert calls == [(True, True)] and inductor.freezing == before and not steps._TRACING.locked()
    step(1, 2, 3, 4)
    assert calls[1] == (before, False)  # traced: later calls touch no flag and take no lock


def test_a_second_thread_waits_while_a_step_traces():
    started, release, order = threading.Event(), threading.Event(), []

    def slow(tokens, positions, slots):
        started.set()
        release.wait(5)
        order.append("first")

    def quick(tokens, positions, slots):
        order.append("second")

    first = steps.CompiledStep(slow, None, True, False, "first")
    second = steps.CompiledStep(quick, None, False, False, "second")
    thread = threading.Thread(target=first, args=(0, 0, 0, 0))
    thread.start()
    started.wait(5)
    other = threading.Thread(target=second, args=(0, 0, 0, 0))
    other.start()
    other.join(0.2)
    assert order == []  # the second trace waits for the first to finish with the flag
    release.set()
    thread.join(5)
    other.join(5)
    assert order == ["first", "second"]
