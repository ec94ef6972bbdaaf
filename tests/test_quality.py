"""Perplexity of the default model on a fixed English text: bf16, int8 and int4 within 1% of fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
from agreement import assert_greedy_agrees, greedy

import tierlm
from tierlm.evaluate import next_token_logits, perplexity, top1_agreement

TEXT = (Path(__file__).parent / "data" / "perplexity.txt").read_text()


@pytest.fixture(scope="module")
def reference():
    model = tierlm.load(dtype="float32")
    ids = model.tokenizer.encode(TEXT)
    assert len(ids) >= 512
    return ids, perplexity(model, ids), next_token_logits(model, ids)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs, bound",
    [
        (dict(dtype="bfloat16"), 0.01),
        (dict(dtype="bfloat16", quantize="int8"), 0.01),
        (dict(dtype="bfloat16", quantize="int4"), 0.01),  # Q4_1 blocks carried over, LM head int8
    ],
    ids=["bf16", "int8", "int4"],
)
def test_perplexity_within_bounds_of_fp32(reference, kwargs, bound):
    ids, ppl32, logits32 = reference
    model = tierlm.load(**kwargs)
    ppl = perplexity(model, ids)
    agreement = top1_agreement(logits32, next_token_logits(model, ids))
    print(
        f"{kwargs}: perplexity {ppl:.3f} vs fp32 {ppl32:.3f} ({ppl / ppl32 - 1:+.2%}), top-1 agreement {agreement:.1%}"
    )
    assert abs(ppl / ppl32 - 1) <= bound
    assert agreement > 0.75


def test_quantized_model_generates_and_compiles_nothing_unexpected():
    model = tierlm.load(dtype="bfloat16", quantize="int8")
    assert type(model.decoder.lm_head).__name__ == "Int8Linear"
    assert type(model.decoder.model.layers[0].self_attn.q_proj).__name__ == "Int8Linear"
    r = model.generate("The capital of France is", max_new_tokens=8)
    assert "Paris" in r.texts[0]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_default_model_quantized_offload_streams_packed_weights_and_matches_resident(mode, tmp_path):
    """Half the layers on disk: they stream their packed weights (from a folder written once) and give
    the resident quantized model's tokens."""
    prompt = "The capital of France is"
    expected = greedy(tierlm.load(dtype="bfloat16", quantize=mode), prompt, max_new_tokens=12)
    half = {"": "cpu", **{f"model.layers.{i}": "disk" for i in range(15, 30)}}
    model = tierlm.load(dtype="bfloat16", quantize=mode, device_map=half, offload_folder=tmp_path)
    layer = model.decoder.model.layers[29].self_attn.q_proj
    assert type(layer).__name__ == ("Int8Linear" if mode == "int8" else "Int4Linear")
    packed = layer.weight_int8 if mode == "int8" else layer.weight_int4
    assert not packed.is_meta  # between forwards the unit holds its memory-mapped source
    assert_greedy_agrees(expected, greedy(model, prompt, max_new_tokens=12), mode)  # fused vs unfused
    assert model.streamer.fetches > 0
