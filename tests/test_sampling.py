"""Logits processors match hand-computed cases and transformers; sampling is seeded, exact and compilable."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tierlm.generation.sampling import (
    apply_repetition_penalty,
    apply_temperature,
    exponential_noise,
    mark_seen,
    min_p_filter,
    sample_next,
    suppress_tokens,
    suppress_where,
    top_k_filter,
    top_p_filter,
    warp_logits,
)

INF = float("inf")
VOCAB = 64


def random_logits(batch: int = 4, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


# --- hand-computed cases -------------------------------------------------------------------------


def test_mark_seen_sets_tokens_in_place():
    seen = torch.zeros(2, 5, dtype=torch.bool)
    out = mark_seen(seen, torch.tensor([[0, 3], [4, 4]]))
    assert out is seen
    assert seen.tolist() == [[True, False, False, True, False], [False, False, False, False, True]]
    mark_seen(seen, torch.tensor([1, 2]))  # one new token per row
    assert seen.tolist() == [[True, True, False, True, False], [False, False, True, False, True]]


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    seen = torch.tensor([[True, True, False, True]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 0.5, -6.0]]))


def test_suppress_tokens_hand_computed():
    out = suppress_tokens(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([1, 3]))
    torch.testing.assert_close(out, torch.tensor([[1.0, -INF, 3.0, -INF]]))


def test_temperature_hand_computed():
    out = apply_temperature(torch.tensor([[1.0, -2.0, 4.0]]), 0.5)
    torch.testing.assert_close(out, torch.tensor([[2.0, -4.0, 8.0]]))


@pytest.mark.parametrize(
    "row, k, expected",
    [
        ([1.0, 5.0, 3.0, 2.0, 4.0], 2, [-INF, 5.0, -INF, -INF, 4.0]),
        ([1.0, 3.0, 3.0, 2.0], 1, [-INF, 3.0, 3.0, -INF]),  # ties with the k-th stay, as in transformers
        ([1.0, 3.0, 3.0, 2.0], 3, [-INF, 3.0, 3.0, 2.0]),
        ([1.0, 3.0, 3.0, 2.0], 0, [1.0, 3.0, 3.0, 2.0]),
    ],
)
def test_top_k_hand_computed(row, k, expected):
    torch.testing.assert_close(top_k_filter(torch.tensor([row]), k), torch.tensor([expected]))


@pytest.mark.parametrize(
    "p, kept",
    [
        # probs 0.3, 0.1, 0.4, 0.2: ascending cumsum 0.1, 0.3, 0.6, 1.0 drops cumsum <= 1 - p
        (0.75, [True, False, True, True]),  # drop 0.1; 0.4 + 0.3 = 0.7 < 0.75 needs 0.2 too
        (0.65, [True, False, True, False]),  # 0.4 + 0.3 = 0.7 >= 0.65
        (0.3, [False, False, True, False]),  # 0.4 alone
        (0.01, [False, False, True, False]),  # always keeps one
    ],
)
def test_top_p_hand_computed(p, kept):
    logits = log_probs(0.3, 0.1, 0.4, 0.2)
    expected = torch.where(torch.tensor([kept]), logits, -INF)
    torch.testing.assert_close(top_p_filter(logits, p), expected)


def test_top_p_keeps_a_set_that_reaches_p_exactly():
    # uniform over 4: ascending cumsum 0.25, 0.5 (both <= 1 - 0.5, dropped), 0.75, 1.0 (kept)
    assert top_p_filter(torch.zeros(1, 4), 0.5).isfinite().sum() == 2


def test_min_p_keeps_tokens_exactly_at_the_threshold():
    logits = torch.tensor([[math.log(2), 0.0, 0.0]])  # probs exactly 0.5, 0.25, 0.25
    torch.testing.assert_close(min_p_filter(logits, 0.5), logits)  # threshold 0.25 is not "below"


@pytest.mark.parametrize(
    "min_p, kept",
    [
        (0.3, [True, False, True, True]),  # threshold 0.3 * 0.4 = 0.12 drops 0.1
        (0.6, [True, False, True, False]),  # threshold 0.24 drops 0.1 and 0.2
        (0.9, [False, False, True, False]),  # threshold 0.36 keeps only the top
    ],
)
def test_min_p_hand_computed(min_p, kept):
    logits = log_probs(0.3, 0.1, 0.4, 0.2)
    expected = torch.where(torch.tensor([kept]), logits, -INF)
    torch.testing.assert_close(min_p_filter(logits, min_p), expected)


def test_greedy_is_argmax_hand_computed():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 1.0]])
    assert sample_next(logits, greedy=True).tolist() == [1, 0]
    assert sample_next(logits, greedy=False, temperature=0.0).tolist() == [1, 0]


def test_low_precision_logits_are_processed_in_float32():
    logits = random_logits().bfloat16()
    out = warp_logits(logits, temperature=0.7, top_k=10, top_p=0.9, min_p=0.05)
    assert out.dtype == torch.float32
    torch.testing.assert_close(
        out, warp_logits(logits.float(), temperature=0.7, top_k=10, top_p=0.9, min_p=0.05)
    )


# --- parity with transformers on random logits -----------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    logits = random_logits()
    input_ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    seen = mark_seen(torch.zeros(4, VOCAB, dtype=torch.bool), input_ids)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, penalty), expected)


def test_suppress_tokens_matches_transformers():
    logits, ids = random_logits(), [3, 17, 40]
    expected = SuppressTokensLogitsProcessor(ids)(torch.zeros(4, 1, dtype=torch.long), logits.clone())
    torch.testing.assert_close(suppress_tokens(logits, torch.tensor(ids)), expected)


def test_suppress_eos_matches_min_new_tokens_processor():
    logits, eos = random_logits(), [2, 9]
    input_ids = torch.zeros(4, 5, dtype=torch.long)  # prompt of 3, 2 new tokens < min_new_tokens=4
    expected = MinNewTokensLengthLogitsProcessor(3, 4, eos)(input_ids, logits.clone())
    torch.testing.assert_close(suppress_tokens(logits, torch.tensor(eos)), expected)


def test_suppress_where_is_min_new_tokens_processor_row_by_row():
    """Rows of a batch end on different tokens (EOS, stop_token_ids, ignore_eos): each row's mask suppresses
    what transformers' processor suppresses for that row's ids, and a row past its minimum keeps its logits."""
    logits, ends = random_logits(), [[2, 9], [9], [], [2, 5, 40]]
    banned = torch.zeros_like(logits, dtype=torch.bool)
    for row, ids in enumerate(ends):
        banned[row, ids] = True
    early = torch.tensor([True, True, True, False])[:, None]
    got = suppress_where(logits, early & banned)
    for row, ids in enumerate(ends):
        new_tokens = 2 if early[row] else 4  # min_new_tokens=4 after a prompt of 3
        input_ids = torch.zeros(1, 3 + new_tokens, dtype=torch.long)
        expected = MinNewTokensLengthLogitsProcessor(3, 4, ids)(input_ids, logits[row : row + 1].clone())
        torch.testing.assert_close(got[row : row + 1], expected)


@pytest.mark.parametrize("temperature", [0.3, 1.7])
def test_temperature_matches_transformers(temperature):
    logits = random_logits()
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    torch.testing.assert_close(apply_temperature(logits, temperature), expected)


@pytest.mark.parametrize("k", [1, 5, 50, VOCAB, 1000])
def test_top_k_matches_transformers(k):
    logits = random_logits()
    torch.testing.assert_close(top_k_filter(logits, k), TopKLogitsWarper(k)(None, logits.clone()))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.8, 0.95, 0.999])
def test_top_p_matches_transformers(p):
    logits = random_logits()
    torch.testing.assert_close(top_p_filter(logits, p), TopPLogitsWarper(p)(None, logits.clone()))


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 0.99])
def test_min_p_matches_transformers(min_p):
    logits = random_logits()
    torch.testing.assert_close(min_p_filter(logits, min_p), MinPLogitsWarper(min_p)(None, logits.clone()))


def test_warp_chain_matches_transformers_order():
    logits = random_logits(seed=3)
    hf = LogitsProcessorList(
        [TemperatureLogitsWarper(0.8), TopKLogitsWarper(20), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)]
    )
    out = warp_logits(logits, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)
    torch.testing.assert_close(out, hf(None, logits.clone()))


# --- sampling ---------------------------------------------------------------------------------------

SAMPLING = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.01}


def draw(logits: torch.Tensor, seed: int, **kwargs) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return sample_next(logits, greedy=False, generator=gen, **{**SAMPLING, **kwargs})


def test_sampling_with_a_seed_is_reproducible():
    logits = random_logits(batch=64)
    assert torch.equal(draw(logits, seed=7), draw(logits, seed=7))


def test_sampling_with_different_seeds_differs():
    logits = random_logits(batch=64)
    assert not torch.equal(draw(logits, seed=7), draw(logits, seed=8))


def test_top_k_one_equals_greedy():
    logits = random_logits(batch=64)
    greedy = sample_next(logits, greedy=True)
    for seed in range(5):
        assert torch.equal(draw(logits, seed=seed, top_k=1), greedy)


def test_sampled_tokens_are_never_filtered_ones():
    logits = random_logits(batch=256)
    tokens = draw(logits, seed=0, top_k=5)
    allowed = top_k_filter(logits, 5).isfinite()
    assert allowed.gather(1, tokens[:, None]).all()


@pytest.mark.parametrize("top_k", [0, 3])
def test_empirical_distribution_matches_softmax(top_k):
    n, row = 20_000, torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5])
    logits = row.expand(n, -1)  # 20k independent draws in one call
    tokens = draw(logits, seed=123, temperature=1.0, top_k=top_k, top_p=1.0, min_p=0.0)
    freq = torch.bincount(tokens, minlength=row.numel()).float() / n
    expected = top_k_filter(row[None], top_k).softmax(-1)[0]
    assert (freq - expected).abs().max() < 0.012  # ~3.5 standard errors at p = 0.35
    assert freq[expected == 0].sum() == 0


def test_precomputed_noise_equals_generator_draw():
    logits = random_logits(batch=32)
    noise = exponential_noise(logits, torch.Generator().manual_seed(5))
    via_noise = sample_next(logits, greedy=False, noise=noise, **SAMPLING)
    assert torch.equal(via_noise, draw(logits, seed=5))


def test_zero_noise_never_picks_a_filtered_token():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    noise = torch.tensor([[0.0, 1.0, 1.0, 1.0]])  # token 0 is filtered by top_k=2
    assert sample_next(logits, greedy=False, top_k=2, noise=noise).tolist() == [1]


# --- torch.compile ------------------------------------------------------------------------------------


def sampling_step(logits: torch.Tensor, seen: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    logits = apply_repetition_penalty(logits, seen, 1.2)
    logits = suppress_tokens(logits, torch.tensor([0], device=logits.device))
    token = sample_next(logits, greedy=False, noise=noise, **SAMPLING)
    mark_seen(seen, token)
    return token


def test_sampling_path_compiles_to_one_graph():
    torch._dynamo.reset()
    logits, noise = random_logits(), exponential_noise(random_logits(), torch.Generator().manual_seed(0))
    explanation = torch._dynamo.explain(sampling_step)(logits, torch.zeros(4, VOCAB, dtype=torch.bool), noise)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1

    compiled = torch.compile(sampling_step, fullgraph=True, backend="eager")
    seen_eager, seen_compiled = torch.zeros(2, 4, VOCAB, dtype=torch.bool)
    expected = sampling_step(logits, seen_eager, noise)
    assert torch.equal(compiled(logits, seen_compiled, noise), expected)
    assert torch.equal(seen_compiled, seen_eager)


def test_sampling_with_global_rng_compiles_fullgraph():
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x: sample_next(x, greedy=False, **SAMPLING), fullgraph=True, backend="eager"
    )
    tokens = compiled(random_logits())
    assert tokens.shape == (4,) and tokens.dtype == torch.long
