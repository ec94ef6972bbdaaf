"""CPU features are detected in one place (tierlm.cpu), and its answer drives how bf16 runs."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from agreement import assert_greedy_agrees, greedy
from torch.overrides import TorchFunctionMode

import tierlm
from tierlm import cpu
from tierlm.cpu import CpuFeatures
from tierlm.models import layers

AVX2 = CpuFeatures("simulated AMD Zen 3", "AVX2", native_bf16=False)
NATIVE_BF16 = CpuFeatures("simulated AMD Zen 4", "AVX512", native_bf16=True, vnni=True)
AMX = CpuFeatures("simulated Xeon with AMX", "AVX512", native_bf16=True, amx=True, vnni=True)
IDS = torch.tensor([[5, 17, 99, 230, 41, 7, 8, 11, 250, 3]])


class LinearDtypes(TorchFunctionMode):
    """Records the input dtype and row count of every F.linear, and of every torch.mv / torch.addmv (one-row
    products: `vector_calls` counts them)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, int]] = []
        self.vector_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            x = args[0]
            self.calls.append((x.dtype, x.shape[-2] if x.dim() > 2 else 1))
        elif func in (torch.mv, torch.addmv):
            self.calls.append((args[-1].dtype, 1))
            self.vector_calls += 1
        return func(*args, **(kwargs or {}))


def widen_flags(model) -> set[bool]:
    return {m.widen for m in model.decoder.modules() if hasattr(m, "widen")}


def test_detect_asks_torch_and_names_the_cpu():
    found = cpu.detect()
    assert found.capability == torch.backends.cpu.get_cpu_capability()
    if platform.machine() == "x86_64":
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        assert found.native_bf16 == (native and found.capability == "AVX512")
    assert found.capability in found.describe() and found.name in found.describe()
    assert found.as_dict()["native_bf16"] == found.native_bf16


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 features")
def test_an_avx2_dispatch_level_hides_the_cpus_avx512_features(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 on an AVX-512 BF16 CPU: torch's kernels run at AVX2, so detect() reports no
    native bf16, AMX or VNNI, and the defaults are an AVX2 CPU's (how the benchmarks simulate a Zen 3)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    for feature in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_vnni_supported"):
        monkeypatch.setattr(torch.cpu, feature, lambda: True)
    found = cpu.detect.__wrapped__()
    assert (found.capability, found.native_bf16, found.amx, found.vnni) == ("AVX2", False, False, False)
    assert found.kernels() == AVX2.kernels() and found.widens_bf16_prefill
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    found = cpu.detect.__wrapped__()
    assert (found.native_bf16, found.amx, found.vnni) == (True, True, True)


@pytest.mark.parametrize(
    "features, widened, mv",
    [(AVX2, True, True), (NATIVE_BF16, False, False), (AMX, False, True)],
    ids=["avx2", "native-bf16", "amx"],
)
def test_detected_cpu_drives_the_default_dtype_and_prefill_kernel(monkeypatch, features, widened, mv):
    """The auto dtype of a GGUF is bf16 on every kind of CPU; bf16 prefill is widened to fp32 only
    where bf16 is not native, and one-row decode products run on tierlm's one-row bf16 kernel where it is
    faster (AVX2; native bf16 without AMX: a Zen 4; where it is built), else as torch.mv where that is faster
    (AMX), else as F.linear (linear.linear). (Float weights: `quantize=None`; the default packing is the next test's.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tierlm import kernels

    class KernelCalls(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            KernelCalls.calls += "bf16_mv" in str(func)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(cpu, "detect", lambda: features)
    model = tierlm.load(quantize=None)  # the default model, dtype "auto"
    assert model.dtype == torch.bfloat16
    assert widen_flags(model) == {widened}
    with LinearDtypes() as seen, KernelCalls():
        model.generate("The capital of France is", max_new_tokens=2, min_new_tokens=2)
    kernel = features.vector_kernel and kernels.bf16_vector_product() is not None
    assert features.vector_kernel == (features is not AMX)
    prefill = {dtype for dtype, rows in seen.calls if rows > 1}
    decode = {dtype for dtype, rows in seen.calls if rows == 1}
    assert prefill == {torch.float32 if widened else torch.bfloat16}
    assert decode == (set() if kernel else {torch.bfloat16})
    assert (KernelCalls.calls > 0) == kernel  # the decode step's products, LM head included
    assert features.eager_mv == mv
    assert (seen.vector_calls > 0) == (mv and not kernel)


ARM = CpuFeatures("simulated Arm Neoverse", "SVE256", native_bf16=True)


@pytest.mark.parametrize(
    "features, packed", [(AVX2, True), (NATIVE_BF16, True), (ARM, False)], ids=["avx2", "native-bf16", "arm"]
)
def test_detected_cpu_drives_whether_gguf_q4_blocks_stay_packed(
    monkeypatch, default_model_path, features, packed
):
    """quantize="auto" (the default): the default GGUF's Q4_1 projections stay packed as int4 in the file's own
    groups of 32 on the CPUs where that was measured faster (AVX2, AVX512), not elsewhere; an explicit float
    dtype, quantize=None, or a forward off the CPU keeps float weights; an explicit mode is kept as asked."""
    from tierlm.plan import Quantization, _runs_on_cpu, plan

    monkeypatch.setattr(cpu, "detect", lambda: features)
    assert features.keeps_q4_packed == packed
    assert ("stay packed" in features.kernels()) == packed
    assert plan(default_model_path).quantization == (Quantization("int4", 32) if packed else None)
    assert plan(default_model_path, dtype="bfloat16").quantization is None
    assert plan(default_model_path, quantize=None).quantization is None
    assert plan(default_model_path, quantize="int8").quantization == Quantization("int8", 32)
    cpu_map = {"": "cpu", "model.layers.3": "disk"}
    assert _runs_on_cpu(torch.device("cpu"), cpu_map, None, None)
    assert _runs_on_cpu(torch.device("cpu"), {"": 0}, None, "cpu")
    assert not _runs_on_cpu(torch.device("cpu"), {"": 0, "lm_head": "cpu"}, None, None)
    assert not _runs_on_cpu(torch.device("cpu"), "auto", {0: "1GiB", "cpu": "2GiB"}, None)
    assert not _runs_on_cpu(torch.device("cuda"), None, None, None)
    if packed:  # what load() then runs: int4 projections, an int8 head, nothing float but the embedding
        from tierlm.quant import Int4Linear, Int8Linear

        model = tierlm.load()
        kinds = {type(m) for n, m in model.decoder.named_modules() if n.endswith("proj")}
        assert kinds == {Int4Linear} and isinstance(model.decoder.lm_head, Int8Linear)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_one_row_bf16_products_run_as_mv_where_flagged(bias):
    """linear.linear: a one-row bf16 product is torch.mv (torch.addmv with a bias) in an eager step where the
    module's `vector` flags say so, F.linear otherwise and for several rows or fp32; either way within one bf16
    rounding of the fp32 product."""
    from tierlm.models.linear import VECTOR_COMPILED, VECTOR_EAGER, linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(1, 1, 64, generator=g).bfloat16()
    with LinearDtypes() as seen:
        y = linear(x, w, b, False, VECTOR_EAGER)
        linear(x.expand(1, 3, 64).contiguous(), w, b, False, VECTOR_EAGER)
        linear(x.float(), w.float(), None if b is None else b.float(), False, VECTOR_EAGER)
    assert seen.vector_calls == 1
    with LinearDtypes() as seen:
        z = linear(x, w, b, False, VECTOR_COMPILED)  # eager here: the compiled flag alone is F.linear
    assert seen.vector_calls == 0 and len(seen.calls) == 1
    reference = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.shape == z.shape == (1, 1, 96) and y.dtype == z.dtype == torch.bfloat16
    for out in (y, z):
        torch.testing.assert_close(
            out.float(), reference, rtol=2**-8, atol=2**-8 * reference.abs().max().item()
        )


@pytest.fixture
def body_options(monkeypatch) -> list[dict]:
    """The torch.compile keyword arguments of each layer body built (steps.LayerBody) while a test runs."""
    from tierlm import steps

    seen: list[dict] = []

    class Recorded(steps.LayerBody):
        def __init__(self, compile_kwargs):
            seen.append(compile_kwargs)
            super().__init__(compile_kwargs)

    monkeypatch.setattr(steps, "LayerBody", Recorded)
    return seen


@pytest.mark.parametrize(
    "features, compiled_mv, wide",
    [(AVX2, True, True), (NATIVE_BF16, True, True), (AMX, True, True), (ARM, False, False)],
    ids=["avx2", "native-bf16", "amx", "arm"],
)
def test_layer_scope_bodies_write_one_row_products_as_mv_where_chosen(
    monkeypatch, tiny_checkpoints, body_options, features, compiled_mv, wide
):
    """A layer-scope step's body uses torch.mv for one-row bf16 products where tierlm.cpu chose it (inductor
    makes it a fused reduction, with a lower realize threshold so the norm before it is computed once), a
    whole step never does; its attention runs in fp32 where tierlm.cpu chose that (no native bf16, or AVX512);
    the compiled greedy logits stay within bf16's tolerance of the eager ones (two kernels: not exact)."""
    from tierlm import steps
    from tierlm.compile import CompileConfig
    from tierlm.models.linear import VECTOR_COMPILED

    monkeypatch.setattr(cpu, "detect", lambda: features)
    assert features.compiled_layer_mv == compiled_mv
    assert features.compiled_wide_attention == wide
    model = tierlm.load(tiny_checkpoints["llama"], dtype="bfloat16")
    ids = torch.tensor([[5, 17, 99, 23, 41, 7]])
    eager = model.generate(ids, max_new_tokens=2, min_new_tokens=2, logprobs=5)
    layered = model.generate(
        ids, max_new_tokens=2, min_new_tokens=2, logprobs=5, compile_config=CompileConfig(scope="layer")
    )
    assert layered.stats.compile.compile
    flags = {bool(m.vector & VECTOR_COMPILED) for m in model.decoder.modules() if hasattr(m, "vector")}
    assert flags == {compiled_mv}
    assert {m.widen_compiled for m in model.decoder.modules() if hasattr(m, "widen_compiled")} == {wide}
    threshold = [kw["options"].get("realize_opcount_threshold") for kw in body_options]
    assert threshold == [steps.LAYER_REALIZE_OPCOUNT if compiled_mv else None]
    # token 0 comes from the (eager) prefill in both; token 1 from the first decode step, compiled in one.
    # Its top log probabilities agree within 0.15: bf16 keeps 8 significant bits, so this model's hidden
    # states and logits (up to ~8) round in steps of up to 2^-5, and the two kernels round in other places
    # (measured: up to 0.063 apart; a wrong product is off by whole units).
    assert layered.token_ids[0][0] == eager.token_ids[0][0]
    want, got = dict(eager.logprobs[0][1].top), dict(layered.logprobs[0][1].top)
    for token in set(want) & set(got):
        assert abs(want[token] - got[token]) <= 0.15, (token, want[token], got[token])
    assert len(set(want) & set(got)) >= 3


def test_a_callers_inductor_options_win_over_the_layer_bodys_realize_threshold(
    monkeypatch, tiny_checkpoints, body_options
):
    """The realize threshold is tierlm's default for layer bodies with fused reductions; a CompileConfig's own
    `options` keep their value."""
    from tierlm.compile import CompileConfig

    monkeypatch.setattr(cpu, "detect", lambda: AMX)
    model = tierlm.load(tiny_checkpoints["llama"], dtype="bfloat16")
    cc = CompileConfig(scope="layer", options={"realize_opcount_threshold": 30})
    r = model.generate(torch.tensor([[5, 17, 99]]), max_new_tokens=2, min_new_tokens=2, compile_config=cc)
    assert r.stats.compile.compile
    assert [kw["options"]["realize_opcount_threshold"] for kw in body_options] == [30]


def test_fp32_models_never_widen(monkeypatch, tiny_checkpoints):
    monkeypatch.setattr(cpu, "detect", lambda: AVX2)
    assert widen_flags(tierlm.load(tiny_checkpoints["llama"], dtype="float32")) == {False}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_widened_prefill_agrees_with_bf16_prefill(tiny_checkpoints, family):
    model = tierlm.load(tiny_checkpoints[family], dtype="bfloat16")
    logits = {}
    for on in (False, True):
        model.decoder.widen_prefill(on)
        logits[on] = model(IDS).float()
    tolerance = 2**-5 * logits[False].abs().max().item()  # 8 bf16 ulps, as in tests/agreement.py
    torch.testing.assert_close(logits[True], logits[False], atol=tolerance, rtol=0)


def test_widened_decode_agrees_with_bf16_decode_on_the_default_model(default_model_path):
    """Widened, decode steps also attend in fp32 (layers.grouped_attention). On a random tiny model bf16
    attention alone is ~7% of the largest logit off fp32 (either way), beyond any bf16 tolerance; the
    default model is a trained one, where both must agree as every bf16 kernel pair does (tests/agreement.py)."""
    model = tierlm.load(default_model_path, dtype="bfloat16")
    ids = torch.tensor([model.tokenizer.encode("Write a short poem about the sea and the wind.")])
    runs = {}
    for on in (False, True):
        model.decoder.widen_prefill(on)
        runs[on] = greedy(model, ids, max_new_tokens=24, min_new_tokens=24)
    assert_greedy_agrees(runs[False], runs[True], "bfloat16")


@pytest.mark.parametrize("length", [1, 37, 300])
def test_widened_decode_attention_rounds_once(length):
    """grouped_attention(wide=True) multiplies the bf16 q, K, V in fp32 and rounds the output once: within
    one bf16 rounding (2^-8 relative) of an fp64 reference on the same inputs, and never farther from it than
    the bf16 matmuls, which round the scores and the probabilities too."""
    from tierlm.models.layers import grouped_attention

    g = torch.Generator().manual_seed(length)
    q = torch.randn(2, 9, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 3, length, 64, generator=g).bfloat16() for _ in range(2))
    mask = torch.rand(2, 1, 1, length, generator=g) < 0.8
    mask[..., -1] = True
    reference = grouped_attention(q.double(), k.double(), v.double(), mask)
    wide = grouped_attention(q, k, v, mask, wide=True)
    narrow = grouped_attention(q, k, v, mask)
    assert wide.dtype == torch.bfloat16
    torch.testing.assert_close(wide.double(), reference, rtol=2**-8, atol=1e-6)
    assert (wide.double() - reference).abs().max() <= (narrow.double() - reference).abs().max()


def test_a_decode_step_of_many_rows_widens_small_weights_only():
    """An eager decode step of WIDE_ROWS rows or more is a matrix-matrix product, widened like prefill where
    bf16 is not native; not fewer rows (a memory-bound matrix-vector product), not a weight whose fp32 copy
    would leave the cache (a real vocabulary's LM head), not without `widen`; the result agrees with bf16."""
    from tierlm.models.linear import WIDE_FP32_BYTES, WIDE_ROWS, linear

    small = torch.randn(96, 64).to(torch.bfloat16)
    big = torch.zeros(WIDE_FP32_BYTES // 4 // 64 + 1, 64, dtype=torch.bfloat16)
    rows = torch.randn(WIDE_ROWS, 1, 64).to(torch.bfloat16)
    with LinearDtypes() as seen:
        widened = linear(rows, small, None, True)
        linear(rows[: WIDE_ROWS - 1], small, None, True)
        linear(rows, big, None, True)
        plain = linear(rows, small, None, False)
    assert [dtype for dtype, _ in seen.calls] == [torch.float32] + [torch.bfloat16] * 3
    assert widened.dtype == torch.bfloat16
    torch.testing.assert_close(widened.float(), plain.float(), atol=2**-5 * plain.abs().max().item(), rtol=0)


@pytest.mark.parametrize(
    "scope, mode, widened",
    [("layer", None, True), ("model", None, False), ("model", "default", True)],
    ids=["layer", "model-max-autotune", "model-default"],
)
def test_compiled_attention_widens_where_the_matmuls_stay_atens(
    monkeypatch, tiny_checkpoints, scope, mode, widened
):
    """Without native bf16 and without tierlm's attention kernel (Arm, TIERLM_CPU_KERNELS=aten, a failed build),
    a compiled decode step attends in fp32 when its mode leaves the matmuls to aten
    (slow in bf16 there), and in bf16 under max-autotune, whose C++ GEMM templates are faster on bf16 itself:
    the dtypes of the attention matmuls in the graph the compiler receives (a whole step's are in the nested
    region its layers share: layers.decode_attention_region)."""
    from tierlm import CompileConfig

    monkeypatch.setattr(cpu, "detect", lambda: AVX2)
    monkeypatch.setattr(layers, "attention_kernel", lambda: False)  # where tierlm's kernel is not built
    model = tierlm.load(tiny_checkpoints["llama"], dtype="bfloat16")
    dtypes = set()

    def recorder(gm, example_inputs):
        for graph in (m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)):
            for node in graph.nodes:
                if node.target is torch.matmul:
                    dtypes.update(arg.meta["example_value"].dtype for arg in node.args)
        return gm.forward

    cc = CompileConfig(backend=recorder, scope=scope, mode=mode)
    model.generate([[5, 17, 99]], max_new_tokens=3, min_new_tokens=3, compile_config=cc)
    assert dtypes == {torch.float32 if widened else torch.bfloat16}
