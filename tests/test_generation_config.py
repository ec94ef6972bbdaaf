"""GenerationConfig validates every field on construction with errors that name the field."""

from __future__ import annotations

import dataclasses

import pytest

from tierlm.compile import CompileConfig
from tierlm.generation.config import GenerationConfig


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": "5"}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"do_sample": 1}, "do_sample"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "0.7"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 5.0}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.2}, "repetition_penalty"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"eos_token_id": -2}, "eos_token_id"),
        ({"eos_token_id": []}, "eos_token_id"),
        ({"eos_token_id": [1, "2"]}, "eos_token_id"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"cache_implementation": "paged"}, "cache_implementation"),
        ({"max_cache_len": 0}, "max_cache_len"),
        ({"compile_config": {"fullgraph": True}}, "compile_config"),
        ({"disable_compile": "yes"}, "disable_compile"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_invalid_value_raises_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field) as info:
        GenerationConfig(**overrides)
    bad = overrides[field]
    assert repr(bad) in str(info.value) or str(bad) in str(info.value)


def test_error_says_what_is_valid():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1\.0"):
        GenerationConfig(temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1\.5"):
        GenerationConfig(top_p=1.5)
    with pytest.raises(ValueError, match="'static', 'dynamic'.*did you mean 'static'"):
        GenerationConfig(cache_implementation="statc")


def test_unknown_field_in_replace_lists_valid_names():
    with pytest.raises(ValueError, match="did you mean 'temperature'") as info:
        GenerationConfig().replace(temprature=0.5)
    for field in dataclasses.fields(GenerationConfig):
        assert field.name in str(info.value)


def test_replace_validates_again():
    with pytest.raises(ValueError, match="top_k"):
        GenerationConfig().replace(top_k=-3)


def test_defaults_construct():
    config = GenerationConfig()
    assert config.max_new_tokens == 128 and config.greedy and config.cache_implementation == "static"
    assert config.eos_token_id is None and config.stop == () and config.compile_config is None


def test_valid_config_constructs_and_normalizes():
    config = GenerationConfig(
        max_new_tokens=16,
        min_new_tokens=16,
        do_sample=True,
        temperature=1,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        seed=0,
        eos_token_id=[2, 7],
        stop=["\n\n", "###"],
        cache_implementation="dynamic",
        max_cache_len=256,
        compile_config=CompileConfig(mode="max-autotune-no-cudagraphs"),
        disable_compile=True,
    )
    assert config.eos_token_id == (2, 7) and config.stop == ("\n\n", "###")
    assert isinstance(config.temperature, float) and config.temperature == 1.0
    assert not config.greedy


def test_single_eos_and_stop_become_tuples():
    config = GenerationConfig(eos_token_id=2, stop="</s>")
    assert config.eos_token_id == (2,) and config.stop == ("</s>",)


@pytest.mark.parametrize(
    "do_sample, temperature, greedy",
    [(False, 1.0, True), (True, 1.0, False), (True, 0.0, True), (False, 0.0, True)],
)
def test_greedy_property(do_sample, temperature, greedy):
    assert GenerationConfig(do_sample=do_sample, temperature=temperature).greedy is greedy


def test_config_is_frozen():
    config = GenerationConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.temperature = 0.5


def test_from_overrides_applies_only_given_values():
    base = GenerationConfig(temperature=0.7, seed=3)
    config = GenerationConfig.from_overrides(base, temperature=None, top_k=5, seed=None)
    assert (config.temperature, config.top_k, config.seed) == (0.7, 5, 3)
    assert GenerationConfig.from_overrides(None, max_new_tokens=8).max_new_tokens == 8


@pytest.mark.parametrize("field, value", [("temperature", 1e39), ("repetition_penalty", 1e300)])
def test_settings_the_sampler_cannot_hold_as_float32_are_refused(field, value):
    """Accepted before, they overflowed later inside torch ("value cannot be converted to type float")."""
    with pytest.raises(ValueError, match=f"{field} must fit a float32"):
        GenerationConfig(**{field: value})
    assert getattr(GenerationConfig(**{field: 1e30}), field) == 1e30


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"mode": "fast"}, "CompileConfig.mode: Unrecognized mode=fast"),
        ({"mode": 3}, "CompileConfig.mode must be None or a torch.compile mode name"),
        ({"backend": "inductr"}, "'inductr' is not a torch.compile backend (did you mean 'inductor'?)"),
        ({"backend": 3}, "CompileConfig.backend must be a backend name or a callable"),
        ({"options": {"freezin": True}}, "'freezin' is not an inductor option (did you mean 'freezing'?)"),
        ({"options": ["freezing"]}, "CompileConfig.options must be a dict"),
        (
            {"backend": "eager", "options": {"freezing": True}},
            "options are inductor's; backend 'eager' takes none",
        ),
        ({"fullgraph": 1}, "CompileConfig.fullgraph must be True or False, got 1"),
        ({"freezing": "yes"}, "CompileConfig.freezing must be True or False or None"),
        ({"cpp_wrapper": 0}, "CompileConfig.cpp_wrapper must be True or False or None"),
    ],
)
def test_compile_config_checks_what_torch_compile_would_refuse_minutes_later(kwargs, says):
    """A CompileConfig is built before the load; torch.compile sees it at the first compiled step (or, for
    options, silently ignores them for a backend other than inductor). Each mistake is one ValueError now."""
    with pytest.raises(ValueError) as err:
        CompileConfig(**kwargs)
    assert says in str(err.value)


def test_compile_config_takes_torch_compile_values():
    for kwargs in (
        {"mode": "max-autotune"},
        {"backend": "aot_eager"},
        {"options": {"cpp.simdlen": 256}},
        {"dynamic": None},  # torch.compile's own default
    ):
        CompileConfig(**kwargs)
    CompileConfig(backend=lambda gm, inputs: gm)
