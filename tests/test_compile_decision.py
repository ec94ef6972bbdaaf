"""decide(): the one place that says whether the decode step is compiled, with reasons naming specifics."""

from __future__ import annotations

import warnings

import pytest
from conftest import SEED_MAP

from tierlm.compile import CompileConfig, CompileDecision, CompileSkippedWarning, decide, warn_if_skipped
from tierlm.generation.config import GenerationConfig

STATIC = GenerationConfig(cache_implementation="static")


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees a process that has warned of nothing yet (warnings are once per cause per process)."""
    import tierlm.compile

    monkeypatch.setattr(tierlm.compile, "_warned", set())


def normalized(m):
    from tierlm.placement.device_map import normalize_device

    return {k: normalize_device(v) for k, v in m.items()}


def test_seed_map_with_cpu_offload_does_not_compile():
    d = decide(normalized(SEED_MAP), "static", STATIC)
    assert not d.compile
    assert d.reasons == ("model.layers.1, model.norm are offloaded to cpu",)


def test_seed_map_with_disk_offload_does_not_compile():
    disk = {**SEED_MAP, "model.layers.1": "disk", "model.norm": "disk"}
    d = decide(normalized(disk), "static", STATIC)
    assert not d.compile
    assert d.reasons == ("model.layers.1, model.norm are offloaded to disk",)


def test_disk_reasons_collapse_layer_runs():
    layers = {f"model.layers.{i}": ("cuda:0" if i < 15 else "disk") for i in range(30)}
    m = {"model.embed_tokens": "cuda:0", **layers, "model.norm": "disk", "lm_head": "cuda:0"}
    assert decide(m, "static", STATIC).reasons == ("model.layers.15-29, model.norm are offloaded to disk",)


def test_all_on_gpu_compiles_in_reduce_overhead_mode():
    all_gpu = normalized(dict.fromkeys(SEED_MAP, 0))
    d = decide(all_gpu, "static", STATIC)
    assert d == CompileDecision(True, (), "cuda:0")
    assert CompileConfig().resolved_mode(d.device) == "reduce-overhead"
    assert CompileConfig().resolved_mode("cpu") == "max-autotune-no-cudagraphs"
    assert CompileConfig(scope="layer").resolved_mode("cpu") == "default"


def test_cpp_wrapper_defaults_on_for_a_cpu_layer_body_only():
    def wrapper(cc, device):
        return cc.compile_kwargs(device)["options"]["cpp_wrapper"]

    assert wrapper(CompileConfig(scope="layer"), "cpu") is True  # one call per layer per step
    assert wrapper(CompileConfig(), "cpu") is False
    assert wrapper(CompileConfig(scope="layer"), "cuda:0") is False
    assert wrapper(CompileConfig(scope="layer"), "mps") is False
    assert wrapper(CompileConfig(scope="layer", cpp_wrapper=False), "cpu") is False  # the caller's word
    assert wrapper(CompileConfig(cpp_wrapper=True), "cpu") is True


def test_a_cpu_whole_step_builds_its_cpp_wrapper_apart_from_its_kernels():
    """With a C++ wrapper, a CPU whole step compiles the wrapper apart (inductor's cpp_wrapper_build_separate,
    a shorter cold compile); a layer body, a Python wrapper and CUDA keep inductor's one build; the caller's
    options win."""

    def separate(cc, device):
        return cc.compile_kwargs(device)["options"].get("cpp_wrapper_build_separate", False)

    assert separate(CompileConfig(cpp_wrapper=True), "cpu") is True
    assert separate(CompileConfig(), "cpu") is False
    assert separate(CompileConfig(scope="layer"), "cpu") is False  # a C++ wrapper, called once per layer
    assert separate(CompileConfig(cpp_wrapper=True), "cuda:0") is False
    own = CompileConfig(cpp_wrapper=True, options={"cpp_wrapper_build_separate": False})
    assert separate(own, "cpu") is False


def test_cpu_steps_have_python_wrappers_without_size_asserts_unless_asked():
    """A CPU step's Python wrapper runs every decode step: inductor's size, stride and alignment checks of
    each extern kernel's output are off there (compile.CPU_WRAPPER_OPTIONS); CUDA keeps inductor's
    defaults, and a CompileConfig's own options win."""

    def options(cc, device):
        return cc.compile_kwargs(device)["options"]

    for cc in (CompileConfig(), CompileConfig(scope="layer")):
        assert (
            options(cc, "cpu")["size_asserts"] is False and options(cc, "cpu")["alignment_asserts"] is False
        )
        assert "size_asserts" not in options(cc, "cuda:0")
    asked = CompileConfig(options={"size_asserts": True})
    assert (
        options(asked, "cpu")["size_asserts"] is True and options(asked, "cpu")["alignment_asserts"] is False
    )


def test_all_cpu_with_compile_config_compiles():
    all_cpu = dict.fromkeys(SEED_MAP, "cpu")
    assert decide(all_cpu, "static", STATIC.replace(compile_config=CompileConfig())).compile


def test_cpu_without_compile_config_does_not_compile():
    d = decide(dict.fromkeys(SEED_MAP, "cpu"), "static", STATIC)
    assert not d.compile and "compile_config" in d.reasons[0]


def test_dynamic_cache_does_not_compile():
    d = decide(normalized(dict.fromkeys(SEED_MAP, 0)), "dynamic", STATIC)
    assert d.reasons == ("cache 'dynamic' is not compilable; use cache_implementation='static'",)


def test_disable_compile_wins_and_warns_only_when_compile_was_asked():
    gpu = normalized(dict.fromkeys(SEED_MAP, 0))
    off = STATIC.replace(disable_compile=True)
    d = decide(gpu, "static", off)
    assert not d.compile and d.reasons == ("disable_compile=True",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_skipped(d, off)  # no compile_config: nothing to warn about
    both = off.replace(compile_config=CompileConfig())
    with pytest.warns(CompileSkippedWarning, match="disable_compile=True overrides compile_config"):
        warn_if_skipped(decide(gpu, "static", both), both)


def test_every_failing_condition_adds_its_reason():
    disk = {**SEED_MAP, "model.norm": "disk"}
    d = decide(
        normalized(disk), "dynamic", STATIC.replace(disable_compile=True), uncompilable=("int4 weights",)
    )
    assert d.reasons == (
        "disable_compile=True",
        "cache 'dynamic' is not compilable; use cache_implementation='static'",
        "model.layers.1 is offloaded to cpu",
        "model.norm is offloaded to disk",
        "int4 weights",
    )


def test_skip_warning_is_emitted_once_per_cause():
    config = STATIC.replace(compile_config=CompileConfig(), cache_implementation="dynamic")
    cause = decide({"": "cpu"}, "dynamic", config)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            warn_if_skipped(cause, config)
        other = decide({"": "cpu"}, "static", config, uncompilable=("int4 weights",))
        warn_if_skipped(other, config)
    skipped = [w for w in seen if issubclass(w.category, CompileSkippedWarning)]
    assert [str(w.message).split(": ", 1)[1] for w in skipped] == [
        "cache 'dynamic' is not compilable; use cache_implementation='static'",
        "int4 weights",
    ]


def test_a_cause_already_reported_is_not_repeated_next_to_a_new_one():
    config = STATIC.replace(compile_config=CompileConfig())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn_if_skipped(decide({"": "cpu"}, "dynamic", config), config)
        both = decide({"": "cpu"}, "dynamic", config, uncompilable=("int4 weights",))
        warn_if_skipped(both, config)  # the cache cause was said; only the new one is
    skipped = [
        str(w.message).split(": ", 1)[1] for w in seen if issubclass(w.category, CompileSkippedWarning)
    ]
    assert skipped == ["cache 'dynamic' is not compilable; use cache_implementation='static'", "int4 weights"]


# --- under offload: the rows of the decision ---------------------------------------------------------------

HALF = {"": "cpu", **{f"model.layers.{i}": "disk" for i in range(9, 30)}}
LAYER = STATIC.replace(compile_config=CompileConfig(scope="layer"))


def test_offload_without_compile_config_is_eager_and_silent_on_every_device():
    for placement, device in ((HALF, "cpu"), (normalized(SEED_MAP), "cuda:0")):
        d = decide(placement, "static", STATIC, device=device, layers=30)
        assert not d.compile and any("offloaded" in r for r in d.reasons)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warn_if_skipped(d, STATIC)


def test_offload_with_layer_scope_compiles_the_layer_body():
    d = decide(HALF, "static", LAYER, layers=30)
    assert d.compile and d.scope == "layer" and d.reasons == ()
    assert d.config == CompileConfig(scope="layer")
    assert d.explain() == (
        "compile: layer body on cpu (30 layers; model.layers.9-29 stream from disk); whole step: no "
        "(offloaded); eager: embedding, final norm, LM head, fetch/release"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_skipped(d, LAYER)  # what was asked is what happens


def test_offload_with_model_scope_warns_once_and_compiles_the_layer_body():
    config = STATIC.replace(compile_config=CompileConfig())
    d = decide({**HALF, "model.norm": "cpu", "lm_head": "disk"}, "static", config, layers=30)
    assert d.compile and d.scope == "layer" and d.config == CompileConfig(scope="layer")
    assert d.explain().startswith(
        "compile: layer body on cpu (30 layers; model.layers.9-29, lm_head stream from disk); whole step: no "
        "(model.layers.9-29, lm_head are offloaded to disk; scope 'model' fell back to 'layer')"
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            warn_if_skipped(d, config)
    assert [str(w.message) for w in seen if issubclass(w.category, CompileSkippedWarning)] == [
        "compile_config has scope 'model', but the whole decode step cannot be compiled while weights stream "
        "(model.layers.9-29, lm_head are offloaded to disk); compiling the layer body instead, as "
        "CompileConfig(scope='layer') does under offload without this warning"
    ]


def test_offload_with_disable_compile_is_eager_and_silent():
    d = decide(normalized(SEED_MAP), "static", STATIC.replace(disable_compile=True))
    assert not d.compile and d.reasons[0] == "disable_compile=True"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_skipped(d, STATIC.replace(disable_compile=True))


def test_streamed_weights_are_never_frozen_nor_captured_in_cuda_graphs():
    frozen = STATIC.replace(compile_config=CompileConfig(freezing=True))
    d = decide(HALF, "static", frozen)
    assert d.config.scope == "layer" and d.config.compile_kwargs("cpu")["options"]["freezing"] is False
    on_gpu = decide(normalized(SEED_MAP), "static", STATIC.replace(compile_config=CompileConfig()))
    assert on_gpu.compile and on_gpu.device == "cuda:0" and on_gpu.config.mode == "default"
    graphs = STATIC.replace(compile_config=CompileConfig(scope="layer", mode="reduce-overhead"))
    d = decide(normalized(SEED_MAP), "static", graphs)
    assert not d.compile and "records CUDA graphs" in d.reasons[0]


def test_a_resident_layer_body_on_cuda_records_no_cuda_graphs():
    """The layer body replays once per layer in a step; a CUDA graph's replay would overwrite the output
    of the layer before (seen on an H200): layer scope defaults to mode "default" on CUDA, and an explicit
    CUDA-graph mode with it is refused with the reason, while the whole step keeps reduce-overhead."""
    gpu = normalized({"": 0})
    layer = decide(gpu, "static", STATIC.replace(compile_config=CompileConfig(scope="layer")))
    assert layer.compile and layer.config.resolved_mode(layer.device) == "default"
    assert not CompileConfig(scope="layer").compile_kwargs("cuda:0")["options"].get("triton.cudagraphs")
    whole = decide(gpu, "static", STATIC)
    assert whole.compile and CompileConfig().resolved_mode(whole.device) == "reduce-overhead"
    graphs = STATIC.replace(compile_config=CompileConfig(scope="layer", mode="reduce-overhead"))
    refused = decide(gpu, "static", graphs)
    assert not refused.compile and "overwrites the output" in refused.reasons[0]


def test_offload_still_needs_a_static_cache_and_a_compilable_model():
    d = decide(HALF, "dynamic", LAYER, uncompilable=("int4 weights",))
    assert d.reasons == (
        "cache 'dynamic' is not compilable; use cache_implementation='static'",
        "int4 weights",
    )


def test_resident_layer_scope_says_what_compiles():
    d = decide({"": "cpu"}, "static", LAYER, layers=30)
    assert (
        d.compile and d.explain() == "compile: layer body on cpu (30 layers); whole step: no (scope 'layer')"
    )


def test_decision_reads_the_resolved_execution_device():
    """A map on the accelerator run on the CPU (execution_device="cpu") compiles only with consent."""
    on_gpu = normalized({"": 0})
    assert decide(on_gpu, "static", STATIC).compile  # derived from the map: cuda:0
    forced = decide(on_gpu, "static", STATIC, device="cpu")
    assert not forced.compile and forced.device == "cpu"
    assert forced.reasons == ("execution device 'cpu' compiles only when compile_config is set",)
    assert decide(on_gpu, "static", STATIC.replace(compile_config=CompileConfig()), device="cpu").compile


@pytest.mark.parametrize("folder", ["with space", "quote's", "back\\slash"])
def test_a_cache_path_inductor_cannot_compile_in_is_one_clear_error(tmp_path, monkeypatch, folder):
    """inductor splits its g++ commands as a shell would: such a path failed every compile with a bare
    'C++ compile error' (or shlex's 'No closing quotation')."""
    from tierlm.compile import use_inductor_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "x")  # restored after the test, set or not before it
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / folder))
    with pytest.raises(ValueError, match="cannot compile in .*set TIERLM_CACHE_DIR"):
        use_inductor_cache()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "plain"))  # the user's own wins
    assert use_inductor_cache() == str(tmp_path / "plain")
