"""The attention masks of a forward: which cached keys each query sees (causal, padding, sliding window)."""

from __future__ import annotations

import torch


def attention_mask_4d(
    key_valid: torch.Tensor,
    slots: torch.Tensor,
    key_slots: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Bool mask [b, 1, s, L]: a query at slot q sees valid keys at slots <= q, and always itself.

    key_slots [L]: the slot (column) each key holds, when it is not its index (a sliding ring buffer).
    window: a query sees only keys at slots > q - window (Gemma's sliding layers, as HF counts them).
    Letting padded queries see themselves keeps their rows finite (no all -inf softmax, no NaN).
    """
    if key_slots is None:
        key_slots = torch.arange(key_valid.shape[1], device=key_valid.device)
    causal = key_slots[None, :] <= slots[:, None]  # [s, L]
    if window is not None:
        causal = causal & (key_slots[None, :] > slots[:, None] - window)
    own = key_slots[None, :] == slots[:, None]
    return ((key_valid[:, None, :] & causal[None]) | own[None]).unsqueeze(1)
