"""A GGUF's 4-bit blocks (Q4_0, Q4_1, Q4_K) run as int4 with the file's own codes, read from the file: no
dequantized copy on disk, never requantized; its other quantized projections int8 beside them."""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from test_gguf_llama import random_blocks, to_gguf

import tierlm
from tierlm.plan import describe_plan
from tierlm.quant import Int4Linear, Int8Linear
from tierlm.weights import gguf_blocks, gguf_cache
from tierlm.weights.gguf import GGUFCheckpoint

KINDS = ("Q4_0", "Q4_1", "Q4_K")


def reconstructed(codes, scales, zeros) -> torch.Tensor:
    """w = (q - 8) * scale + zero per group of 32, in fp32 (tierlm.quant's int4 convention)."""
    n, k = codes.shape
    q = codes.float().reshape(n, k // 32, 32) - 8
    return (q * scales[..., None] + zeros[..., None]).reshape(n, k)


@pytest.mark.parametrize("kind", KINDS)
def test_4bit_blocks_are_their_codes_within_one_fp32_rounding_of_gguf_py(kind):
    """Random block bytes (valid fp16 scales; every code, 6-bit scale and min pattern) read as codes, scales
    and zeros give gguf-py's reference dequantization: Q4_0 bit for bit (d * (q - 8) both ways); Q4_1 and
    Q4_K up to the one rounding of the zero (m + 8 d, 8 d sc - dmin mn) that the int4 form adds, so within
    2^-23 of |zero| + |w| (the scales are exact: an fp16 times a 6-bit integer)."""
    block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = random_blocks((96, 512), kind, seed=7)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind])).reshape(96, 512)
    codes, scales, zeros = gguf_blocks.int4_parts(raw, kind)
    assert codes.dtype == torch.uint8 and int(codes.max()) == 15 and int(codes.min()) == 0
    got = reconstructed(codes, scales, zeros)
    assert want.std() > 0.01
    if kind == "Q4_0":
        assert torch.equal(got, want)
        return
    bound = 2.0**-23 * (zeros.abs().repeat_interleave(32, dim=1) + want.abs()) + 1e-30
    assert ((got - want).abs() <= bound).all()
    assert (got != want).float().mean() < 0.5  # mostly bit-equal: the bound is not what makes it pass


def test_rows_read_in_another_order_are_those_rows():
    """row_order (llama.cpp's q/k permutation undone) picks the stored rows; chunks of ROWS rows join up."""
    raw = random_blocks((gguf_blocks.ROWS + 64, 64), "Q4_1", seed=3)
    order = torch.randperm(raw.shape[0], generator=torch.Generator().manual_seed(0))
    whole = gguf_blocks.int4_parts(raw, "Q4_1")
    picked = gguf_blocks.int4_parts(raw, "Q4_1", order)
    for a, b in zip(whole, picked, strict=True):
        assert torch.equal(a[order], b)
    with pytest.raises(ValueError, match="Q6_K blocks are not 4-bit codes"):
        gguf_blocks.int4_parts(raw, "Q6_K")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", [32, 64])
def test_codes_packed_from_the_blocks_bytes_are_torchs_packing_of_the_codes(kind, block):
    """int4_parts(block=...) packs the codes straight from the blocks' bytes (both rows' nibbles of a byte
    run at once, no unpacked copy): the same bytes as torch's CPU packing of the unpacked codes where this
    torch packs in blocks of `block` rows (else as the tensor-op packing that equals it on the other x86
    family), in stored and in a permuted row order, over more than ROWS rows; the scales are unchanged."""
    from tierlm.quant import _cpu_pack_block, _pack_blocks, _pack_int4

    raw = random_blocks((gguf_blocks.ROWS + 128, 512), kind, seed=5)
    order = torch.randperm(raw.shape[0], generator=torch.Generator().manual_seed(1))
    for row_order in (None, order):
        codes, scales, zeros = gguf_blocks.int4_parts(raw, kind, row_order)
        packed, p_scales, p_zeros = gguf_blocks.int4_parts(raw, kind, row_order, block=block)
        want = _pack_int4(codes.to(torch.int32)) if _cpu_pack_block() == block else _pack_blocks(codes, block)
        assert packed.shape == (raw.shape[0], 256) and torch.equal(packed, want)
        assert torch.equal(p_scales, scales) and torch.equal(p_zeros, zeros)
    with pytest.raises(ValueError, match="do not pack in blocks of 64"):
        gguf_blocks.int4_parts(raw[:96], kind, block=64)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """The tiny Llama with rows of 256 (K-quants' super-block): hidden 256, FFN 256, 4 heads of 64."""
    from conftest import write_tiny_checkpoint

    folder = tmp_path_factory.mktemp("wide") / "llama"
    return write_tiny_checkpoint(folder, "llama", {"hidden_size": 256, "intermediate_size": 256})


def gguf_of(kind: str, wide_llama, tiny_checkpoints, path, kinds=None):
    folder = wide_llama if kind in ("Q4_K", "Q6_K") or kinds else tiny_checkpoints["llama"]
    if kind in ("Q4_K", "Q6_K", "Q4_1") or kinds:
        return to_gguf(folder, path, projections=kind, kinds=kinds)
    return to_gguf(folder, path, projections=kind)  # Q4_0: gguf-py's reference quantizer of the weights


def bound_of(parts) -> torch.Tensor:
    """How far a weight may move when its group's scale and zero are rounded to bf16 (half a bf16 step,
    2^-9 relative, of each of 8 * scale and zero; 2^-8 to cover both and the rounding of the product)."""
    _, scales, zeros = parts
    return (2.0**-8 * (8 * scales.abs() + zeros.abs())).repeat_interleave(32, dim=1) + 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_a_4bit_gguf_runs_its_own_codes_with_no_dequantized_copy(
    kind, wide_llama, tiny_checkpoints, tmp_path
):
    """Default and explicit int4 load every projection as Int4Linear whose weights are the file's (its codes;
    only the scales and zeros rounded to bf16), in Hugging Face row order (q/k un-permuted); nothing is written
    to the GGUF cache but the tokenizer (no weights-*.safetensors, no file larger than the source); the logits
    are closer to the fp32 weights of the file than int8 per row of the same weights."""
    from tierlm import cpu

    gguf = gguf_of(kind, wide_llama, tiny_checkpoints, tmp_path / f"{kind}.gguf")
    model = tierlm.load(gguf, quantize="int4")
    assert model.plan.quantization[:2] == ("int4", 32)
    if cpu.detect().keeps_q4_packed:
        assert tierlm.load(gguf).plan.quantization == model.plan.quantization
    exact = tierlm.load(gguf, dtype="float32", quantize=None)  # dequantized by gguf-py (the cache)
    reader = GGUFCheckpoint(gguf)
    names = [n for n, m in model.decoder.named_modules() if n.endswith("_proj")]
    assert len(names) == 14
    for name in names:
        module = model.decoder.get_submodule(name)
        assert isinstance(module, Int4Linear), name
        parts = reader.int4_parts(f"{name}.weight")
        want = exact.decoder.get_submodule(name).weight
        assert torch.equal(reconstructed(*parts), want) or kind != "Q4_0"
        assert ((module.dequantize() - want).abs() <= bound_of(parts)).all(), name
    folder = gguf_cache.cache_dir(gguf)
    source = gguf.stat().st_size
    cached = [p for p in folder.iterdir() if p.name.startswith("weights-")]
    assert cached == [folder / "weights-float32.safetensors"]  # the fp32 load's, not the int4 ones'
    ids = torch.randint(3, 320, (1, 24), generator=torch.Generator().manual_seed(6))
    truth = exact(ids).float()
    int8 = tierlm.load(gguf, quantize="int8")
    err4 = (model(ids).float() - truth).abs().mean().item()
    err8 = (int8(ids).float() - truth).abs().mean().item()
    assert err4 < err8, (err4, err8)
    (folder / "weights-float32.safetensors").unlink()
    tierlm.load(gguf, quantize="auto" if cpu.detect().keeps_q4_packed else "int4")  # writes no weights
    assert all(p.stat().st_size < source for p in folder.iterdir())
    assert not [p for p in folder.iterdir() if p.name.startswith("weights-")]


def test_a_mix_of_4bit_and_other_blocks_is_int4_and_int8_the_same_on_every_tier(
    wide_llama, tiny_checkpoints, tmp_path, monkeypatch
):
    """As in llama.cpp's Q4_K_M (Q4_K, with Q6_K for some down projections): by default the Q4_K projections
    are int4 with their codes and the Q6_K ones int8 per row (where this CPU's kernels run int8), in the
    plan and in the model; offloaded to the cpu and disk tiers the same weights stream and give the same
    greedy tokens and logits as resident."""
    from tierlm import cpu

    monkeypatch.setattr(cpu, "detect", lambda: cpu.CpuFeatures("simulated AMD Zen 3", "AVX2", False))
    gguf = gguf_of(
        "Q4_K", wide_llama, tiny_checkpoints, tmp_path / "q4_k_m.gguf", kinds={"mlp.down_proj": "Q6_K"}
    )
    assert {t.tensor_type.name for t in GGUFReader(gguf).tensors if "ffn_down" in t.name} == {"Q6_K"}
    resident = tierlm.load(gguf)
    q = resident.plan.quantization
    assert q.mode == "int4" and q.group == 32
    assert q.int8 == ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj")
    for name, module in resident.decoder.named_modules():
        if name.endswith("_proj"):
            assert isinstance(module, Int8Linear if name.endswith("down_proj") else Int4Linear), name
    assert "its 2 other projections int8" in describe_plan(gguf)
    prompt = [[1, 5, 9, 33, 71]]
    want = resident.generate(prompt, max_new_tokens=12).token_ids
    offloaded = tierlm.load(
        gguf,
        device_map={"": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"},
        execution_device="cpu",
        offload_folder=tmp_path / "off",
    )
    assert offloaded.plan.placement.offloaded["disk"] == ["model.layers.1"]
    assert offloaded.generate(prompt, max_new_tokens=12).token_ids == want
    ids = torch.randint(3, 320, (1, 24), generator=torch.Generator().manual_seed(2))
    logits = resident(ids)
    assert torch.equal(offloaded(ids), logits)
    assert logits.std() > 0.1  # not all alike: the comparison has something to compare


def test_the_first_load_of_a_4bit_gguf_holds_one_tensor_of_float_at_a_time(
    wide_llama, tiny_checkpoints, tmp_path
):
    """The build step leaves the projections unread and the quantize step reads them one at a time (never a
    float copy of the model): a float Linear never holds a projection's weight, whatever the step."""
    from tierlm import loading

    gguf = gguf_of("Q4_K", wide_llama, tiny_checkpoints, tmp_path / "q.gguf")
    seen = []
    build = loading.STEPS["build"]

    def spy(plan, state):
        build(plan, state)
        for name, module in state.decoder.named_modules():
            if name.endswith("_proj"):
                seen.append(module.weight.device.type)

    with pytest.MonkeyPatch.context() as m:
        m.setitem(loading.STEPS, "build", spy)
        tierlm.load(gguf, quantize="int4")
    assert seen and set(seen) == {"meta"}
