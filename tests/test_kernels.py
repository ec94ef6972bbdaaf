"""tierlm's int4/int8 CPU kernels (tierlm.kernels): their math against an exact product, the error bound of
their int16 activations, and where quantized linears use them. On an AVX512 CPU the int8 product runs its
AVX-512 loop, and the int4 product reads torch's AVX-512 packing (blocks of 64 rows) with one of its own.

The kernels quantize each row of x to int16 in blocks of 32 (scale = the block's largest |x| / 32767, round
to nearest even), then multiply exactly in integers and accumulate in float. So two checks hold on any CPU
with AVX2: (1) the output equals the exact (float64) product of the dequantized weight with that quantized
x, up to float32 accumulation (relative 1e-5 of the sum of |terms|) and the output dtype's rounding; (2) it
differs from the product with the unquantized x by at most half a quantization step per element:
|y - x W^T| <= sum over blocks b of (d_b / 2) * sum_{k in b} |W[n, k]|.
"""

from __future__ import annotations

import pytest
import torch

from tierlm import cpu, kernels
from tierlm.quant import Int4Linear, Int8Linear

AVX2 = cpu.CpuFeatures("simulated AMD Zen 3", "AVX2", native_bf16=False)
AVX512 = cpu.CpuFeatures("simulated AMD Zen 4", "AVX512", native_bf16=True)
ARM = cpu.CpuFeatures("simulated Arm Neoverse", "SVE256", native_bf16=True)


def test_the_int4_kernel_reads_torchs_packing_on_this_cpu(ops):
    """`int4_block` checks the kernel against aten's product (8 rows: the tiles too) and answers None where
    they differ, which turns tierlm's int4 off and skips the int4 tests below: on x86 it must find the packing."""
    want = {"AVX2": 32, "AVX512": 64}[torch.backends.cpu.get_cpu_capability()]
    assert kernels.int4_block() == want


@pytest.fixture(scope="module")
def int4(ops):
    """(the kernels, the rows per block of torch's int4 packing here: `kernels.int4_block`)."""
    if kernels.int4_block() is None:
        pytest.skip("the int4 kernel does not read torch's int4 packing here; aten's int4 runs")
    return ops, kernels.int4_block()


def pack_in_blocks_of_32(codes: torch.Tensor) -> torch.Tensor:
    """torch's AVX2 int4 packing, written out: in each block of 32 rows, byte (k, j) holds column k of row j
    in its low nibble and of row 16 + j in its high one."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).view(n // 32, 2, 16, k)  # [block, low/high half, row j, column]
    return (blocks[:, 0] | blocks[:, 1] << 4).transpose(1, 2).contiguous().view(n, k // 2)


def quantized_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the kernels see it (float32, rows quantized in blocks of 32) and each block's scale d."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 32767
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(m, k), d.reshape(m, k // 32)


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = the kernel's x @ w.T (w: the dequantized weight [N, K], float32)."""
    xq, d = quantized_x(x)
    exact = xq.double() @ w.double().T
    scale = xq.double().abs() @ w.double().abs().T  # the sum of |terms| bounds float32 accumulation error
    rounding = 0.0 if y.dtype == torch.float32 else 2.0**-8  # bf16 output: half an ulp, relative
    err = (y.double() - exact).abs()
    assert (err <= 1e-5 * scale + rounding * exact.abs() + 1e-6).all(), err.max()
    # the activation quantization's own error: half a step per element, at most
    m, k = x.shape
    half_steps = (d.double() / 2).repeat_interleave(32, dim=1)  # [M, K]
    bound = half_steps @ w.double().abs().T
    true = x.double() @ w.double().T
    assert ((y.double() - true).abs() <= bound + 1e-5 * scale + rounding * true.abs() + 1e-6).all()


def make_x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 5] *= 40  # an outlier column, as LLM activations have: its block gets a coarse step
    if k >= 64:
        x[:, 32:64] = 0  # an all-zero block (scale 0)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "k", "group"),
    [(32, 32, 32), (96, 576, 32), (64, 32, 32), (192, 576, 32), (64, 576, 64), (256, 1536, 128)],
)
@pytest.mark.parametrize(
    "m", [1, 2, 3, 4, 17]
)  # tiles of 2 (AVX2) or 3 (AVX-512) activation rows, then the rest
def test_int4_matches_the_exact_product_of_its_quantized_activations(int4, dtype, n, k, group, m):
    ops, block = int4
    if n % block:
        pytest.skip(f"torch packs int4 in blocks of {block} rows here")
    lin = torch.nn.Linear(k, n, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.05, generator=torch.Generator().manual_seed(n + k))
    q = Int4Linear.from_linear(lin, group, dtype)
    x = make_x(m, k, dtype, seed=m)
    y = ops.int4_mm(x, q.weight_int4, group, q.scales_and_zeros, block)
    assert y.dtype == dtype and y.shape == (m, n)
    check(y.float() if dtype == torch.float32 else y, x, q.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(4, 32), (100, 576), (512, 1536)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 17])  # the AVX-512 loop takes up to 4 rows at a time
def test_int8_matches_the_exact_product_of_its_quantized_activations(ops, dtype, n, k, m):
    lin = torch.nn.Linear(k, n, bias=False)
    q = Int8Linear.from_linear(lin, dtype)
    x = make_x(m, k, dtype, seed=m)
    y = ops.int8_mm(x, q.weight_int8, q.scales)
    assert y.dtype == dtype and y.shape == (m, n)
    check(y, x, q.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_are_the_same_bits_alone_or_in_a_batch(ops, dtype):
    """A row's product does not depend on the rows beside it: one row (a batch-1 decode step, which reads each
    weight row from start to end) gives the same bits as that row in a batch of 5 (four rows in one tile on an
    AVX-512 CPU, then one), so batched and single decoding of the same text agree exactly."""
    lin = torch.nn.Linear(576, 96, bias=False)
    q = Int8Linear.from_linear(lin, dtype)
    x = make_x(5, 576, dtype, seed=5)
    batch = ops.int8_mm(x, q.weight_int8, q.scales)
    for r in range(5):
        assert torch.equal(ops.int8_mm(x[r : r + 1], q.weight_int8, q.scales)[0], batch[r]), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packing", [32, 64])
def test_int4_rows_are_the_same_bits_alone_or_in_a_batch(int4, dtype, packing):
    """As for int8: each row of an int4 product of 1 to 7 rows (tiles of 2 or 3 activation rows, then one or
    two left) gives the bits of that row's product alone, on either of torch's packings."""
    ops, block = int4
    if packing > block:
        pytest.skip("the AVX2 build reads torch's AVX2 packing (blocks of 32 rows) only")
    torch.manual_seed(packing)
    n, k = 192, 576
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = (
        pack_in_blocks_of_32(codes)
        if packing == 32
        else torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    )
    sz = torch.stack([torch.rand(k // 32, n) / 10, torch.randn(k // 32, n) / 10], dim=-1).to(dtype)
    x = make_x(7, k, dtype, seed=7)
    alone = [ops.int4_mm(x[r : r + 1], packed, 32, sz, packing)[0] for r in range(7)]
    for m in range(1, 8):
        batch = ops.int4_mm(x[:m], packed, 32, sz, packing)
        for r in range(m):
            assert torch.equal(batch[r], alone[r]), (m, r)


def mixed_input():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64, bias=False)
    return lin, make_x(3, 64, torch.float32, seed=3)  # fp32 activations, against bf16 scales below


def non_finite(x: torch.Tensor):
    """x in bf16 with a NaN, then an infinity, in row 1."""
    for bad in (float("nan"), float("inf")):
        xb = x.clone().bfloat16()
        xb[1, 40] = bad
        yield xb


def test_int8_mixed_dtypes_no_rows_and_non_finite_activations(ops):
    lin, x = mixed_input()
    q8 = Int8Linear.from_linear(lin, torch.bfloat16)  # bf16 scales
    y8 = ops.int8_mm(x, q8.weight_int8, q8.scales)
    assert y8.dtype == torch.float32
    check(y8, x, q8.dequantize())
    assert ops.int8_mm(x[:0], q8.weight_int8, q8.scales).shape == (0, 64)
    # a NaN or infinity reaches every output of its row, as it does through aten's kernels; other rows stay
    for xb in non_finite(x):
        y8 = ops.int8_mm(xb, q8.weight_int8, q8.scales)
        assert y8[1].isnan().all() and y8[[0, 2]].isfinite().all()


def test_int4_no_rows_and_non_finite_activations(int4):
    (ops, block), (lin, x) = int4, mixed_input()
    q4 = Int4Linear.from_linear(lin, 32, torch.bfloat16)
    assert ops.int4_mm(x[:0].bfloat16(), q4.weight_int4, 32, q4.scales_and_zeros, block).shape == (0, 64)
    for xb in non_finite(x):
        y4 = ops.int4_mm(xb, q4.weight_int4, 32, q4.scales_and_zeros, block)
        assert y4[1].isnan().all() and y4[[0, 2]].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_int4_blocks_of_64_give_the_bits_of_blocks_of_32(int4, dtype, m):
    """The AVX-512 build's product on torch's AVX-512 packing (blocks of 64 rows) sums each row as the product
    on the AVX2 packing (blocks of 32) does: the same bits, so AVX2 and AVX-512 CPUs decode int4 alike."""
    ops, block = int4
    torch.manual_seed(m)
    n, k = 192, 576
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    if block == 32:  # an AVX2 build, which reads blocks of 32 only: the packing written out is torch's here
        assert torch.equal(
            pack_in_blocks_of_32(codes), torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        )
        return
    sz = torch.stack([torch.rand(k // 32, n) / 10, torch.randn(k // 32, n) / 10], dim=-1).to(dtype)
    x = make_x(m, k, dtype, seed=m)
    by64 = ops.int4_mm(x, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), 32, sz, 64)
    by32 = ops.int4_mm(x, pack_in_blocks_of_32(codes), 32, sz, 32)
    assert torch.equal(by64, by32)
    with pytest.raises(RuntimeError, match="N of the block"):
        ops.int4_mm(x, pack_in_blocks_of_32(codes[:96]), 32, sz[:, :96].contiguous(), 64)


def test_bad_shapes_are_one_clear_error(ops):
    q = Int4Linear.from_linear(torch.nn.Linear(64, 64, bias=False), 32, torch.float32)
    with pytest.raises(RuntimeError, match="int4_mm: scales_and_zeros must be"):
        ops.int4_mm(torch.randn(1, 96), q.weight_int4, 32, q.scales_and_zeros)
    with pytest.raises(RuntimeError, match="int8_mm: weight must be contiguous int8"):
        ops.int8_mm(torch.randn(1, 64), torch.zeros(8, 64), torch.ones(8))


def linears(dtype=torch.bfloat16):
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 128, bias=True)
    return Int4Linear.from_linear(lin, 32, dtype), Int8Linear.from_linear(lin, dtype)


@pytest.mark.parametrize("features", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_quantized_linears_use_the_kernels_where_the_cpu_selects_them(ops, monkeypatch, features):
    monkeypatch.delenv("TIERLM_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu, "detect", lambda: features)
    assert features.int_kernels and "tierlm's" in features.kernels()
    q4, q8 = linears()
    assert q8.kernel and q4.kernel == (kernels.int4_block() is not None)
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, 1, 576, dtype=torch.bfloat16)
        x2d = x.reshape(-1, 576)
        if q4.kernel:
            want4 = ops.int4_mm(x2d, q4.weight_int4, 32, q4.scales_and_zeros, q4.block) + q4.bias
        else:
            want4 = (
                torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, q4.weight_int4, 32, q4.scales_and_zeros)
                + q4.bias
            )
        assert torch.equal(q4(x), want4.reshape(rows, 1, 128))
        want8 = ops.int8_mm(x2d, q8.weight_int8, q8.scales) + q8.bias
        assert torch.equal(q8(x), want8.reshape(rows, 1, 128))


@pytest.mark.parametrize("why", ["aten", "arm"])
def test_other_cpus_and_the_opt_out_keep_atens_kernels(ops, monkeypatch, why):
    if why == "aten":
        monkeypatch.setattr(cpu, "detect", lambda: AVX2)
        monkeypatch.setenv("TIERLM_CPU_KERNELS", "aten")
        assert not AVX2.int_kernels
    else:
        monkeypatch.delenv("TIERLM_CPU_KERNELS", raising=False)
        monkeypatch.setattr(cpu, "detect", lambda: ARM)
    assert kernels.selected() is None
    q4, q8 = linears()
    assert not q4.kernel and not q8.kernel
    x = torch.randn(3, 576, dtype=torch.bfloat16)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4.weight_int4, 32, q4.scales_and_zeros) + q4.bias
    assert torch.equal(q4(x), want)
    want = torch.ops.aten._weight_int8pack_mm(x, q8.weight_int8, q8.scales) + q8.bias
    assert torch.equal(q8(x), want)
    assert "tierlm's" not in cpu.detect().kernels()


def test_a_compiled_graph_calls_the_kernels(ops, monkeypatch):
    monkeypatch.delenv("TIERLM_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu, "detect", lambda: AVX2)
    q4, q8 = linears()
    model = torch.nn.Sequential(
        q4, torch.nn.GELU(), torch.nn.Linear(128, 576, dtype=torch.bfloat16), q8
    ).eval()
    x = torch.randn(1, 576, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    # the same kernels on the same inputs: only the float ops between them may round differently
    torch.testing.assert_close(compiled, eager, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_is_layers_rmsnorm_up_to_a_rounding(ops, dtype, gemma):
    """rms_norm against the float64 formula of layers.RMSNorm / GemmaRMSNorm, over rows of a 3-d x (576 wide,
    and 100, not a multiple of 8): llama rounds x / rms to the dtype, then multiplies by the weight in the dtype
    (two roundings, as Hugging Face); gemma multiplies by (1 + weight) in fp32 and rounds once. fp32: within
    1e-6 relative of the exact value; bf16: within one ulp (2^-7 relative) of the exact value's rounding chain."""
    from tierlm.models.layers import GemmaRMSNorm, RMSNorm

    gen = torch.Generator().manual_seed(11)
    for dim in (576, 100):
        x = (torch.randn(3, 5, dim, generator=gen) * 4).to(dtype)
        norm = (GemmaRMSNorm if gemma else RMSNorm)(dim, 1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=gen))
        got = ops.rms_norm(x, norm.weight, 1e-6, gemma)
        assert got.dtype == dtype and got.shape == x.shape
        x64, w64 = x.double(), norm.weight.double()
        n64 = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        want = n64 * (1 + w64) if gemma else w64 * n64.to(dtype).double()
        rel = 1e-6 if dtype == torch.float32 else 2.0**-7
        # bf16 llama: x / rms lands on either neighbour of a tie, then the weight scales that one ulp
        scale = want.abs() + (w64.abs() * n64.abs() if not gemma else 0)
        assert ((got.double() - want).abs() <= rel * scale + 1e-30).all()
        with torch.no_grad():
            module = norm(x)  # aten's path (the kernel flag is off on a bare module)
        if dtype == torch.bfloat16:
            assert (got != module).float().mean() < 0.01  # the two orders of the sum disagree on a rare tie


def test_gemma_rms_norm_takes_an_fp32_weight_over_bf16_rows(ops):
    """GemmaRMSNorm scales by (1 + weight) in fp32 whatever the weight's dtype: an fp32 weight over bf16 x gives
    GemmaRMSNorm's bf16 result up to a rare tie (the order of the sum); a NaN row stays NaN, the others finite."""
    from tierlm.models.layers import GemmaRMSNorm

    gen = torch.Generator().manual_seed(5)
    norm = GemmaRMSNorm(576, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
    x = torch.randn(4, 576, generator=gen).to(torch.bfloat16)
    x[2, 7] = float("nan")
    got = ops.rms_norm(x, norm.weight, 1e-6, True)
    with torch.no_grad():
        want = norm(x)
    assert got.dtype == torch.bfloat16
    assert got[2].isnan().all() and want[2].isnan().all()
    rows = [0, 1, 3]
    assert got[rows].isfinite().all()
    assert (got[rows] != want[rows]).float().mean() < 0.01
    torch.testing.assert_close(got[rows].float(), want[rows].float(), rtol=2**-7, atol=0)


def test_rms_norm_bad_inputs_are_one_clear_error(ops):
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight must be contiguous \\[D\\]"):
        ops.rms_norm(x, torch.ones(7), 1e-6, False)
    with pytest.raises(RuntimeError, match="one dtype unless gemma"):
        ops.rms_norm(x.bfloat16(), torch.ones(8), 1e-6, False)
    with pytest.raises(RuntimeError, match="contiguous CPU tensor"):
        ops.rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-6, False)


def test_the_cache_listing_names_built_kernels(tmp_path):
    from tierlm.cache_folder import cache_entries, clear_cache

    built = tmp_path / "kernels" / "0123456789abcdef"
    built.mkdir(parents=True)
    (built / "tierlm_avx2.so").write_bytes(bytes(3000))
    (entry,) = cache_entries(tmp_path)
    assert (entry.kind, entry.nbytes) == ("kernels", 3000) and "CPU kernels" in entry.about
    removed, kept = clear_cache(tmp_path)
    assert removed == [entry] and not kept and not (tmp_path / "kernels").exists()


@pytest.mark.slow  # a build of the kernels (~20 s)
def test_a_library_cut_short_on_disk_is_built_again(ops, tmp_path):
    """A built library that is shorter on disk than its build wrote it (a full disk, a copy cut short) is
    built again: loading it would kill every later process with SIGBUS."""
    import os
    import shutil
    import subprocess
    import sys

    built = kernels._folder(kernels._flags())
    shutil.copytree(built, tmp_path / built.name)
    library = tmp_path / built.name / f"{kernels.LIBRARY}.so"
    size = library.stat().st_size
    os.truncate(library, size // 2)
    script = "from tierlm import kernels; print(kernels.loaded() is not None)"
    env = {**os.environ, "TIERLM_KERNELS_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
    assert "building the int4/int8 CPU kernels" in proc.stderr
    assert kernels._intact(library) and library.stat().st_size > size // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_column_is_every_scratch_views_keep_in_one_call(ops, dtype):
    """After an eager continuous step, each row's scratch column goes to its own slot: the op gives the bits
    of ScratchLayerView.keep's indexing, for rows of the big cache (strided views) and a row whose own slot
    is the scratch column, and touches nothing else."""
    from tierlm.generation.slots import ScratchLayerView

    g = torch.Generator().manual_seed(0)
    big = [torch.randn(6, 3, 40, 8, generator=g).to(dtype) for _ in range(4)]  # 4 stores of 6 rows
    stores = [t[:4] for t in big]  # a SlotCache's 4 rows of them
    where = torch.tensor([[3], [39], [0], [17]])  # row 1's own slot is the scratch column (39)
    before, expected = big[0].clone(), [t.clone() for t in big]
    for keys, values in zip(expected[:2], expected[2:]):
        ScratchLayerView(keys[:4], values[:4], where).keep(39)
    ops.copy_column(stores, where, 39)
    for got, want in zip(big, expected):
        assert torch.equal(got, want)
    assert not torch.equal(big[0], before) and torch.equal(big[0][4:], before[4:])  # rows 4-5 untouched


def test_copy_column_bad_slots_are_one_clear_error(ops):
    stores = [torch.zeros(2, 1, 8, 4)]
    with pytest.raises(RuntimeError, match="row slot out of range"):
        ops.copy_column(stores, torch.tensor([[1], [8]]), 7)
    with pytest.raises(RuntimeError, match="scratch column out of range"):
        ops.copy_column(stores, torch.tensor([[1], [2]]), 8)
    with pytest.raises(RuntimeError, match=r"stores must be \[rows, heads, slots, dim\]"):
        ops.copy_column(stores, torch.tensor([[1]]), 7)
