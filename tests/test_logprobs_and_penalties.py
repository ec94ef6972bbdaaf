"""Library: log probabilities, n samples sharing a prefill, penalties and logit_bias, per-row settings."""

from __future__ import annotations

import pytest
import torch

import tierlm
from tierlm.generation.config import GenerationConfig
from tierlm.generation.loop import Sampler
from tierlm.generation.sampling import warp_logits, warp_rows

PROMPT = [[5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31]]


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return tierlm.load(tiny_checkpoints["llama"], dtype="float32")


def test_logprobs_equal_log_softmax_of_the_model_logits(model):
    """Prompt and generated tokens' log probabilities are log-softmax of model(input_ids), top-N in order."""
    ids = torch.tensor(PROMPT)
    result = model.generate(ids, max_new_tokens=6, logprobs=5, prompt_logprobs=5, prefill_chunk=5)
    generated = result.token_ids[0]
    full = torch.tensor([PROMPT[0] + generated])
    reference = model(full).float().log_softmax(-1)[0]  # [seq, vocab]
    prompt_lp = result.prompt_logprobs[0]
    assert prompt_lp[0] is None and len(prompt_lp) == len(PROMPT[0])
    entries = prompt_lp[1:] + result.logprobs[0]
    assert [e.token for e in entries] == full[0, 1:].tolist()
    for position, entry in enumerate(
        entries
    ):  # entry predicts token position + 1 from the logits at position
        row = reference[position]
        assert entry.logprob == pytest.approx(row[entry.token].item(), abs=1e-4)
        values, top_ids = row.topk(5)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_greedy_token_is_the_top_logprob(model):
    result = model.generate(torch.tensor(PROMPT), max_new_tokens=4, logprobs=1)
    for entry in result.logprobs[0]:
        assert entry.top[0][0] == entry.token


def test_n_seeded_samples_are_distinct_reproducible_and_share_one_prefill(model):
    ids = torch.tensor(PROMPT)
    config = dict(do_sample=True, temperature=1.0, seed=7, max_new_tokens=8, n=4)
    first = model.generate(ids, **config).token_ids
    assert len(first) == 4 and len({tuple(t) for t in first}) == 4
    assert model.generate(ids, **config).token_ids == first
    # sample 0 is the request's own seed; sample i the same as without a shared prefill (dynamic cache)
    assert model.generate(ids, **{**config, "n": 1}).token_ids[0] == first[0]
    assert model.generate(ids, **config, cache_implementation="dynamic").token_ids == first


def test_n_with_several_prompts_is_prompt_major(model):
    prompts = [PROMPT[0], PROMPT[0][:5]]
    both = model.generate(prompts, max_new_tokens=5, n=2).token_ids
    solo = [model.generate([p], max_new_tokens=5).token_ids[0] for p in prompts]
    assert both == [solo[0], solo[0], solo[1], solo[1]]


# --- each processor against a direct computation on the logits --------------------------------------------

VOCAB, STEPS = 12, 40


def _greedy_run(config: GenerationConfig, prompt: list[int], logits: torch.Tensor) -> list[int]:
    sampler = Sampler(1, VOCAB, torch.tensor([VOCAB - 1]), "cpu")
    sampler.set_row(0, config, prompt)
    return [sampler(step[None]).item() for step in logits]


def _expected(logits: torch.Tensor, prompt: list[int], adjust) -> list[int]:
    counts, out = torch.zeros(VOCAB), []
    for step in logits:
        token = int(adjust(step.clone(), counts, prompt).argmax())
        counts[token] += 1
        out.append(token)
    return out


def _frequency(step, counts, _prompt):
    return step - 0.7 * counts


def _presence(step, counts, _prompt):
    return step - 1.5 * (counts > 0).float()


def _repetition(step, counts, prompt):
    seen = (counts > 0).clone()
    seen[prompt] = True
    penalized = torch.where(step < 0, step * 1.8, step / 1.8)
    return torch.where(seen, penalized, step)


def _bias(step, _counts, _prompt):
    step[3] += 2.5
    step[8] -= 100
    return step


@pytest.mark.parametrize(
    "field, adjust",
    [
        ({"frequency_penalty": 0.7}, _frequency),
        ({"presence_penalty": 1.5}, _presence),
        ({"repetition_penalty": 1.8}, _repetition),
        ({"logit_bias": {3: 2.5, "8": -100}}, _bias),
    ],
)
def test_processor_matches_direct_computation(field, adjust):
    torch.manual_seed(0)
    logits = torch.randn(STEPS, VOCAB) * 2
    prompt = [1, 2]
    got = _greedy_run(GenerationConfig(**field), prompt, logits)
    assert got == _expected(logits, prompt, adjust)
    assert got != logits.argmax(-1).tolist()  # the field changed the outcome, so the test can fail


def test_logit_bias_applies_before_the_penalties_as_in_transformers():
    """With both set, the bias is added first and then penalized, as transformers' SequenceBiasLogitsProcessor
    runs before its RepetitionPenaltyLogitsProcessor (and vLLM applies logit_bias before its penalties)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    torch.manual_seed(1)
    logits = torch.randn(STEPS, VOCAB) * 2
    prompt = [1, 2, 3]
    hf = LogitsProcessorList(
        [SequenceBiasLogitsProcessor({(3,): 4.0, (5,): -3.0}), RepetitionPenaltyLogitsProcessor(3.0)]
    )

    def transformers_order(step, counts, _prompt):
        seen = sorted(set(prompt) | {i for i in range(VOCAB) if counts[i] > 0})
        return hf(torch.tensor([seen]), step[None])[0]

    config = GenerationConfig(logit_bias={3: 4.0, 5: -3.0}, repetition_penalty=3.0)
    assert _greedy_run(config, prompt, logits) == _expected(logits, prompt, transformers_order)
    penalized_first = _expected(logits, prompt, lambda s, c, p: _repetition_then_bias(s, c, p))
    assert _expected(logits, prompt, transformers_order) != penalized_first  # the order shows here


def _repetition_then_bias(step, counts, prompt):
    seen = (counts > 0).clone()
    seen[prompt] = True
    step = torch.where(seen, torch.where(step < 0, step * 3.0, step / 3.0), step)
    step[3] += 4.0
    step[5] -= 3.0
    return step


def test_per_row_warp_equals_the_scalar_one():
    torch.manual_seed(1)
    logits = torch.randn(4, 50) * 3
    settings = [(0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 10, 0.9, 0.05)]
    t, k, p, m = (torch.tensor([[s[i]] for s in settings]) for i in range(4))
    rows = warp_rows(logits, t.float(), k.long(), p.float(), m.float())
    for i, (temperature, top_k, top_p, min_p) in enumerate(settings):
        one = warp_logits(logits[i : i + 1], temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        assert torch.equal(rows[i : i + 1].isinf(), one.isinf())
        torch.testing.assert_close(rows[i : i + 1][~one.isinf()], one[~one.isinf()])


def test_rows_that_only_set_a_temperature_are_not_filtered():
    """With top_k 0, top_p 1 and min_p 0 in every row nothing is sorted or dropped: the scores are the
    logits over the temperature, bit for bit, even a token whose probability underflows to 0; one row with
    a filter sorts the batch, and the rows without one still lose only such zero-probability tokens."""
    torch.manual_seed(2)
    logits = torch.randn(3, 49152) * 3
    logits[:, 7] = -1e4  # exp underflows: probability exactly 0
    t = torch.tensor([[0.7], [1.0], [1.3]])
    k, p, m = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), torch.zeros(3, 1)
    assert torch.equal(warp_rows(logits, t, k, p, m), logits / t)
    p[0] = 0.9
    mixed = warp_rows(logits, t, k, p, m)
    assert mixed[0].isinf().sum() > 1000  # row 0 is filtered by its top-p
    for row in (1, 2):
        kept = ~mixed[row].isinf()
        assert kept.sum() == 49151 and not kept[7]
        assert torch.equal(mixed[row][kept], (logits[row] / t[row])[kept])


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {"\u00b2": 1.0}}, "logit_bias"),
        ({"logit_bias": {100: 1.0, "100": -1.0}}, "token id 100 more than one bias"),
        ({"n": 0}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
    ],
)
def test_bad_new_fields_raise_naming_them(overrides, field):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**overrides)


def test_min_new_tokens_on_a_model_without_eos_suppresses_nothing(tmp_path):
    """transformers adds no min-length processor without an EOS id; the -1 that stood in for it suppressed the
    vocabulary's last token."""
    from conftest import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "no-eos", "llama", {"eos_token_id": None})
    model = tierlm.load(path, dtype="float32")
    assert model.config.eos_token_ids == ()
    bias = {319: 100.0}  # the last token of the vocabulary, made certain
    plain = model.generate(PROMPT, max_new_tokens=4, logit_bias=bias).token_ids[0]
    assert plain == [319] * 4
    assert model.generate(PROMPT, max_new_tokens=4, min_new_tokens=3, logit_bias=bias).token_ids[0] == plain


def test_top_p_cut_rounds_like_transformers():
    """Probabilities 0.1 and 0.9 at top_p 0.9: transformers compares with 1 - 0.9 taken in double and rounded
    once (0.1f) and keeps both; 1 - 0.9f in float32 (0.10000002) dropped the first."""
    from transformers import TopPLogitsWarper

    logits = torch.tensor([[-2.3025849, -0.1053605]])
    expected = TopPLogitsWarper(0.9)(None, logits.clone())
    assert not expected.isinf().any()
    sampler = Sampler(1, 2, torch.tensor([], dtype=torch.long), "cpu")
    sampler.set_row(0, GenerationConfig(do_sample=True, top_p=0.9), [0])
    ones = torch.ones(1, 1)
    assert torch.equal(
        warp_rows(logits, ones, torch.zeros(1, 1, dtype=torch.long), sampler.top_p, 0 * ones), expected
    )
