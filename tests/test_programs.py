"""Eager decode steps as layer programs (tierlm.models.programs): the same logits as the module path, bit for
bit, for every family, precision and product path; streamed layers fetch their weights around their
programs, hooked layers stay modules."""

from __future__ import annotations

import pytest
import torch
from agreement import greedy
from conftest import SEED_MAP, write_tiny_checkpoint
from test_gemma3 import write_gemma3
from test_server import write_tokenizer

import tierlm
import tierlm.model
from tierlm import kernels
from tierlm.models import layers
from tierlm.models.linear import VECTOR_EAGER, VECTOR_KERNEL, Linear
from tierlm.models.programs import decode_programs
from tierlm.quant import Int4Linear, Int8Linear


@pytest.fixture(autouse=True)
def _attention_kernel():
    """Layer programs run where tierlm's CPU attention kernel is built (asked here, not at collection, which
    runs before conftest's session cache is set)."""
    if kernels.selected() is None:
        pytest.skip("layer programs run where tierlm's CPU attention kernel is built")


# Shapes whose int4 projections fuse (parts of a multiple of 64 rows) and suit every kernel
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
PROMPTS = [[5, 17, 99, 230, 41, 7, 8], [300, 12, 45], [9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("programs")
    paths = {f: write_tiny_checkpoint(root / f, f, WIDE) for f in ("llama", "qwen2", "qwen3", "mistral")}
    paths["gemma3"] = write_gemma3(root / "gemma3", "untied")  # sliding layers (rings) and full ones
    paths["gemma3 wide"] = write_gemma3(root / "gemma3 wide", "untied", **WIDE)  # int4 q/k/v fuse
    return paths


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Checkpoints with a tokenizer, as a continuous batch (which streams text) needs."""
    root = tmp_path_factory.mktemp("served_programs")
    paths = {f: write_tiny_checkpoint(root / f, f, WIDE) for f in ("llama", "qwen2", "qwen3")}
    for path in paths.values():
        write_tokenizer(path)
    return paths


STEPS = 9  # decode steps of a run: 10 new tokens, the first from the prefill


def with_and_without_programs(model, monkeypatch, rows: int, **overrides):
    """(greedy run through the layer programs, greedy run through the modules, the layers that have programs).
    Checks that each of those layers ran its program at every decode step."""
    built, calls = [], {}

    def counted(i, program):
        def run(*args):
            calls[i] = calls.get(i, 0) + 1
            return program(*args)

        return run

    def recording(*args):
        programs = decode_programs(*args)
        if programs is not None:
            programs.by_layer = [p if p is None else counted(i, p) for i, p in enumerate(programs.by_layer)]
            built.append([i for i, p in enumerate(programs.by_layer) if p is not None])
        return programs

    monkeypatch.setattr(tierlm.model, "decode_programs", recording)
    prompts = PROMPTS[:rows]
    fast = greedy(model, prompts, max_new_tokens=STEPS + 1, min_new_tokens=STEPS + 1, **overrides)
    monkeypatch.setattr(tierlm.model, "decode_programs", lambda *args: None)
    slow = greedy(model, prompts, max_new_tokens=STEPS + 1, min_new_tokens=STEPS + 1, **overrides)
    layers = built[0] if built else []
    assert len(built) <= 1 and calls == dict.fromkeys(layers, STEPS), (built, calls)
    return fast, slow, layers


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma3 wide"])
@pytest.mark.parametrize(
    "weights",
    [
        "float32",
        "bfloat16",
        "int8",
        "int4",
        "int8 float32",
        "int4 float32",
        "bfloat16 widened",
        "bfloat16 vector",
    ],
)
@pytest.mark.parametrize("rows", [1, 4])
def test_programs_give_the_module_paths_logits_bit_for_bit(checkpoints, monkeypatch, family, weights, rows):
    """The same products on the same tensors in the same order: every step's logits equal the module path's
    exactly, in every precision (float weights; int8, int4 weights with bf16 or fp32 activations; the
    fp32-widened decode products of a CPU without native bf16, for 4 rows; one-row products as torch.mv), and
    every layer runs its program at every step (Gemma 3's sliding layers too, over their ring)."""
    weights, _, path = weights.partition(" ")
    quantize = weights if weights in ("int8", "int4") else None
    dtype = "float32" if "float32" in (weights, path) else "bfloat16"
    model = tierlm.load(
        checkpoints[family], dtype=dtype, quantize=quantize, group_size=32 if quantize == "int4" else None
    )
    if path == "widened":
        model.decoder.widen_prefill(True)
    if path == "vector":  # torch.mv, not tierlm's bf16 kernel where load() chose it
        model.decoder.vector_products(eager=True, kernel=False)
    fast, slow, built = with_and_without_programs(model, monkeypatch, rows)
    decoder_layers = model.decoder.model.layers
    assert built == list(range(len(decoder_layers))), built
    if quantize == "int4":
        assert all(isinstance(layer.mlp.fused.packed, Int4Linear) for layer in decoder_layers)
    if quantize == "int8":
        assert all(isinstance(layer.mlp.fused.packed, Int8Linear) for layer in decoder_layers)
    assert fast.tokens == slow.tokens
    assert torch.equal(fast.logits, slow.logits)


@pytest.mark.parametrize(
    ("family", "weights", "rows"),
    [
        ("llama", "int4", 1),
        ("mistral", "int8", 4),
        ("llama", "bfloat16", 1),
        ("llama", "bfloat16", 4),  # 4 bf16 rows: F.linear, not a kernel
        ("llama", "int4 float32", 1),  # fp32 activations: aten's norms
        ("qwen2", "int4", 1),  # q/k/v biases
        ("qwen2", "bfloat16", 1),  # biases inside the bf16 kernel's one rounding
        ("qwen3", "int8", 1),  # q/k norms
        ("gemma3 wide", "int4", 1),  # Gemma's four norms, q/k norms, GeGLU and sliding layers' rings
        ("gemma3 wide", "bfloat16", 1),
        ("gemma3", "int4", 1),  # q/k/v products of 32 rows: three int4 products, not one
    ],
)
def test_a_layer_is_one_kernel_call_where_each_of_its_ops_is_a_kernel(
    checkpoints, monkeypatch, family, weights, rows
):
    """kernels' layer_step runs a whole layer step (its Python program's ops, from C++) exactly where every
    product is one of tierlm's int4, int8 or one-row bf16 kernel (q/k/v biases too; fused q/k/v and gate/up)
    and every norm its norm kernel (q/k norms, Gemma's four norms too); the logits stay the module path's, bit
    for bit."""
    weights, _, activations = weights.partition(" ")
    quantize = weights if weights in ("int8", "int4") else None
    model = tierlm.load(
        checkpoints[family],
        dtype=activations or "bfloat16",
        quantize=quantize,
        group_size=32 if quantize == "int4" else None,
    )
    names = []

    def recording(*args):
        programs = decode_programs(*args)
        names.extend(p.__qualname__ for p in programs.by_layer)
        return programs

    monkeypatch.setattr(tierlm.model, "decode_programs", recording)
    fast = greedy(model, PROMPTS[:rows], max_new_tokens=STEPS + 1, min_new_tokens=STEPS + 1)
    monkeypatch.setattr(tierlm.model, "decode_programs", lambda *args: None)
    slow = greedy(model, PROMPTS[:rows], max_new_tokens=STEPS + 1, min_new_tokens=STEPS + 1)
    kernel_products = {
        "int4": kernels.int4_block() is not None,
        "int8": True,
        "bfloat16": rows == 1 and bool(model.decoder.model.layers[0].self_attn.vector & VECTOR_KERNEL),
    }[weights]
    native = family != "gemma3" and not activations and kernel_products  # "gemma3": unfused q/k/v
    assert names and set(names) == {
        "_native.<locals>.program" if native else "layer_program.<locals>.program"
    }
    assert torch.equal(fast.logits, slow.logits)


@pytest.mark.parametrize("kind", ["Linear", "Int8Linear", "Int4Linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_a_product_is_its_modules_forward(kind, dtype, rows, bias):
    """`product(rows, dtype)` computes what `forward` computes on [rows, 1, in], bit for bit, for each choice
    of kernel the module makes (a float Linear's widened, torch.mv and bf16-kernel products included)."""
    torch.manual_seed(rows)
    linear = Linear(128, 256, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        if bias:
            linear.bias.normal_(0, 0.5)
    linear = linear.to(dtype)
    modules = {"plain": linear}
    if kind == "Linear":
        # F.linear, widened to fp32, torch.mv, tierlm's bf16 kernel (where built): the `vector` flags
        flags = {"plain": 0, "widened": 0, "vector": VECTOR_EAGER}
        if kernels.bf16_vector_product() is not None:
            flags["kernel"] = VECTOR_KERNEL
        for name, flag in flags.items():
            modules[name] = Linear(128, 256, bias=bias)
            modules[name].load_state_dict(linear.state_dict())
            modules[name].to(dtype)
            modules[name].vector = flag
        modules["widened"].widen = True
    elif kind == "Int8Linear":
        modules = {"plain": Int8Linear.from_linear(linear, dtype)}
    else:
        modules = {"plain": Int4Linear.from_linear(linear, 32, dtype)}
    x = torch.randn(rows, 1, 128).to(dtype)
    for name, module in modules.items():
        product = module.product(rows, dtype)
        assert product is not None, name
        assert torch.equal(product(x.view(rows, 128)), module(x).view(rows, 256)), name


@pytest.mark.parametrize("norm", [layers.RMSNorm, layers.GemmaRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [False, True])
def test_a_plain_norm_is_its_modules_forward(norm, dtype, weight_dtype, kernel):
    """`plain(dtype)` computes what `forward` computes, bit for bit, on rows and on a strided view of
    contiguous rows (a q/k norm's input), with the norm kernel on or off."""
    module = norm(64, 1e-6)
    with torch.no_grad():
        module.weight.uniform_(-0.5, 1.5)
    module = module.to(weight_dtype)
    module.kernel = kernel
    x = torch.randn(3, 3 * 64).to(dtype)
    for rows in (x[:, :64].contiguous(), x.view(3, 3, 64)[:, 1:]):
        assert torch.equal(module.plain(dtype)(rows), module(rows))


@pytest.mark.parametrize("tier", ["disk", "cpu"])
def test_streamed_layers_fetch_their_weights_around_their_programs(checkpoints, tmp_path, monkeypatch, tier):
    """A layer on disk, whose memory-mapped weights a CPU uses in place, runs as a program that fetches and
    releases them around itself at every step. A layer mapped to "cpu" while the CPU executes (the seed's
    map), whose every fetch copies its weights, runs as a module through its hooks. Either way the tokens are
    the all-resident model's and the logits the module path's, bit for bit (fp32)."""
    resident = tierlm.load(checkpoints["llama"], dtype="float32")
    expected = greedy(resident, PROMPTS[:2], max_new_tokens=10, min_new_tokens=10)
    if tier == "disk":
        device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
        device_map.update({"model.norm": "cpu", "lm_head": "cpu"})
        model = tierlm.load(
            checkpoints["llama"], dtype="float32", device_map=device_map, offload_folder=tmp_path
        )
    else:
        model = tierlm.load(
            checkpoints["llama"], dtype="float32", device_map=SEED_MAP, execution_device="cpu"
        )
    layer = model.decoder.model.layers[1]
    assert [u.tier for u in model.streamer.units if u.name == "model.layers.1"] == [tier]
    hooks = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in layer.modules()]
    fetches = model.streamer.fetches
    fast, slow, built = with_and_without_programs(model, monkeypatch, 2)
    assert built == ([0, 1] if tier == "disk" else [0])
    # both runs fetched layer 1 at every step, the prefill's and the decode steps (and model.norm, on "cpu")
    assert model.streamer.fetches - fetches == 2 * 10 * len(model.streamer.units)
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in layer.modules()] == hooks
    assert fast.tokens == slow.tokens == expected.tokens
    assert torch.equal(fast.logits, slow.logits)


def test_a_streamed_layers_program_drops_its_pages_under_a_ram_budget(checkpoints, tmp_path, monkeypatch):
    """Under a RAM budget a disk layer's pages are dropped after each use; its program releases them too."""
    path = write_tiny_checkpoint(
        tmp_path / "deep", "llama", {**WIDE, "intermediate_size": 2048, "num_hidden_layers": 4}
    )
    # a budget that holds the KV cache reserve (4.2 MB), one streamed layer (3.3 MB) and layer 0
    model = tierlm.load(
        path, dtype="float32", device_map="auto", max_memory={"cpu": "12MB"}, offload_folder=tmp_path / "off"
    )
    streamer = model.streamer
    assert streamer.drop_disk_pages and {u.tier for u in streamer.units} == {"disk"}
    assert any(u.name.startswith("model.layers.") for u in streamer.units), model.device_map
    dropped = []
    monkeypatch.setattr(streamer, "_drop_pages", lambda t: dropped.append(t))
    fast, slow, built = with_and_without_programs(model, monkeypatch, 1)
    assert built == [0, 1, 2, 3]
    layer_units = [u for u in streamer.units if u.name.startswith("model.layers.")]
    assert len(dropped) >= 2 * 10 * sum(len(u.sources) for u in layer_units)
    assert torch.equal(fast.logits, slow.logits)


@pytest.mark.parametrize("where", ["mlp", "fused int8 product"])
def test_a_hooked_layer_runs_as_a_module(checkpoints, monkeypatch, where):
    """A forward hook on a layer, on a module under it or on a fused product's linear (which is no module of
    the layer) still runs: that layer has no program."""
    model = tierlm.load(checkpoints["llama"], dtype="bfloat16", quantize="int8")
    layer = model.decoder.model.layers[1]
    calls = []
    hooked = layer.mlp if where == "mlp" else layer.mlp.fused.packed
    handle = hooked.register_forward_hook(lambda *_: calls.append(1))
    try:
        fast, slow, built = with_and_without_programs(model, monkeypatch, 1)
    finally:
        handle.remove()
    assert built == [0]
    assert len(calls) == 2 * (1 + STEPS)  # each run: the prefill and every decode step through the module
    assert torch.equal(fast.logits, slow.logits)


def test_programs_run_over_their_own_static_cache_only(checkpoints):
    """No programs for a dynamic cache or a compiled continuous batch's slots (each row written at its own
    slot in the step); an eager continuous batch's slots have them (the step writes one scratch column); a
    forward given programs with another cache is an error, not a write into the wrong cache."""
    from tierlm.cache import DynamicCache
    from tierlm.generation.slots import SlotCache

    model = tierlm.load(checkpoints["llama"], dtype="bfloat16")
    decoder, cfg = model.decoder, model.config
    assert decode_programs(decoder, DynamicCache(cfg, 1, "cpu")) is None
    assert decode_programs(decoder, SlotCache(model.static_cache(2, 64), 2)) is None
    eager = decode_programs(decoder, SlotCache(model.static_cache(2, 64), 2, eager=True))
    assert eager is not None and eager.layers == 2 and eager.rows == 2
    programs = decode_programs(decoder, model.static_cache(1, 64))
    assert programs is not None and programs.layers == 2
    other = model.static_cache(1, 128)
    model.decoder.ensure_rope(128, "cpu")
    with pytest.raises(ValueError, match="the cache they were made for"):
        decoder(
            torch.tensor([[5]]),
            positions=torch.tensor([[0]]),
            cache=other,
            slots=torch.tensor([0]),
            programs=programs,
        )


def test_the_default_model_decodes_through_programs_bit_for_bit(default_model_path, monkeypatch):
    """The default model as `tierlm.load` reads it on this CPU (its default dtype and packed weights): all
    30 layers run as programs, with the module path's logits exactly."""
    model = tierlm.load(default_model_path)
    fast, slow, built = with_and_without_programs(model, monkeypatch, 1)
    assert built == list(range(30))
    assert torch.equal(fast.logits, slow.logits)


def continuous(
    model, prompts, new_tokens: int, rows: int = 4
) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens and their log probabilities per prompt from an eager continuous batch (SlotBatch) of
    `rows` rows that the prompts join one at a time, each once the one before it decodes (so each is
    prefilled alone and decodes beside the others: steps of 1 to len(prompts) rows); and the decode steps."""
    from tierlm.generation.config import GenerationConfig
    from tierlm.generation.continuous import Sequence, SlotBatch

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, logprobs=0)
    batch = SlotBatch(model, rows, config)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    values: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    waiting = list(enumerate(prompts))
    while waiting or batch.busy:
        if waiting and not batch.waiting:
            key, prompt = waiting.pop(0)
            batch.join(Sequence(key, list(prompt), config))
        for u in batch.advance():
            if u.token is not None:
                tokens[u.key].append(u.token)
                values[u.key].append(u.logprob.logprob)
    assert not batch.decision.compile
    return list(tokens.values()), list(values.values()), batch.stats["decode_steps"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int4", "int8 float32"])
def test_a_continuous_batch_decodes_through_programs_bit_for_bit(served, monkeypatch, family, weights):
    """An eager continuous batch's steps write this step's K/V at a scratch column, as a static cache's step
    writes at its slot, so every layer runs its program at every decode step (rows joining and leaving:
    programs for each row count), and each row's tokens and log probabilities equal the module path's."""
    weights, _, activations = weights.partition(" ")
    quantize = weights if weights in ("int8", "int4") else None
    dtype = activations or ("float32" if weights == "float32" else "bfloat16")
    model = tierlm.load(
        served[family], dtype=dtype, quantize=quantize, group_size=32 if quantize == "int4" else None
    )
    layer_count = len(model.decoder.model.layers)
    calls: dict[int, int] = {}

    def recording(*args):
        programs = decode_programs(*args)
        assert programs is not None and programs.layers == layer_count
        programs.by_layer = [counted(i, p) for i, p in enumerate(programs.by_layer)]
        return programs

    def counted(i, program):
        def run(*args):
            calls[i] = calls.get(i, 0) + 1
            return program(*args)

        return run

    monkeypatch.setattr(tierlm.model, "decode_programs", recording)
    fast_tokens, fast_values, steps = continuous(model, PROMPTS, 12)
    assert steps > 12 and calls == dict.fromkeys(range(layer_count), steps)
    monkeypatch.setattr(tierlm.model, "decode_programs", lambda *args: None)
    slow_tokens, slow_values, _ = continuous(model, PROMPTS, 12)
    assert fast_tokens == slow_tokens
    assert fast_values == slow_values
    if dtype == "float32":  # and each row's own slots were written: its solo run's tokens
        assert fast_tokens == [
            greedy(model, [p], max_new_tokens=12, min_new_tokens=12).tokens[0] for p in PROMPTS
        ]


def test_a_continuous_row_gets_the_bits_of_its_generate_run(served):
    """bf16 activations, int4 weights: every product and the decode attention run on tierlm's kernels, which
    sum each row on its own and attend over a row's keys in their order wherever they sit, and a continuous
    step's rotary is the fused kernel's, as in generate's static steps (before this, a continuous step
    rotated through aten's bf16 ops, which round each product). So each row's log probabilities beside
    others in a continuous batch are exactly those of its own `generate` run."""
    if kernels.int4_block() is None:
        pytest.skip("tierlm's int4 kernel does not run here")
    model = tierlm.load(served["llama"], dtype="bfloat16", quantize="int4", group_size=32)
    tokens, values, _ = continuous(model, PROMPTS, 16)
    for prompt, got, logprobs in zip(PROMPTS, tokens, values):
        alone = model.generate([prompt], max_new_tokens=16, min_new_tokens=16, logprobs=0)
        assert got == alone.token_ids[0]
        assert logprobs == [lp.logprob for lp in alone.logprobs[0]]
