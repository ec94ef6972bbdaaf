"""Weight-only int8 / int4 linears: kernel use, quantization error, decoder replacement, compilability."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import write_tiny_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tierlm
from tierlm.models.linear import Linear
from tierlm.quant import (
    PROJECTIONS,
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    quantize_decoder,
    quantize_int4,
    quantize_int8,
)

# Rounding error of a uniform quantizer is step/sqrt(12). int8 per row: step = max|w|/127, and the max of
# 512 standard normals is ~3.1, so ~0.7% of the weight norm. uint4 per group: step = (max - min)/15 with
# max - min ~3.9 / 4.8 / 5.5 for groups of 32 / 64 / 128 normals, so ~7.5% / 9.2% / 10.6%. The output
# error of x @ W.T with random x is the same fraction; the bounds below leave ~15% headroom.
INT8_REL_ERROR = 0.01
INT4_REL_ERROR = {32: 0.09, 64: 0.105, 128: 0.12}


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def random_linear(in_features: int, out_features: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_()
        if bias:
            linear.bias.normal_()
    return linear


def random_input(in_features: int, dtype: torch.dtype, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)


def assert_matches_reference(y: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 kernels match to accumulation order; bf16 ones to the rounding of their bf16 output."""
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    else:
        assert rel_error(y, ref) < 2**-8  # bf16 keeps 8 significant bits: rounding costs ~0.2%


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_matches_dequantized_reference(dtype):
    linear = random_linear(512, 256, bias=True)
    q = Int8Linear.from_linear(linear, dtype)
    x = random_input(512, dtype).reshape(1, 5, 512)  # leading dims are kept
    y = q(x)
    assert y.shape == (1, 5, 256) and y.dtype == dtype
    ref = x.float() @ q.dequantize().T + q.bias.float()
    assert_matches_reference(y, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_matches_dequantized_reference(dtype, group_size):
    linear = random_linear(512, 256, bias=True)
    q = Int4Linear.from_linear(linear, group_size, dtype)
    codes, scales_and_zeros = quantize_int4(linear.weight, group_size, dtype)
    assert scales_and_zeros.shape == (512 // group_size, 256, 2)
    reference_weight = dequantize_int4(codes, scales_and_zeros, group_size)  # plain torch, no kernel
    torch.testing.assert_close(q.dequantize(), reference_weight, rtol=1e-6, atol=1e-6)
    x = random_input(512, dtype)
    assert_matches_reference(q(x), x.float() @ reference_weight.T + q.bias.float())


@pytest.mark.parametrize("kernels", ["aten", "avx2"])
def test_bf16_activations_go_through_the_selected_kernels(kernels, monkeypatch):
    """aten's kernels, or tierlm's where the CPU selects them (tests/test_kernels.py checks their math; int4
    where tierlm's kernel reads torch's packing); the fp32-activation fallback below holds either way."""
    from tierlm import cpu
    from tierlm import kernels as tierlm_kernels

    aten4 = "_weight_int4pack_mm_for_cpu.default"
    if kernels == "aten":
        monkeypatch.setenv("TIERLM_CPU_KERNELS", "aten")
        ops = {rows: ("_weight_int8pack_mm.default", aten4) for rows in (1, 5)}
    else:
        monkeypatch.delenv("TIERLM_CPU_KERNELS", raising=False)
        monkeypatch.setattr(cpu, "detect", lambda: cpu.CpuFeatures("simulated", "AVX2", False))
        if tierlm_kernels.loaded() is None:
            pytest.skip("tierlm's kernels do not build or load here")
        block = tierlm_kernels.int4_block()
        int4 = aten4 if block is None else "int4_mm.default"
        ops = {rows: ("int8_mm.default", int4) for rows in (1, 5)}
    linear = random_linear(128, 64)
    for rows, (int8, int4) in ops.items():
        x = random_input(128, torch.bfloat16, rows)
        for module, op in [(Int8Linear.from_linear(linear), int8), (Int4Linear.from_linear(linear), int4)]:
            with OpRecorder() as rec:
                module(x)
            assert op in rec.ops, (rows, rec.ops)


def test_int8_error_against_float_linear_is_small():
    linear = random_linear(512, 256)
    x = random_input(512, torch.bfloat16)
    err = rel_error(Int8Linear.from_linear(linear)(x), F.linear(x.float(), linear.weight))
    assert err < INT8_REL_ERROR


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_against_float_linear_is_bounded(group_size):
    linear = random_linear(512, 256)
    x = random_input(512, torch.bfloat16)
    err = rel_error(Int4Linear.from_linear(linear, group_size)(x), F.linear(x.float(), linear.weight))
    assert err < INT4_REL_ERROR[group_size]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantizing_in_row_chunks_gives_the_one_shot_result(monkeypatch, dtype):
    """quantize_int8/int4 work QUANTIZE_ROWS rows at a time (so a 262k-row LM head does not peak at 4x its
    size in fp32 temporaries); the chunks, including a ragged last one, give exactly the one-shot codes and
    scales of the per-row / per-group formulas."""
    from tierlm import quant

    torch.manual_seed(0)
    w = (torch.randn(70, 128) * torch.rand(70, 1) * 3).to(dtype)
    one_shot8, one_shot4 = quantize_int8(w, dtype), quantize_int4(w, 32, dtype)
    monkeypatch.setattr(quant, "QUANTIZE_ROWS", 16)  # 4 full chunks and one of 6 rows
    chunked8, chunked4 = quantize_int8(w, dtype), quantize_int4(w, 32, dtype)
    for a, b in zip(one_shot8 + one_shot4, chunked8 + chunked4, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # and the one-shot result is the formula's, on the whole matrix at once
    wf = w.float()
    scales = (wf.abs().amax(1) / 127).to(dtype)
    assert torch.equal(one_shot8[1], scales)
    assert torch.equal(
        one_shot8[0], torch.round(wf / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
    )
    groups = wf.reshape(70, 4, 32)
    s4 = ((groups.amax(-1) - groups.amin(-1)) / 15).to(dtype)
    z4 = (groups.amin(-1) + 8 * s4.float()).to(dtype)
    assert torch.equal(one_shot4[1], torch.stack([s4, z4], dim=-1).transpose(0, 1))
    q4 = torch.round((groups - z4.float()[..., None]) / s4.float()[..., None]) + 8
    assert torch.equal(one_shot4[0], q4.clamp(0, 15).to(torch.int32).reshape(70, 128))


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_many_int4_rows_on_amx_multiply_the_dequantized_bf16_weight(monkeypatch, amx):
    """From DEQUANTIZE_ROWS rows on a CPU with AMX, an int4 product unpacks W.T to bf16 and multiplies there
    (prefill on AMX tiles); fewer rows, or no AMX, take an int4 kernel. The unpacked weight is the kernel's
    within two bf16 roundings of values up to 2x the largest weight (zero - 8 * scale, then the fused
    multiply-add): 2^-6 of max |w|; the product within bf16's rounding of weight and output."""
    from tierlm import cpu
    from tierlm.quant import DEQUANTIZE_ROWS, unpacks_cpu_int4

    monkeypatch.setattr(cpu, "detect", lambda: cpu.CpuFeatures("simulated", "AVX512", True, amx=amx))
    linear = random_linear(512, 256, bias=True)
    q = Int4Linear.from_linear(linear, 32)
    # the unpacking knows torch's AVX-512 packing; where torch dispatches to another kernel (AVX2: checked
    # with ATEN_CPU_CAPABILITY=avx2) its layout differs and the path is never taken
    known = unpacks_cpu_int4()
    assert known == (torch.backends.cpu.get_cpu_capability() == "AVX512")
    assert q.dequantizes == (amx and known)
    reference = q.dequantize()
    if known:
        unpacked = q.dequantized_t().float().T
        torch.testing.assert_close(unpacked, reference, rtol=0, atol=2**-6 * reference.abs().max().item())
    for rows in (DEQUANTIZE_ROWS - 1, DEQUANTIZE_ROWS):
        x = random_input(512, torch.bfloat16, rows)
        with OpRecorder() as rec:
            y = q(x)
        kernel = not q.dequantizes or rows < DEQUANTIZE_ROWS
        # aten's int4 kernel, or tierlm's where it reads torch's int4 packing (AVX2 and AVX-512)
        assert bool({"_weight_int4pack_mm_for_cpu.default", "int4_mm.default"} & rec.ops) == kernel
        assert rel_error(y, x.float() @ reference.T + q.bias.float()) < 2**-7


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_many_int8_rows_on_amx_multiply_the_widened_bf16_codes(monkeypatch, amx):
    """From DEQUANTIZE_ROWS bf16 rows on a CPU with AMX, an int8 product multiplies the codes widened to bf16
    (exact: int8 fits bf16's 8 significant bits) and then the row scales; fewer rows, fp32 rows, or no AMX,
    take the int8 kernel (tierlm's or aten's). The product stays within bf16's rounding of output and scale."""
    from tierlm import cpu
    from tierlm.quant import DEQUANTIZE_ROWS

    monkeypatch.setattr(cpu, "detect", lambda: cpu.CpuFeatures("simulated", "AVX512", True, amx=amx))
    linear = random_linear(512, 256, bias=True)
    q = Int8Linear.from_linear(linear)
    assert q.widens == amx
    reference = q.dequantize()
    kernel_ops = {"_weight_int8pack_mm.default", "int8_mm.default"}
    for rows, dtype in (
        (DEQUANTIZE_ROWS - 1, torch.bfloat16),
        (DEQUANTIZE_ROWS, torch.bfloat16),
        (DEQUANTIZE_ROWS, torch.float32),
    ):
        x = random_input(512, dtype, rows)
        with OpRecorder() as rec:
            y = q(x)
        widened = amx and rows >= DEQUANTIZE_ROWS and dtype == torch.bfloat16
        assert bool(kernel_ops & set(rec.ops)) != widened, rec.ops
        assert rel_error(y, x.float() @ reference.T + q.bias.float()) < 2**-7


def test_mismatched_input_dtype_falls_back_exactly():
    linear = random_linear(128, 64)
    x = random_input(128, torch.float32)
    for module in (Int8Linear.from_linear(linear), Int4Linear.from_linear(linear)):  # bf16 scales
        y = module(x)
        assert y.dtype == torch.float32
        assert rel_error(y, x @ module.dequantize().T) < 2**-7  # int4 rounds x to bf16 first


def test_int4_rejects_shapes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match=r"\[out=64, in=96\].*multiple of 64"):
        Int4Linear.from_linear(random_linear(96, 64), group_size=64)
    with pytest.raises(ValueError, match=r"\[out=40, in=128\].*multiple of 16"):
        Int4Linear.from_linear(random_linear(128, 40), group_size=64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        Int4Linear.from_linear(random_linear(128, 64), group_size=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny checkpoints at Hugging Face's default weight scale (std 0.02).

    The shared fixtures use std 0.3 for decisive greedy tokens, which makes a 2-layer random network
    chaotic: there even exact float math on the int4-rounded weights moves logits to cosine ~0.7.
    """
    root = tmp_path_factory.mktemp("quant")
    override = {"initializer_range": 0.02}
    return {fam: write_tiny_checkpoint(root / fam, fam, override) for fam in ("llama", "llama_tied", "qwen2")}


def expected_names(decoder) -> list[str]:
    layers = range(decoder.config.num_layers)
    return [f"model.layers.{i}.{p}" for i in layers for p in PROJECTIONS] + ["lm_head"]


@pytest.mark.parametrize("mode, cls", [("int8", Int8Linear), ("int4", Int4Linear)])
def test_quantize_decoder_replaces_every_projection_and_lm_head(tiny, mode, cls):
    decoder = tierlm.load(tiny["qwen2"], dtype="bfloat16").decoder
    names = quantize_decoder(decoder, mode)
    assert sorted(names) == sorted(expected_names(decoder))
    assert all(isinstance(decoder.get_submodule(n), cls) for n in names if n != "lm_head")
    assert isinstance(decoder.lm_head, Int8Linear)  # int4 keeps the LM head at int8 (quant.mode_of)
    assert not any(isinstance(m, nn.Linear) for m in decoder.modules())
    weight = "weight_int8" if mode == "int8" else "weight_int4"
    state = decoder.state_dict()
    assert f"model.layers.1.self_attn.q_proj.{weight}" in state
    assert "model.layers.1.self_attn.q_proj.bias" in state  # Qwen2 keeps its q/k/v biases
    assert state["lm_head.scales"].dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_modules_are_the_ones_that_run(tiny, mode):
    model = tierlm.load(tiny["llama"], dtype="bfloat16")  # the loader fuses q/k/v and gate/up
    names = quantize_decoder(model.decoder, mode)
    ran = set()
    for name in names:
        model.decoder.get_submodule(name).register_forward_hook(lambda *_, name=name: ran.add(name))
    model(torch.tensor([[5, 6, 7]]))
    assert ran == set(names)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_fused_quantized_projections_give_each_projections_output(tiny, family, mode):
    """The loader fuses q/k/v and gate/up after quantizing (one kernel call per group, parts left with views
    of their rows). Every output row must be its projection's own: the same kernel reduces each row alone,
    so the fused product equals the parts' within one bf16 rounding (a wrong row or scale would be off by
    the weights' whole magnitude)."""
    model = tierlm.load(
        tiny[family], dtype="bfloat16", quantize=mode, group_size=32 if mode == "int4" else None
    )
    mlp, attn = model.decoder.model.layers[0].mlp, model.decoder.model.layers[0].self_attn
    assert mlp.fused is not None and type(mlp.fused.packed).__name__ == f"Int{mode[3]}Linear"
    assert (attn.fused is not None) == (mode == "int8")  # int4: k/v have 32 rows, no multiple of 64
    x = torch.randn(3, 5, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    groups = [(mlp, ("gate_proj", "up_proj"))]
    if attn.fused is not None:
        groups.append((attn, ("q_proj", "k_proj", "v_proj")))
    for owner, parts in groups:
        fused = owner.fused(x, False)
        separate = torch.cat([getattr(owner, p)(x) for p in parts], dim=-1)
        torch.testing.assert_close(fused, separate, rtol=2**-8, atol=0)
        assert (
            getattr(getattr(owner, parts[1]), f"weight_{mode}")._base is not None
        )  # a view of the fused rows
    logits = model(torch.tensor([[5, 6, 7, 8]])).float()
    model.decoder.unfuse_projections()
    torch.testing.assert_close(
        logits, model(torch.tensor([[5, 6, 7, 8]])).float(), rtol=0, atol=2**-5 * logits.abs().max().item()
    )


def test_tied_embedding_stays_exact(tiny):
    decoder = tierlm.load(tiny["llama_tied"], dtype="bfloat16").decoder
    embedding = decoder.model.embed_tokens.weight
    assert decoder.lm_head.weight is embedding
    before = embedding.detach().clone()
    assert "lm_head" in quantize_decoder(decoder, "int4")
    assert decoder.model.embed_tokens.weight is embedding
    assert torch.equal(embedding, before)
    assert isinstance(decoder.lm_head, Int8Linear)


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2"])
@pytest.mark.parametrize("mode, min_cosine", [("int8", 0.99), ("int4", 0.95)])
def test_quantized_logits_stay_close_to_bf16(tiny, family, mode, min_cosine):
    model = tierlm.load(tiny[family], dtype="bfloat16")
    ids = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(0))
    reference = model(ids).float()
    quantize_decoder(model.decoder, mode)
    logits = model(ids).float()
    cosine = F.cosine_similarity(logits, reference, dim=-1)  # per position
    assert cosine.min().item() > min_cosine, cosine


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_decoder_equals_float_decoder_with_dequantized_weights(tiny, mode):
    quantized = tierlm.load(tiny["qwen2"], dtype="bfloat16")
    names = quantize_decoder(quantized.decoder, mode)
    reference = tierlm.load(tiny["qwen2"], dtype="float32")
    with torch.no_grad():
        for name in names:
            reference.decoder.get_submodule(name).weight.copy_(
                quantized.decoder.get_submodule(name).dequantize()
            )
    ids = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(0))
    cosine = F.cosine_similarity(quantized(ids).float(), reference(ids), dim=-1)
    assert cosine.min().item() > 0.9999, cosine  # only bf16 activation rounding differs


def test_int4_leaves_layers_it_cannot_take_in_float(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "llama", "llama", {"intermediate_size": 96})
    model = tierlm.load(path, dtype="bfloat16")
    with pytest.warns(
        UserWarning, match=r"left 2 layers unquantized: 2 layers like model.layers.0.mlp.down_proj"
    ):
        names = quantize_decoder(model.decoder, "int4")
    assert sorted(names) == sorted(n for n in expected_names(model.decoder) if not n.endswith("down_proj"))
    assert type(model.decoder.model.layers[1].mlp.down_proj) is Linear  # the float layer, unchanged
    assert torch.isfinite(model(torch.tensor([[5, 6, 7]]))).all()


def test_offloaded_layers_are_refused_before_anything_changes(tiny):
    decoder = tierlm.load(tiny["llama"], dtype="bfloat16").decoder
    decoder.model.layers[1].mlp.down_proj.to("meta")  # as a disk-offloaded layer is held
    with pytest.raises(ValueError, match="offloaded.*model.layers.1.mlp.down_proj"):
        quantize_decoder(decoder, "int8")
    assert not any(isinstance(m, (Int8Linear, Int4Linear)) for m in decoder.modules())


def test_quantize_decoder_rejects_unknown_mode(tiny):
    decoder = tierlm.load(tiny["llama"], dtype="bfloat16").decoder
    with pytest.raises(ValueError, match="one of .*got 'fp8'"):
        quantize_decoder(decoder, "fp8")


@pytest.mark.parametrize("make", [Int8Linear.from_linear, Int4Linear.from_linear])
def test_quantized_linears_trace_as_one_graph(make):
    module = make(random_linear(128, 64, bias=True))
    x = random_input(128, torch.bfloat16).reshape(1, 5, 128)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(module)(x)
    assert explanation.graph_count == 1
    assert explanation.graph_break_count == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_cuda_quantized_linear_matches_its_dequantized_reference(mode):
    """The CUDA paths (tinygemm int4 packing, int8 via a fused cast) against the plain-torch reference."""
    linear = random_linear(512, 256, bias=True).cuda()
    dtype = torch.bfloat16
    q = (
        Int8Linear.from_linear(linear, dtype)
        if mode == "int8"
        else Int4Linear.from_linear(linear, 128, dtype)
    )
    x = random_input(512, dtype).cuda()
    if mode == "int8":
        reference_weight = q.dequantize()
    else:
        codes, scales_and_zeros = quantize_int4(linear.weight, 128, dtype)
        reference_weight = dequantize_int4(codes, scales_and_zeros, 128)
    assert_matches_reference(q(x).cpu(), x.float().cpu() @ reference_weight.cpu().T + q.bias.float().cpu())


@pytest.mark.parametrize("rows", [64, 192, 4160])
def test_codes_packed_by_tensor_ops_equal_torchs_packing(rows):
    """A GGUF's codes are packed by tensor ops in the layout torch's CPU packing writes (blocks of 32 rows on
    AVX2, 64 on AVX-512); the probe finds that block on this torch and the packed bytes equal aten's for row
    counts below, at and past one block and QUANTIZE_ROWS."""
    from tierlm.quant import _cpu_pack_block, _pack_cpu_codes, _pack_int4

    block = {"AVX2": 32, "AVX512": 64}.get(torch.backends.cpu.get_cpu_capability())
    if block is not None:  # another capability packs as it does; aten's packing is the reference below
        assert _cpu_pack_block() == block
    codes = torch.randint(0, 16, (rows, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(_pack_cpu_codes(codes), _pack_int4(codes.to(torch.int32)))
