"""tierlm's one-row bf16 product (kernels.bf16_vector_product, AVX-512 BF16 or AVX2): its math against the exact
product, its errors, and where eager decode steps use it."""

from __future__ import annotations

import pytest
import torch
from test_kernels import make_x

from tierlm import cpu, kernels


@pytest.fixture(scope="module")
def bf16_mv():
    if kernels.bf16_vector_product() is None:
        pytest.skip("tierlm's one-row bf16 product is built where tierlm's CPU kernels are (x86)")
    return kernels.bf16_vector_product()


@pytest.mark.parametrize(("n", "k"), [(4, 32), (96, 576), (49152 // 64, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_vector_product_matches_the_exact_product(bf16_mv, n, k, bias):
    """y = x @ w.T (+ bias) of bf16 x and w, summed in fp32 (each product exact but for subnormals, which
    AVX-512 BF16's vdpbf16ps flushes to zero; the sums rounded to fp32: relative 1e-5 of the sum of |terms|), rounded
    once to bf16 (half an ulp)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = make_x(1, k, torch.bfloat16, seed=k)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = bf16_mv(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (1, n)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    err = (y.double() - exact).abs()
    assert (err <= 1e-5 * scale + 2.0**-8 * exact.abs() + 1e-6).all(), err.max()


def test_a_strided_row_falls_back_from_the_bf16_kernel(bf16_mv):
    """linear.linear sends the kernel contiguous rows only: a strided one runs F.linear, no error."""
    from tierlm.models.linear import VECTOR_KERNEL, linear

    w = torch.randn(64, 64).bfloat16()
    x = torch.randn(1, 1, 128).bfloat16()[..., ::2]
    y = linear(x, w, None, False, VECTOR_KERNEL)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=2**-7, atol=1e-2)


def test_bf16_vector_product_bad_shapes_are_one_clear_error(bf16_mv):
    w = torch.randn(8, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bf16_mv: x must be"):
        bf16_mv(torch.randn(2, 64).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="bf16_mv: weight must be"):
        bf16_mv(torch.randn(1, 48).bfloat16(), torch.randn(8, 48).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bf16_mv: weight must be"):
        bf16_mv(torch.randn(1, 64).bfloat16(), w.T.contiguous().T, None)


def test_eager_one_row_bf16_products_run_on_the_bf16_kernel_where_it_is_built(tiny_checkpoints):
    """load() sets every float linear's VECTOR_KERNEL flag where the CPU selects the kernel and it is built;
    an eager batch-1 decode
    step then multiplies through it (a prefill's products of several rows do not)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import tierlm
    from tierlm.models.linear import VECTOR_KERNEL, Linear

    model = tierlm.load(tiny_checkpoints["llama"], dtype="bfloat16")
    built = cpu.detect().vector_kernel and kernels.bf16_vector_product() is not None
    linears = [m for m in model.decoder.modules() if isinstance(m, Linear)]
    assert linears and all(bool(m.vector & VECTOR_KERNEL) == built for m in linears)
    calls = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops():
        model.generate([[5, 17, 99, 230]], max_new_tokens=3, min_new_tokens=3, do_sample=False)
    # two decode steps of 2 layers: the fused q/k/v, o_proj, the fused gate/up and down_proj, and the LM
    # head; the prefill's LM head too (of its last position only), not its other products. A layer's step
    # is one call of the kernels' layer_step, which makes its four products bf16_mv calls from C++ (the
    # dispatcher sees the layer_step only: tests/test_programs.py checks its bits against the modules')
    layer_steps = sum("layer_step" in c for c in calls)
    assert layer_steps == (2 * 2 if built else 0), calls
    assert sum("bf16_mv" in c for c in calls) + 4 * layer_steps == (2 * (2 * 4 + 1) + 1 if built else 0), (
        calls
    )
