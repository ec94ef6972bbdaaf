"""Rotary position embeddings: inverse frequencies with the scalings tierlm reads (linear, llama3, YaRN, a
GGUF's rope_freqs factors), the cos / signed sin tables a decoder keeps, and their application."""

from __future__ import annotations

import math

import torch

from tierlm.config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse rotary frequencies, with linear, llama3, yarn or a GGUF's per-frequency scaling applied."""
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / powers
    if scaling.rope_type == "yarn":
        return _yarn_scale(inv_freq, powers, head_dim, theta, scaling)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if scaling.rope_type == "freq_factors":  # a GGUF's rope_freqs, divided as llama.cpp divides them
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_scale(
    inv_freq: torch.Tensor, powers: torch.Tensor, head_dim: int, theta: float, s: RopeScaling
) -> torch.Tensor:
    """YaRN: the frequencies that turn fewer than beta_slow times over the original context are interpolated
    (divided by the factor), those that turn more than beta_fast times are kept, and a linear ramp over the
    dimensions between blends the two (as transformers' _compute_yarn_parameters and llama.cpp's rope_yarn)."""

    def dimension(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    interpolated = 1.0 / (s.factor * powers)
    kept = 1 - ramp  # written as transformers writes it, so the frequencies agree to the bit
    return interpolated * (1 - kept) + inv_freq * kept


def rope_tables(
    cfg: ModelConfig,
    length: int,
    device: torch.device | str,
    theta: float | None = None,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [length, head_dim] in fp32 for positions 0..length-1 (theta and scaling:
    the config's unless given, e.g. Gemma's local base for sliding layers). The sin table's first half is
    negated, for `apply_rope`."""
    theta = cfg.rope_theta if theta is None else theta
    scaling = cfg.rope_scaling if scaling is None else scaling
    inv_freq = rope_inv_freq(cfg.head_dim, theta, scaling).to(device)
    t = torch.arange(length, device=device, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    cos, sin = torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    if scaling.attention_factor != 1.0:  # yarn: scores grow by its square
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, h, s, d] by cos/signed sin [b, 1, s, d] (rotate-half convention, as HF's
    x * cos + cat(-x2, x1) * sin). Rolling x by half a head is cat(x2, x1), and the signed table carries the
    minus sign, so each element is the same product and sum as HF's, bit for bit, in 4 ops instead of 7
    (a decode step runs this for q and k in every layer)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin
