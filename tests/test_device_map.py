"""Device maps: parsing, expansion, collapsing and inference from memory budgets."""

from __future__ import annotations

import re

import pytest
from conftest import SEED_MAP

from tierlm.placement import device_map as dm
from tierlm.placement.device_map import (
    execution_device,
    expand_device_map,
    format_modules,
    infer_device_map,
    module_map,
    normalize_device,
    offloaded_modules,
    parse_max_memory,
    parse_max_memory_arg,
    parse_memory,
)

LAYER_PARAMS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]


def param_names(layers: int, *, lm_head: bool = True) -> list[str]:
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{p}" for i in range(layers) for p in LAYER_PARAMS]
    return names + ["model.norm.weight"] + (["lm_head.weight"] if lm_head else [])


def param_bytes(layers: int, *, embed=100, layer=1000, norm=10, head=100) -> dict[str, int]:
    """Synthetic sizes: every layer totals exactly `layer` bytes."""
    sizes = {"model.embed_tokens.weight": embed}
    for i in range(layers):
        each = layer // len(LAYER_PARAMS)
        for p in LAYER_PARAMS:
            sizes[f"model.layers.{i}.{p}"] = each
        sizes[f"model.layers.{i}.mlp.down_proj.weight"] += layer - each * len(LAYER_PARAMS)
    sizes["model.norm.weight"] = norm
    if head:
        sizes["lm_head.weight"] = head
    return sizes


def units(layers: int) -> list[str]:
    return ["model.embed_tokens", *(f"model.layers.{i}" for i in range(layers)), "model.norm", "lm_head"]


def placed(mapping: dict[str, str], *assignments: tuple[str, list[str]]) -> None:
    """Assert `mapping` is exactly the given devices for the given names, in that order."""
    expected = {name: device for device, names in assignments for name in names}
    assert list(mapping) == sorted(expected, key=list(mapping).index)
    assert mapping == expected


# ---------------------------------------------------------------- expand_device_map


def test_seed_map_expands_to_every_parameter():
    expanded = expand_device_map(SEED_MAP, param_names(2))
    assert list(expanded) == param_names(2)
    for name, device in expanded.items():
        if name.startswith(("model.layers.1.", "model.norm.")):
            assert device == "cpu", name
        else:
            assert device == "cuda:0", name


def test_most_specific_key_wins():
    device_map = {
        "": "cpu",
        "model.layers.1": "disk",
        "model.layers.1.mlp.up_proj": "cuda:1",
        "lm_head.weight": 0,
    }
    expanded = expand_device_map(device_map, param_names(2))
    assert expanded["model.layers.1.mlp.up_proj.weight"] == "cuda:1"
    assert expanded["model.layers.1.mlp.down_proj.weight"] == "disk"
    assert expanded["model.layers.1.self_attn.q_proj.weight"] == "disk"
    assert expanded["model.layers.0.mlp.up_proj.weight"] == "cpu"
    assert expanded["lm_head.weight"] == "cuda:0"
    assert expanded["model.norm.weight"] == "cpu"


def test_prefix_matches_only_at_dot_boundary():
    names = param_names(12)
    expanded = expand_device_map({"": "cpu", "model.layers.1": "disk"}, names)
    assert expanded["model.layers.1.mlp.up_proj.weight"] == "disk"
    assert expanded["model.layers.10.mlp.up_proj.weight"] == "cpu"
    assert expanded["model.layers.11.input_layernorm.weight"] == "cpu"
    expanded = expand_device_map({"": "cpu", "model.layers.10": 0}, names)
    assert expanded["model.layers.1.mlp.up_proj.weight"] == "cpu"
    assert expanded["model.layers.10.mlp.up_proj.weight"] == "cuda:0"


def test_hf_device_map_with_parameterless_rotary_emb_is_accepted():
    hf_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.norm": 0}
    hf_map |= {"model.rotary_emb": 0, "lm_head": 0}
    assert set(expand_device_map(hf_map, param_names(2)).values()) == {"cuda:0"}


@pytest.mark.parametrize(
    "key, nearest",
    [
        ("model.layer.1", "model.layers.1"),
        ("model.layers.1.mlp.up_prj", "model.layers.1.mlp.up_proj"),
        ("model.embed", "model.embed_tokens"),
    ],
)
def test_unknown_key_lists_nearest_module_names(key, nearest):
    with pytest.raises(ValueError, match="names no module of this model; nearest valid names") as info:
        expand_device_map({"": "cpu", key: 0}, param_names(2))
    message = str(info.value)
    assert repr(key) in message
    listed = message.split("nearest valid names: ")[1].rstrip(".").split(", ")
    assert nearest in listed and len(listed) <= 3


def test_uncovered_parameters_are_named_collapsed():
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0}
    expected = "device_map gives no device for model.layers.2-5, model.norm, lm_head;"
    with pytest.raises(ValueError, match=re.escape(expected)):
        expand_device_map(device_map, param_names(6))


def test_partly_covered_layer_names_the_missing_submodules():
    device_map = {"model.embed_tokens": 0, "model.layers.0.self_attn": 0, "model.layers.0.mlp": 0}
    device_map |= {"model.norm": 0, "lm_head": 0}
    message = "no device for model.layers.0.input_layernorm, model.layers.0.post_attention_layernorm;"
    with pytest.raises(ValueError, match=re.escape(message)):
        expand_device_map(device_map, param_names(1))


def test_unknown_device_in_map_is_rejected():
    with pytest.raises(
        ValueError, match=r"device_map\['model.norm'\] = 'gpu' is not a valid device; use an int N"
    ):
        expand_device_map({"": "cpu", "model.norm": "gpu"}, param_names(2))


def test_non_string_key_is_rejected():
    with pytest.raises(ValueError, match="device_map key 0 is not a string"):
        expand_device_map({0: "cpu"}, param_names(1))


# ---------------------------------------------------------------- devices and memory sizes


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, "cuda:0"),
        (3, "cuda:3"),
        ("cuda", "cuda:0"),
        ("cuda:2", "cuda:2"),
        ("CUDA:1", "cuda:1"),
        ("1", "cuda:1"),
        ("mps", "mps"),
        ("cpu", "cpu"),
        ("disk", "disk"),
    ],
)
def test_normalize_device(value, expected):
    assert normalize_device(value) == expected


def test_normalize_torch_device():
    torch = pytest.importorskip("torch")
    assert normalize_device(torch.device("cpu")) == "cpu"
    assert normalize_device(torch.device("cuda", 1)) == "cuda:1"
    assert normalize_device(torch.device("cuda")) == "cuda:0"


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "cuda:-1", "mps:1", "", -1, True, None, 1.5])
def test_normalize_device_rejects(value):
    with pytest.raises(
        ValueError, match=re.escape(f"device {value!r} is not a valid device; use an int N, 'cuda'")
    ):
        normalize_device(value)


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0),
        (1234, 1234),
        ("1234", 1234),
        ("10B", 10),
        ("1KB", 1000),
        ("1kb", 1000),
        ("1KiB", 1024),
        ("300MB", 300 * 10**6),
        ("300 MB", 300 * 10**6),
        ("2mib", 2 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("1.5 GB", 1_500_000_000),
        ("0.1GB", 100_000_000),
        ("20GiB", 20 * 2**30),
        ("2TB", 2 * 10**12),
        ("1TiB", 2**40),
        (".5KB", 500),
        ("8.2MB", 8_200_000),  # exact decimal arithmetic, not float
        ("1.0000000001KiB", 1024),
    ],
)
def test_parse_memory(value, expected):
    assert parse_memory(value) == expected


@pytest.mark.parametrize("value", ["-1GB", -5, "abc", "GB", "1.5XB", "1 G B", "", "1e9", True, 1.5, None])
def test_parse_memory_rejects(value):
    with pytest.raises(
        ValueError, match=re.escape(f"memory size {value!r} is not valid; give bytes as an int")
    ):
        parse_memory(value)


def test_parse_max_memory_normalizes_devices():
    budgets = parse_max_memory({0: "20GiB", "cuda:1": 1000, "CPU": "8GB"})
    assert budgets == {"cuda:0": 20 * 2**30, "cuda:1": 1000, "cpu": 8 * 10**9}


@pytest.mark.parametrize(
    "max_memory, message",
    [
        ({0: "1GB", "cuda:0": "2GB"}, "max_memory names device cuda:0 twice (again as 'cuda:0')"),
        ({"disk": "1GB"}, "max_memory key 'disk' is not allowed: disk is unlimited"),
        ({"gpu": "1GB"}, "max_memory key 'gpu' is not a valid device"),
        ({"cpu": "lots"}, "max_memory['cpu'] = 'lots' is not valid; give bytes"),
        ("cpu=1GB", "max_memory 'cpu=1GB' is not a dict"),
    ],
)
def test_parse_max_memory_rejects(max_memory, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_max_memory(max_memory)


def test_parse_max_memory_arg():
    assert parse_max_memory_arg("cpu=2GiB,0=20GiB") == {"cpu": 2 * 2**30, "cuda:0": 20 * 2**30}
    assert parse_max_memory_arg(" cuda:1 = 5MB ") == {"cuda:1": 5 * 10**6}
    for bad in ["cpu", "cpu=", "=1GB", "cpu=1GB,,0=1GB", ""]:
        with pytest.raises(ValueError, match="is not DEVICE=SIZE; write e.g. 'cpu=2GiB,0=20GiB'"):
            parse_max_memory_arg(bad)
    with pytest.raises(ValueError, match="names device cpu twice"):
        parse_max_memory_arg("cpu=1GB,cpu=2GB")


# ---------------------------------------------------------------- module_map and reading maps


def test_module_map_collapses_uniform_layers_to_hf_shape():
    collapsed = module_map(expand_device_map(SEED_MAP, param_names(2)))
    assert collapsed == {
        "model.embed_tokens": "cuda:0",
        "model.layers.0": "cuda:0",
        "model.layers.1": "cpu",
        "model.norm": "cpu",
        "lm_head": "cuda:0",
    }
    assert list(collapsed) == units(2)


def test_module_map_is_never_coarser_than_a_layer():
    collapsed = module_map(expand_device_map({"": "cpu"}, param_names(3)))
    assert collapsed == dict.fromkeys(units(3), "cpu")


def test_module_map_splits_a_mixed_layer_and_keeps_model_order():
    expanded = expand_device_map(
        {"": 0, "model.layers.1.mlp": "disk", "model.layers.1.mlp.up_proj": "cpu"}, param_names(3)
    )
    shuffled = dict(reversed(list(expanded.items())))  # order comes from the names, not the dict
    assert list(module_map(shuffled).items()) == [
        ("model.embed_tokens", "cuda:0"),
        ("model.layers.0", "cuda:0"),
        ("model.layers.1.post_attention_layernorm", "cuda:0"),
        ("model.layers.1.input_layernorm", "cuda:0"),
        ("model.layers.1.mlp.down_proj", "disk"),
        ("model.layers.1.mlp.up_proj", "cpu"),
        ("model.layers.1.mlp.gate_proj", "disk"),
        ("model.layers.1.self_attn", "cuda:0"),
        ("model.layers.2", "cuda:0"),
        ("model.norm", "cuda:0"),
        ("lm_head", "cuda:0"),
    ]


def test_execution_device_is_first_accelerator_else_cpu():
    assert execution_device({"model.layers.0": "cpu", "model.layers.1": 2, "lm_head": "cuda:1"}) == "cuda:1"
    assert execution_device({"model.layers.0": "cuda:10", "model.layers.1": "cuda:9"}) == "cuda:9"
    assert execution_device({"": "mps", "lm_head": "disk"}) == "mps"
    assert execution_device({"": "cpu", "model.layers.1": "disk"}) == "cpu"
    assert execution_device({}) == "cpu"


def test_offloaded_modules_in_model_order():
    mapping = {"lm_head": "disk", "model.layers.1": "cpu", "model.norm": "cpu", "model.layers.0": 0}
    mapping |= {"model.embed_tokens": 0, "model.layers.2": "disk"}
    assert offloaded_modules(mapping) == {
        "cpu": ["model.layers.1", "model.norm"],
        "disk": ["model.layers.2", "lm_head"],
    }


def test_all_cpu_map_is_not_offload():
    assert offloaded_modules(dict.fromkeys(units(2), "cpu")) == {"cpu": [], "disk": []}
    assert offloaded_modules({"": "cpu", "model.layers.1": "disk"}) == {"cpu": [], "disk": ["model.layers.1"]}


@pytest.mark.parametrize(
    "names, expected",
    [
        ([f"model.layers.{i}" for i in range(15, 30)] + ["model.norm"], "model.layers.15-29, model.norm"),
        (["model.layers.1"], "model.layers.1"),
        (["model.layers.1", "model.layers.3", "model.layers.4"], "model.layers.1, model.layers.3-4"),
        (
            ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"],
            "model.embed_tokens, model.layers.0-1, lm_head",
        ),
        (
            ["model.layers.2", "model.layers.2.mlp", "model.layers.3"],
            "model.layers.2, model.layers.2.mlp, model.layers.3",
        ),
        ([], ""),
    ],
)
def test_format_modules(names, expected):
    assert format_modules(names) == expected


# ---------------------------------------------------------------- infer_device_map


def test_everything_fits_on_cpu():
    mapping = infer_device_map(param_bytes(4), {"cpu": "1GB"})
    assert mapping == dict.fromkeys(units(4), "cpu")
    assert list(mapping) == units(4)


def test_cpu_budget_sends_later_layers_to_disk():
    sizes = param_bytes(4, embed=10 * 10**6, layer=100 * 10**6, norm=1000, head=10 * 10**6)
    # 300MB less the streamed layer (100MB) leaves 200MB: the embedding and one layer.
    mapping = infer_device_map(sizes, {"cpu": "300MB"})
    placed(mapping, ("cpu", units(4)[:2]), ("disk", units(4)[2:]))
    assert offloaded_modules(mapping)["disk"] == units(4)[2:]


def test_reserve_bytes_keeps_room_for_the_kv_cache():
    placed(
        infer_device_map(param_bytes(4), {"cpu": 2500}, reserve_bytes=300),
        ("cpu", units(4)[:2]),
        ("disk", units(4)[2:]),
    )
    placed(
        infer_device_map(param_bytes(4), {"cpu": 2500}, reserve_bytes=500),
        ("cpu", units(4)[:1]),
        ("disk", units(4)[1:]),
    )


def test_accelerator_then_cpu_then_disk():
    mapping = infer_device_map(param_bytes(4), {0: 2500, "cpu": 2000})
    # cuda:0 keeps 1000 B for the streamed layer; cpu fills to its budget; the rest is read from disk.
    names = units(4)
    placed(mapping, ("cuda:0", names[:2]), ("cpu", names[2:4]), ("disk", names[4:]))
    assert execution_device(mapping) == "cuda:0"
    assert offloaded_modules(mapping) == {"cpu": names[2:4], "disk": names[4:]}


def test_absent_devices_get_no_memory():
    mapping = infer_device_map(param_bytes(2), {"cpu": 1500})
    assert "cuda:0" not in mapping.values()
    placed(mapping, ("cpu", units(2)[:1]), ("disk", units(2)[1:]))


def test_balanced_spreads_layers_over_two_accelerators():
    names = units(4)
    budgets = {0: 10_000, 1: 10_000, "cpu": 10_000}
    placed(
        infer_device_map(param_bytes(4), budgets, "balanced"), ("cuda:0", names[:3]), ("cuda:1", names[3:])
    )
    assert infer_device_map(param_bytes(4), budgets, "sequential") == dict.fromkeys(names, "cuda:0")
    assert infer_device_map(param_bytes(4), budgets, "auto") == dict.fromkeys(names, "cuda:0")


def test_balanced_falls_back_to_filling_when_an_even_split_does_not_fit():
    names = units(4)
    mapping = infer_device_map(param_bytes(4), {0: 1500, 1: 10_000}, "balanced")
    placed(mapping, ("cuda:0", names[:2]), ("cuda:1", names[2:]))


def test_tied_lm_head_stays_with_embeddings_and_is_counted_once():
    tied = [("lm_head.weight", "model.embed_tokens.weight")]
    sizes = param_bytes(4)  # embed 100 + 4 layers + norm 10 = 4110 without the tied head
    assert infer_device_map(sizes, {"cpu": 4110}, tied=tied) == dict.fromkeys(units(4), "cpu")
    untied = infer_device_map(sizes, {"cpu": 4110})
    assert untied["lm_head"] == "disk"
    mapping = infer_device_map(param_bytes(4, head=0), {"cpu": 2500}, tied=tied)
    placed(
        mapping,
        ("cpu", ["model.embed_tokens", "model.layers.0"]),
        ("disk", units(4)[2:-1]),
        ("cpu", ["lm_head"]),
    )


def test_budget_too_small_for_the_streamed_layer():
    sizes = param_bytes(2, embed=100_000, layer=3_200_000, norm=1000, head=100_000)
    expected = (
        "max_memory['cpu'] = 1.0 MB is too small: the streamed layer model.layers.0 (3.2 MB) "
        "plus the KV cache (500.0 KB) must fit there."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        infer_device_map(sizes, {"cpu": "1MB"}, reserve_bytes=500_000)
    with pytest.raises(ValueError, match=re.escape("max_memory['cuda:0'] = 1.0 MB is too small")):
        infer_device_map(sizes, {0: "1MB", "cpu": "1GB"})


def test_accelerator_with_room_for_nothing_but_the_stream_is_dropped():
    # cuda:0 could hold only the streamed layer, so the cpu executes and keeps that room itself.
    mapping = infer_device_map(param_bytes(4), {0: 1000, "cpu": 4000})
    placed(mapping, ("cpu", units(4)[:3]), ("disk", units(4)[3:]))
    assert infer_device_map(param_bytes(4), {0: 1000, "cpu": 10_000}) == dict.fromkeys(units(4), "cpu")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"strategy": "greedy"},
            "device map strategy 'greedy' is not valid; use one of auto, balanced, sequential.",
        ),
        ({"reserve_bytes": -1}, "reserve_bytes -1 is not valid"),
        ({"tied": [("lm_head.wieght", "model.embed.weight")]}, "names no parameter in param_bytes"),
    ],
)
def test_infer_device_map_rejects(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        infer_device_map(param_bytes(1), {"cpu": "1GB"}, **kwargs)


def test_infer_device_map_rejects_bad_sizes():
    with pytest.raises(ValueError, match=re.escape("param_bytes['lm_head.weight'] = -4 is not a byte count")):
        infer_device_map(param_bytes(1) | {"lm_head.weight": -4}, {"cpu": "1GB"})


def test_no_max_memory_uses_available_memory(monkeypatch):
    assert dm.available_memory()["cpu"] > 0
    monkeypatch.setattr(dm, "available_memory", lambda limit=None: {"cpu": 2500})
    placed(infer_device_map(param_bytes(4), None), ("cpu", units(4)[:2]), ("disk", units(4)[2:]))


def test_matches_accelerate_on_cpu_and_disk():
    accelerate = pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    layer = sum(size for name, size in sizes.items() if name.startswith("model.layers.0."))
    for budget in (3 * layer + 10_000, 5 * layer, 10**9):
        theirs = accelerate.infer_auto_device_map(
            model, max_memory={"cpu": budget}, no_split_module_classes=["LlamaDecoderLayer"]
        )
        ours = infer_device_map(sizes, {"cpu": budget})
        assert expand_device_map(ours, list(sizes)) == expand_device_map(theirs, list(sizes)), budget
