"""GGUF blocks whose values are 4-bit codes on a grid per 32 weights (Q4_0, Q4_1, Q4_K), read as those codes:
w = (q - 8) * scale + zero with q in 0..15, tierlm.quant's int4 convention, so the file's own codes are what
the int4 kernels multiply by (never requantized from a dequantized copy).

Per block of 32 (gguf-py's dequantize_blocks): Q4_0 w = d * (q - 8), so scale = d, zero = 0; Q4_1
w = d * q + m, so scale = d, zero = m + 8 d; Q4_K (8 sub-blocks of 32 in a super-block of 256, 6-bit scales
and mins) w = (d * sc) * q - dmin * mn, so scale = d * sc, zero = 8 d sc - dmin mn. The scales are exact in
fp32 (an fp16 times a 6-bit integer); a zero is rounded once there, so a weight is within one fp32 rounding
of gguf-py's (tests/test_gguf_blocks.py).
"""

from __future__ import annotations

import numpy as np
import torch

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
GROUP = 32  # weights per scale and zero
_BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}  # weights, bytes per block
ROWS = 1024  # rows decoded at a time: temporaries of a few MB, not the tensor's size in int32


def _half(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per element (the last dim) as fp16, widened to fp32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A block's [..., n] bytes as 2n codes: the low nibbles first, then the high ones (ggml's order)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _code_bytes(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """The code bytes of rows of `kind` blocks: uint8 [rows, blocks, bytes of codes per block]."""
    blocks = raw.reshape(raw.shape[0], -1, _BLOCK_BYTES[kind][1])
    return blocks[..., {"Q4_0": 2, "Q4_1": 4, "Q4_K": 16}[kind] :]  # after the block's scales


def decode_rows(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of `kind` blocks (uint8 [rows, bytes per row]) as (codes uint8 [rows, K], scales fp32
    [rows, K/32], zeros fp32 [rows, K/32])."""
    rows = raw.shape[0]
    if kind == "Q4_K":
        qs = _code_bytes(raw, kind).reshape(rows, -1, 4, 32)
        codes = torch.stack([qs & 15, qs >> 4], dim=-2)  # sub-block 2i: the low nibbles of chunk i
    else:
        codes = _nibbles(_code_bytes(raw, kind))
    return (codes.reshape(rows, -1), *decode_scales(raw, kind))


def decode_scales(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (scales, zeros) fp32 [rows, K/32] of rows of `kind` blocks."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _BLOCK_BYTES[kind][1])
    if kind == "Q4_K":
        d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])  # [rows, blocks, 1]
        s = blocks[..., 4:16]
        lo, hi, mixed = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = torch.cat([lo & 63, (mixed & 15) | ((lo >> 2) & 48)], dim=-1).float()
        mn = torch.cat([hi & 63, (mixed >> 4) | ((hi >> 2) & 48)], dim=-1).float()
        scales = d * sc
        zeros = 8 * scales - dmin * mn
    else:
        d = _half(blocks[..., 0:2])
        scales = d
        zeros = torch.zeros_like(d) if kind == "Q4_0" else _half(blocks[..., 2:4]) + 8 * d
    return scales.reshape(rows, -1), zeros.reshape(rows, -1)


def packed_codes(raw: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """Rows of `kind` blocks (uint8 [rows, bytes per row], rows a multiple of `block`) as their codes in torch's
    CPU int4 packing (uint8 [rows, K/2]: in each block of `block` rows, byte (k, j) holds column k of row j in
    its low nibble and of row block/2 + j in its high one; tierlm.quant._pack_blocks), straight from the
    blocks' bytes: a byte of h codes' run holds column b in its low nibble and b + h in its high one (h = 16
    in Q4_0/Q4_1, 32 in each 64 columns of Q4_K), so the two rows' nibbles combine without unpacking."""
    rows = raw.shape[0]
    h = 32 if kind == "Q4_K" else 16
    qs = _code_bytes(raw, kind).reshape(rows // block, 2, block // 2, -1, h)  # [blocks, half, j, run, b]
    first, second = qs[:, 0], qs[:, 1]
    out = torch.empty((rows // block, qs.shape[3], 2, h, block // 2), dtype=torch.uint8)
    low, high = out[:, :, 0], out[:, :, 1]  # columns b and h + b of each run: [blocks, run, b, j]
    torch.bitwise_left_shift(second, 4, out=low.permute(0, 3, 1, 2))
    low.permute(0, 3, 1, 2).bitwise_or_(first & 15)
    torch.bitwise_and(second, 0xF0, out=high.permute(0, 3, 1, 2))
    high.permute(0, 3, 1, 2).bitwise_or_(first >> 4)
    return out.view(rows, -1)


def int4_parts(
    data: np.ndarray, kind: str, row_order: torch.Tensor | None = None, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF tensor's blocks (gguf-py's uint8 [rows, bytes per row], memory-mapped) as (codes uint8 [N, K],
    scales fp32 [N, K/32], zeros fp32 [N, K/32]), read ROWS at a time; row_order: the stored row of each
    output row (llama.cpp's q/k permutation undone), else the stored order; block: the codes come packed
    instead, uint8 [N, K/2] in torch's CPU int4 layout of `block` rows (`packed_codes`; N a multiple of it)."""
    if kind not in INT4_TYPES:
        raise ValueError(f"{kind} blocks are not 4-bit codes on a grid of {GROUP}")
    n, row_bytes = data.shape
    width, size = _BLOCK_BYTES[kind]
    k = row_bytes // size * width
    if block is not None and n % block:  # ROWS is a multiple of every block (32, 64)
        raise ValueError(f"{n} rows do not pack in blocks of {block}")
    codes = torch.empty((n, k if block is None else k // 2), dtype=torch.uint8)
    scales = torch.empty((n, k // GROUP), dtype=torch.float32)
    zeros = torch.empty((n, k // GROUP), dtype=torch.float32)
    order = None if row_order is None else row_order.numpy()
    for start in range(0, n, ROWS):
        stop = min(start + ROWS, n)
        picked = data[start:stop] if order is None else data[order[start:stop]]
        raw = torch.from_numpy(
            np.array(picked, dtype=np.uint8, copy=True)
        )  # a private copy: the map is read-only
        if block is None:
            codes[start:stop], scales[start:stop], zeros[start:stop] = decode_rows(raw, kind)
        else:
            codes[start:stop] = packed_codes(raw, kind, block)
            scales[start:stop], zeros[start:stop] = decode_scales(raw, kind)
    return codes, scales, zeros
