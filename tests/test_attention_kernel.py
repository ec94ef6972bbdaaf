"""tierlm's decode attention kernels (tierlm.kernels: decode_attention, and decode_rope_attention with the
step's rotary and static-cache write): their math against float64 attention, NaN and empty-row semantics, their
batch invariance (a row's bits do not depend on where a batch puts its keys) and their errors."""

from __future__ import annotations

import pytest
import torch


def exact_attention(q, k, v, mask, scale=None):
    """Decode attention in float64: q [b, H, 1, d], k/v [b, KV, L, d], mask [b, 1, 1, L]."""
    from tierlm.models.layers import grouped_attention

    return grouped_attention(q.double(), k.double(), v.double(), mask, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "b, h, kv, length, d",
    [(1, 9, 3, 256, 64), (2, 4, 1, 200, 256), (3, 8, 8, 37, 64), (2, 16, 2, 130, 128), (1, 5, 5, 1, 8)],
)
def test_decode_attention_matches_the_exact_attention(ops, dtype, b, h, kv, length, d):
    """tierlm's decode attention kernel against float64 attention: random masks whose rows differ, caches
    of one to four chunks of 64 slots (a chunk may be all masked: the merge skips it), 1 to 8 query heads per
    K/V head. It works in fp32 and rounds once to q's dtype: fp32 within 1e-5 of each output's scale, bf16
    within half an ulp (2^-8 relative) more."""
    gen = torch.Generator().manual_seed(b * 1000 + length)
    q = torch.randn(b, h, 1, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, kv, length, d, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(b, 1, 1, length, generator=gen) < 0.6
    mask[0, ..., : min(length, 64)] = False  # the first row's first chunk masked whole
    mask[..., -1] = True
    out = ops.decode_attention(q[:, :, 0], k, v, mask, d**-0.5)
    assert out.dtype == dtype and out.shape == (b, h, d)
    ref = exact_attention(q, k, v, mask)[:, :, 0]
    rtol = 0.0 if dtype == torch.float32 else 2.0**-8
    err = (out.double() - ref).abs()
    assert (err <= 1e-5 * v.double().abs().amax() + rtol * ref.abs()).all(), err.max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_depends_on_a_rows_attended_slots_not_where_they_sit(ops, dtype):
    """A row's 150 keys and values (three chunks of 64 attended slots) give the same bits wherever they sit:
    after left padding of 5 or 64 slots, with masked holes between them, or with the last one in a scratch
    column at the end of a longer cache (a continuous step), each in a batch of such rows."""
    torch.manual_seed(0)
    kv, d, n = 3, 64, 150
    q = torch.randn(4, 9, d).to(dtype)
    k, v = torch.randn(4, kv, n, d).to(dtype), torch.randn(4, kv, n, d).to(dtype)
    alone = torch.stack(
        [
            ops.decode_attention(
                q[r : r + 1], k[r : r + 1], v[r : r + 1], torch.ones(1, n, dtype=torch.bool), 0.125
            )[0]
            for r in range(4)
        ]
    )
    total = 300
    placements = [
        torch.arange(n) + 5,  # left padding
        torch.arange(n) + 64,
        torch.arange(n) * 2,  # a masked slot after each
        torch.cat([torch.arange(n - 1), torch.tensor([total - 1])]),  # the last key in a scratch column
    ]
    keys, values = torch.zeros(4, kv, total, d, dtype=dtype), torch.zeros(4, kv, total, d, dtype=dtype)
    mask = torch.zeros(4, total, dtype=torch.bool)
    for r, slots in enumerate(placements):
        keys[r, :, slots], values[r, :, slots], mask[r, slots] = k[r], v[r], True
    keys[~mask[:, None, :, None].expand_as(keys)] = float("nan")  # masked slots are never read
    assert torch.equal(ops.decode_attention(q, keys, values, mask, 0.125), alone)
    # rows with fewer chunks than the batch's longest: 40 attended slots after padding, and none (NaN)
    short = torch.ones(1, 40, dtype=torch.bool)
    first = ops.decode_attention(q[:1], k[:1, :, :40].contiguous(), v[:1, :, :40].contiguous(), short, 0.125)
    mask[1], mask[2] = False, False
    mask[1, 70:110] = True
    keys[1, :, 70:110], values[1, :, 70:110] = k[0, :, :40], v[0, :, :40]
    q2 = q.clone()
    q2[1] = q[0]
    out = ops.decode_attention(q2, keys, values, mask, 0.125)
    assert torch.equal(out[1], first[0]) and out[2].isnan().all()
    assert torch.equal(out[0], alone[0]) and torch.equal(out[3], alone[3])


def test_decode_attention_reads_a_strided_cache_and_its_own_scale(ops):
    """The first `length` slots of a larger static cache (a strided view, as an eager step reads it), a
    batch-broadcast mask, bf16 q over an fp32 cache, an explicit scale (Gemma's query_pre_attn_scalar)."""
    gen = torch.Generator().manual_seed(7)
    cache_k, cache_v = (torch.randn(2, 2, 96, 32, generator=gen) for _ in range(2))
    k, v = cache_k[:, :, :70], cache_v[:, :, :70]
    q = torch.randn(2, 6, 1, 32, generator=gen).to(torch.bfloat16)
    row = torch.rand(1, 1, 1, 70, generator=gen) < 0.5
    row[..., 3] = True
    mask = row.expand(2, 1, 1, 70)  # stride 0 between batch rows
    out = ops.decode_attention(q[:, :, 0], k, v, mask, 0.25)
    ref = exact_attention(q, k, v, mask, scale=0.25)[:, :, 0]
    assert (out.double() - ref).abs().max() <= 1e-5 + 2.0**-8 * ref.abs().max()


def test_decode_attention_over_no_slot_is_nan_like_softmax(ops):
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 5, 8)
    mask = torch.zeros(1, 1, 1, 5, dtype=torch.bool)
    assert torch.isnan(ops.decode_attention(q, k, k, mask, 1.0)).all()
    assert torch.isnan(exact_attention(q[:, :, None], k, k, mask)).all()


def test_decode_attention_keeps_a_nan_where_softmax_attention_has_one(ops):
    """A NaN in one query head or in an attended key makes those heads' outputs NaN, as in the matmul path;
    the other heads stay finite."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 4, 1, 16, generator=gen),
        *(torch.randn(1, 2, 80, 16, generator=gen) for _ in range(2)),
    )
    mask = torch.ones(1, 1, 1, 80, dtype=torch.bool)
    q[0, 1, 0, 3] = float("nan")  # query head 1 (K/V head 0)
    k[0, 1, 70, 0] = float("nan")  # K/V head 1: query heads 2 and 3
    out = ops.decode_attention(q[:, :, 0], k, v, mask, 0.25)
    ref = exact_attention(q, k, v, mask, scale=0.25)[:, :, 0]
    assert torch.equal(out.isnan().any(-1), torch.tensor([[False, True, True, True]]))
    assert torch.equal(ref.isnan().any(-1), out.isnan().any(-1))


def test_decode_attention_keeps_a_chunk_whose_only_score_is_nan(ops):
    """The newest key NaN and alone in its 64-slot chunk: that chunk's max is NaN, not "no slot", so every
    query head of its K/V head comes out NaN, as in the matmul path."""
    q, k, v = torch.randn(1, 2, 16), torch.randn(1, 1, 80, 16), torch.randn(1, 1, 80, 16)
    k[0, 0, 64, 5] = float("nan")
    mask = torch.zeros(1, 1, 1, 80, dtype=torch.bool)
    mask[..., :65] = True
    assert torch.isnan(ops.decode_attention(q, k, v, mask, 0.25)).all()
    assert torch.isnan(exact_attention(q[:, :, None], k, v, mask, scale=0.25)).all()


def test_decode_attention_bad_inputs_are_one_clear_error(ops):
    q, k = torch.randn(1, 9, 64), torch.randn(1, 3, 16, 64)
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="H / KV at most 8"):
        ops.decode_attention(
            torch.randn(1, 18, 64), torch.randn(1, 1, 16, 64), torch.randn(1, 1, 16, 64), mask, 1.0
        )
    with pytest.raises(RuntimeError, match="d a multiple of 8"):
        ops.decode_attention(q[..., :60], k[..., :60], k[..., :60], mask, 1.0)
    with pytest.raises(RuntimeError, match="L > 0"):
        ops.decode_attention(q, k[:, :, :0], k[:, :, :0], mask[..., :0], 1.0)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        ops.decode_attention(q, k, k, mask.float(), 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.decode_attention(q.double(), k.double(), k.double(), mask, 1.0)


def rope_tables(b, d, dtype, gen):
    """cos and the signed sin of rotary.apply_rope for one position per row: [b, 1, 1, d]."""
    angle = torch.rand(b, 1, 1, d // 2, generator=gen) * 100
    cos = torch.cat([angle.cos(), angle.cos()], -1)
    return cos.to(dtype), torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [
        (torch.float32,) * 2,
        (torch.bfloat16,) * 2,
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize(
    "b, h, kv, lmax, length, slot, d, one_table",
    [(1, 9, 3, 256, 256, 37, 64, False), (2, 8, 2, 96, 70, 69, 128, False), (3, 4, 4, 40, 12, 0, 8, True)],
)
def test_decode_rope_attention_is_rotary_then_cache_write_then_attention(
    ops, dtype, cache_dtype, b, h, kv, lmax, length, slot, d, one_table
):
    """The fused decode step against its parts: q, k and v as views of one q/k/v product (strided, as a fused
    projection gives them); k rotated and v written at `slot` of a larger cache, every other slot untouched;
    the rotated k equal to rotary.apply_rope's in fp32, rounded once to the cache's dtype (in fp32 bit for bit
    aten's ops); the output the exact attention of the rotated q over the first `length` slots (the mask's),
    within the tolerance of test_decode_attention_matches_the_exact_attention."""
    from tierlm.models.rotary import apply_rope

    gen = torch.Generator().manual_seed(b * 100 + d)
    qkv = torch.randn(b, 1, (h + 2 * kv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
    q, k, v = q.view(b, 1, h, d), k.view(b, 1, kv, d), v.view(b, 1, kv, d)
    cos, sin = rope_tables(1 if one_table else b, d, dtype, gen)
    keys, values = (torch.randn(b, kv, lmax, d, generator=gen).to(cache_dtype) for _ in range(2))
    want_keys, want_values = keys.clone(), values.clone()
    mask = torch.rand(b, 1, 1, length, generator=gen) < 0.6
    mask[..., slot] = True
    out = ops.decode_rope_attention(
        q[:, 0], k[:, 0], v[:, 0], cos, sin, keys, values, torch.tensor([slot]), mask, d**-0.5
    )
    assert out.dtype == dtype and out.shape == (b, h, d)

    def rotate(x):  # [b, 1, heads, d] -> [b, heads, 1, d] in fp32
        return apply_rope(x.transpose(1, 2).float(), cos.float(), sin.float())

    want_keys[:, :, slot] = rotate(k)[:, :, 0].to(cache_dtype)
    want_values[:, :, slot] = v[:, 0].to(cache_dtype)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    if dtype == cache_dtype == torch.float32:
        assert torch.equal(keys[:, :, slot], apply_rope(k.transpose(1, 2), cos, sin)[:, :, 0])
    ref = exact_attention(rotate(q).to(dtype), keys[:, :, :length], values[:, :, :length], mask)[:, :, 0]
    rtol = 0.0 if dtype == torch.float32 else 2.0**-8
    err = (out.double() - ref).abs()
    assert (err <= 1e-5 * values.double().abs().amax() + rtol * ref.abs()).all(), err.max()


def test_decode_rope_attention_bad_inputs_are_one_clear_error(ops):
    """A slot outside the cache or outside what the mask attends, a slot tensor of the wrong kind, an odd head
    size: one error each, and the cache is left as it was."""
    q, k = torch.randn(1, 4, 8), torch.randn(1, 2, 8)
    cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
    keys, values = torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 8)
    mask = torch.ones(1, 1, 1, 10, dtype=torch.bool)

    def call(slots, m=mask, qq=q, kk=k, c=cos):
        return ops.decode_rope_attention(
            qq, kk, kk, c, c if c is not cos else sin, keys, values, slots, m, 1.0
        )

    with pytest.raises(RuntimeError, match="slot 16 is outside the cache of 16"):
        call(torch.tensor([16]))
    with pytest.raises(RuntimeError, match="must cover the written slot"):
        call(torch.tensor([12]))
    with pytest.raises(RuntimeError, match="one int64 slot"):
        call(torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="one int64 slot"):
        call(torch.tensor([1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="must be even"):
        odd = torch.zeros(1, 2, 16, 7)
        ops.decode_rope_attention(
            torch.randn(1, 4, 7),
            *(torch.randn(1, 2, 7),) * 2,
            *(torch.ones(1, 7),) * 2,
            odd,
            odd,
            torch.tensor([1]),
            mask,
            1.0,
        )
    assert not keys.any() and not values.any()
