"""Placement: cpu and disk offload give exactly the resident tokens; offload folders; bad maps."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from agreement import assert_greedy_agrees, greedy
from conftest import SEED_MAP, write_tiny_checkpoint
from safetensors.torch import load_file

import tierlm

IDS = torch.tensor([[5, 17, 99, 230, 41, 7, 8]])
HALF_ON_DISK = {"": "cpu", "model.layers.1": "disk", "model.norm": "disk"}
ALL_BUT_EMBED_ON_DISK = {"": "disk", "model.embed_tokens": "cpu"}


def tokens(model, cache="static", ids=IDS, n=24):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, cache_implementation=cache).token_ids


def run(model, cache="static", ids=IDS, n=24):
    """Greedy tokens and their logits, for comparisons across kernels in bf16/int8/int4 (tests/agreement.py)."""
    return greedy(model, ids, max_new_tokens=n, min_new_tokens=n, cache_implementation=cache)


@pytest.fixture(scope="module")
def resident(tiny_checkpoints):
    return {
        fam: tokens(tierlm.load(tiny_checkpoints[fam], dtype="float32")) for fam in ("llama", "llama_tied")
    }


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("family", ["llama", "llama_tied"])
@pytest.mark.parametrize(
    "device_map, kwargs",
    [
        (HALF_ON_DISK, {}),
        (ALL_BUT_EMBED_ON_DISK, {}),
        (SEED_MAP, {"execution_device": "cpu"}),  # the cpu-offload path a GPU would use, run on the CPU
    ],
    ids=["half-disk", "all-but-embed-disk", "cpu-offload-forced"],
)
def test_offload_matches_resident(tiny_checkpoints, resident, family, cache, device_map, kwargs, tmp_path):
    model = tierlm.load(
        tiny_checkpoints[family], dtype="float32", device_map=device_map, offload_folder=tmp_path, **kwargs
    )
    assert model.streamer is not None and model.streamer.units
    assert tokens(model, cache) == resident[family]
    assert (
        model.streamer.fetches > 0 and model.streamer.prefetched > 0
    )  # weights really streamed, ahead of use


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize(
    "device_map, kwargs",
    [
        (HALF_ON_DISK, {}),
        ({"": "disk", "model.embed_tokens": "cpu"}, {}),
        (SEED_MAP, {"execution_device": "cpu"}),
    ],
    ids=["half-disk", "all-but-embed-disk", "cpu-offload-forced"],
)
def test_quantized_offload_matches_quantized_resident(tiny_checkpoints, mode, device_map, kwargs, tmp_path):
    from tierlm.quant import Int4Linear, Int8Linear

    path = tiny_checkpoints["llama"]
    load = dict(dtype="bfloat16", quantize=mode, group_size=32 if mode == "int4" else None)
    expected = run(tierlm.load(path, **load))  # fused projections; offloaded units are not fused
    model = tierlm.load(path, **load, device_map=device_map, offload_folder=tmp_path, **kwargs)
    kind = Int8Linear if mode == "int8" else Int4Linear
    offloaded = [u.name for u in model.streamer.units]
    streamed = [
        n for n, m in model.decoder.named_modules() if isinstance(m, kind) and n.startswith(tuple(offloaded))
    ]
    assert streamed, "no packed linear is streamed"
    streamed_run = run(model)
    assert_greedy_agrees(expected, streamed_run, mode)
    assert_greedy_agrees(expected, run(model, "dynamic"), mode)
    assert model.streamer.fetches > 0 and model.streamer.prefetched > 0
    if any(u.tier == "disk" for u in model.streamer.units):  # the packed folder is reused, not rewritten
        (folder,) = [p for p in tmp_path.iterdir() if f"-{mode}-g" in p.name and p.name.endswith("-cpu")]
        stamp = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
        stored = [k for f in folder.glob("*.safetensors") for k in load_file(f)]  # valid safetensors
        assert any(k.endswith(("weight_int8", "weight_int4")) for k in stored)
        again = tierlm.load(path, **load, device_map=device_map, offload_folder=tmp_path, **kwargs)
        assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == stamp
        assert tokens(again) == streamed_run.tokens  # the same kernels on the same placement: exact


def test_auto_map_with_small_budget_goes_to_disk(tmp_path):
    # Wide layers (1.6 MB each) so that a budget can hold the KV reserve, one streamed layer and a little more.
    path = write_tiny_checkpoint(
        tmp_path / "wide", "llama", {"intermediate_size": 2048, "num_hidden_layers": 4}
    )
    expected = tokens(tierlm.load(path, dtype="float32"))
    model = tierlm.load(path, dtype="float32", device_map="auto", max_memory={"cpu": "4.5MB"})
    assert model.device_map["model.embed_tokens"] == "cpu" and model.device_map["model.layers.3"] == "disk"
    assert model.placement.drop_disk_pages
    for cache in ("static", "dynamic"):
        assert tokens(model, cache) == expected
    budget_only = tierlm.load(path, dtype="float32", max_memory={"cpu": "4.5MB"})  # implies "auto"
    assert budget_only.device_map == model.device_map


def _fused_owners(model) -> set[str]:
    return {n for n, m in model.decoder.named_modules() if getattr(m, "fused", None) is not None}


def _main_tensor(module) -> torch.Tensor:
    """A projection's weight: float, int8 codes or packed int4."""
    for name in ("weight_int4", "weight_int8", "weight"):
        if hasattr(module, name):
            return getattr(module, name)
    raise AssertionError(f"no weight on {module}")


@pytest.mark.parametrize(
    "family, mode", [("llama", "bfloat16"), ("qwen2", "bfloat16"), ("llama", "int8"), ("llama", "int4")]
)
def test_streamed_projections_fuse_from_a_file_like_resident_ones(tiny_checkpoints, family, mode, tmp_path):
    """On a CPU, disk layers fuse q/k/v and gate/up as resident layers do: the fused tensors are
    memory-mapped from a file written once beside the offload folders, each projection a view of its rows
    there (qwen2: the q/k/v biases too); tokens agree with the resident model's; pages already mapped are
    used in place, with no prefetch left pending; a second load maps the same file, not a new one."""
    from tierlm.weights.files import file_mappings

    path = tiny_checkpoints[family]
    load = (
        dict(dtype="bfloat16")
        if mode == "bfloat16"
        else dict(dtype="bfloat16", quantize=mode, group_size=32 if mode == "int4" else None)
    )
    resident = tierlm.load(path, **load)
    model = tierlm.load(path, **load, device_map=ALL_BUT_EMBED_ON_DISK, offload_folder=tmp_path)
    owners = _fused_owners(model)
    assert owners == _fused_owners(resident) and owners  # int4: k/v of 32 rows leave attention unfused
    maps = [(a, b, p) for a, b, _, p in file_mappings() if p.parent.name.endswith("-fused")]
    assert owners == {name for name, _ in model.plan.streamed_fusion}  # what the plan says, no more
    for name, projections in model.plan.streamed_fusion:
        owner = model.decoder.get_submodule(name)
        fused = owner.fused
        held = _main_tensor(fused.packed) if fused.packed is not None else fused.weight
        address = held.data_ptr()
        assert any(a <= address < b and p.parent.parent == tmp_path for a, b, p in maps), name
        for part in projections:
            view = _main_tensor(getattr(owner, part))
            assert view.untyped_storage().data_ptr() == held.untyped_storage().data_ptr(), name
            if family == "qwen2" and name.endswith("self_attn"):
                bias = getattr(owner, part).bias
                assert bias.untyped_storage().data_ptr() == fused.bias.untyped_storage().data_ptr()
    streamed = run(model)
    assert_greedy_agrees(run(resident), streamed, mode)
    assert model.streamer.fetches > 0 and model.streamer.prefetched == model.streamer.fetches - 1
    assert not model.streamer.pending  # every unit mapped since the first step: no thread woken for nothing
    (folder,) = [p for p in tmp_path.iterdir() if p.name.endswith("-fused")]
    stamp = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    again = tierlm.load(path, **load, device_map=ALL_BUT_EMBED_ON_DISK, offload_folder=tmp_path)
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == stamp  # reused, not rewritten
    assert tokens(again) == streamed.tokens  # the same file, the same kernels: exact


def test_fused_streamed_layers_drop_their_pages_under_a_ram_budget(tiny_checkpoints, monkeypatch, tmp_path):
    """With a budget, every page a fused disk layer's forward reads is dropped after use, the fused int4
    scales and zeros (which no projection views) included."""
    from tierlm.placement.offload import Streamer

    dropped = set()
    real = Streamer._drop_pages
    monkeypatch.setattr(Streamer, "_drop_pages", lambda self, t: (dropped.add(t.data_ptr()), real(self, t)))
    path = tiny_checkpoints["llama"]
    load = dict(dtype="bfloat16", quantize="int4", group_size=32)
    model = tierlm.load(path, **load, device_map=ALL_BUT_EMBED_ON_DISK, offload_folder=tmp_path)
    assert model.plan.streamed_fusion
    model.streamer.drop_disk_pages = (
        True  # what a max_memory budget sets (test_auto_map_with_small_budget_...)
    )
    assert_greedy_agrees(run(tierlm.load(path, **load)), run(model), "int4")
    for name, _ in model.plan.streamed_fusion:
        packed = model.decoder.get_submodule(name).fused.packed
        assert packed.weight_int4.data_ptr() in dropped and packed.scales_and_zeros.data_ptr() in dropped


def test_streamed_layers_stay_unfused_where_the_fused_file_cannot_be_written(
    tiny_checkpoints, monkeypatch, tmp_path
):
    import tierlm.placement.fused as fused

    def full_disk(file, tensors):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fused, "write_aligned", full_disk)
    path = tiny_checkpoints["llama"]
    with pytest.warns(UserWarning, match="streamed layers stay unfused .*No space left on device"):
        model = tierlm.load(path, dtype="bfloat16", device_map=ALL_BUT_EMBED_ON_DISK, offload_folder=tmp_path)
    assert model.plan.streamed_fusion and not _fused_owners(model)
    assert not [p for p in tmp_path.iterdir() if "-fused" in p.name]  # no half-written folder left
    assert_greedy_agrees(run(tierlm.load(path, dtype="bfloat16")), run(model), "bfloat16")


def test_resolved_map_has_hf_shape(tiny_checkpoints):
    model = tierlm.load(tiny_checkpoints["llama"], dtype="float32", device_map=HALF_ON_DISK)
    assert model.device_map == {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "disk",
        "lm_head": "cpu",
    }


def test_disk_offload_reads_checkpoint_files_when_dtype_and_layout_match(tiny_checkpoints, tmp_path):
    folder = tmp_path / "offload"
    tierlm.load(tiny_checkpoints["llama"], dtype="float32", device_map=HALF_ON_DISK, offload_folder=folder)
    # fp32 on CPU stores wide weights (out > in) transposed (tierlm/weights/layout.py): only those two are
    # written to the offload folder; every other disk weight maps straight from model.safetensors.
    (manifest,) = [json.loads(p.read_text()) for p in folder.glob("*/manifest.json")]
    wide = ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert manifest["tensors"] == manifest["transposed"] == wide
    bf16 = tmp_path / "bf16"
    tierlm.load(tiny_checkpoints["llama"], dtype="bfloat16", device_map=HALF_ON_DISK, offload_folder=bf16)
    # (beside it, bf16's fused q/k/v and gate/up: test_streamed_projections_fuse_from_a_file_like_resident_ones)
    (manifest,) = [json.loads(p.read_text()) for p in bf16.glob("*/manifest.json") if "-fused" not in str(p)]
    assert manifest["transposed"] == [] and "model.layers.1.mlp.down_proj.weight" in manifest["tensors"]


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_damaged_offload_folder_entry_is_rebuilt(tiny_checkpoints, tmp_path, damage):
    """Only its manifest was checked: a truncated or deleted weights file failed inside numpy ('mmap length
    is greater than file size') or safetensors on every later load. Its size is recorded and checked now."""
    path, folder = tiny_checkpoints["llama"], tmp_path / "offload"
    load = dict(dtype="bfloat16", device_map=HALF_ON_DISK, offload_folder=folder)
    expected = tokens(tierlm.load(path, **load))
    for weights in folder.glob("*/*.safetensors"):
        if damage == "truncated":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        else:
            weights.unlink()
    assert tokens(tierlm.load(path, **load)) == expected
    assert all(json.loads(m.read_text())["files"] for m in folder.glob("*/manifest.json"))


def test_fp32_cpu_stores_wide_weights_transposed_in_every_tier(tiny_checkpoints, tmp_path):
    """Same layout, hence the same sums, whether a wide weight is resident, on the cpu tier or on disk."""
    path = tiny_checkpoints["llama"]
    resident = tierlm.load(path, dtype="float32")
    offloaded = tierlm.load(path, dtype="float32", device_map=HALF_ON_DISK, offload_folder=tmp_path)
    for model in (resident, offloaded):
        layer = model.decoder.model.layers[1]
        assert layer.mlp.up_proj.weight.T.is_contiguous()  # [out, in] seen through .T of an [in, out]
        assert layer.mlp.down_proj.weight.is_contiguous()  # narrow: checkpoint layout
        assert layer.mlp.fused is None and layer.self_attn.fused is None
        assert model.decoder.lm_head.weight.T.is_contiguous()
    torch.testing.assert_close(
        offloaded.decoder.model.layers[1].mlp.up_proj.weight,
        resident.decoder.model.layers[1].mlp.up_proj.weight,
    )
    bf16 = tierlm.load(path, dtype="bfloat16")
    assert bf16.decoder.model.layers[1].mlp.up_proj.weight.is_contiguous()


def test_offload_folder_is_reused_and_rebuilt_on_dtype_change(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama"]
    kw = dict(device_map=HALF_ON_DISK, offload_folder=tmp_path)
    first = tierlm.load(path, dtype="bfloat16", **kw)
    (written,) = [p for p in tmp_path.iterdir() if not p.name.endswith("-fused")]
    weights = written / "weights.safetensors"
    stamp = weights.stat().st_mtime_ns
    bf16_run = run(first)
    second = tierlm.load(path, dtype="bfloat16", **kw)
    assert weights.stat().st_mtime_ns == stamp  # reused, not rewritten
    assert tokens(second) == bf16_run.tokens  # same placement, same kernels: exact
    assert_greedy_agrees(run(tierlm.load(path, dtype="bfloat16")), bf16_run, "bfloat16")  # resident is fused
    tierlm.load(path, dtype="float16", **kw)
    assert json.loads((written / "manifest.json").read_text())["dtype"] == "torch.float16"
    assert weights.stat().st_mtime_ns != stamp  # rebuilt for the new dtype


def test_interrupted_offload_write_is_never_trusted(tiny_checkpoints, tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal
        import tierlm.weights.gguf_cache as gc
        real = gc.write_safetensors
        def dying(path, shapes, dtype, tensors):
            def some():
                for i, item in enumerate(tensors):
                    if i == 3:
                        os.kill(os.getpid(), signal.SIGKILL)  # killed mid-write
                    yield item
            real(path, shapes, dtype, some())
        gc.write_safetensors = dying
        import tierlm
        tierlm.load({str(tiny_checkpoints["llama"])!r}, dtype="bfloat16",
                    device_map={HALF_ON_DISK!r}, offload_folder={str(tmp_path)!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -9
    leftovers = list(tmp_path.iterdir())
    assert leftovers and all(p.name.startswith(".") and ".tmp-" in p.name for p in leftovers)
    model = tierlm.load(
        tiny_checkpoints["llama"], dtype="bfloat16", device_map=HALF_ON_DISK, offload_folder=tmp_path
    )
    assert_greedy_agrees(
        run(tierlm.load(tiny_checkpoints["llama"], dtype="bfloat16")), run(model), "bfloat16"
    )


@pytest.mark.parametrize(
    "device_map, message",
    [
        ({"": "cpu", "model.layer.1": "disk"}, "model.layers.1"),  # nearest valid names listed
        ({"model.embed_tokens": "cpu", "model.layers.0": "cpu"}, "model.layers.1"),  # uncovered, named
        ({"": "gpu"}, "gpu"),
        ({"": "cpu", "lm_head": "disk"}, None),  # untied lm_head on disk is fine (control case)
    ],
)
def test_bad_maps_are_clear_errors(tiny_checkpoints, device_map, message, tmp_path):
    if message is None:
        tierlm.load(
            tiny_checkpoints["llama"], dtype="float32", device_map=device_map, offload_folder=tmp_path
        )
        return
    with pytest.raises(ValueError, match=message) as err:
        tierlm.load(tiny_checkpoints["llama"], dtype="float32", device_map=device_map)
    assert "\n" not in str(err.value)


def test_tied_weights_must_share_a_device(tiny_checkpoints):
    with pytest.raises(ValueError, match="tied"):
        tierlm.load(tiny_checkpoints["llama_tied"], device_map={"": "cpu", "lm_head": "disk"})


def test_unwritable_offload_folder(tiny_checkpoints, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="not writable"):
        tierlm.load(
            tiny_checkpoints["llama"], dtype="bfloat16", device_map=HALF_ON_DISK, offload_folder=blocker / "x"
        )


def test_max_memory_too_small_for_the_streamed_layer(tiny_checkpoints):
    with pytest.raises(ValueError, match="too small"):
        tierlm.load(tiny_checkpoints["llama"], device_map="auto", max_memory={"cpu": "10KB"})


@pytest.fixture(scope="module")
def default_resident():
    model = tierlm.load(dtype="float32")
    prompt = torch.tensor([model.tokenizer.encode("The three primary colors are")])
    return prompt, tokens(model, ids=prompt, n=16)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(
            device_map={
                "": "cpu",
                **{f"model.layers.{i}": "disk" for i in range(15, 30)},
                "model.norm": "disk",
            }
        ),
        dict(device_map={"": "disk", "model.embed_tokens": "cpu"}),
        dict(
            device_map={"": 0, **{f"model.layers.{i}": "cpu" for i in range(10, 30)}}, execution_device="cpu"
        ),
        dict(device_map="auto", max_memory={"cpu": "350MB"}),
    ],
    ids=["half-disk", "all-but-embed-disk", "cpu-offload-forced", "auto-350MB"],
)
def test_default_model_offload_matches_resident(default_resident, kwargs):
    prompt, expected = default_resident
    model = tierlm.load(dtype="float32", **kwargs)
    assert model.streamer is not None
    assert tokens(model, ids=prompt, n=16) == expected
    assert tokens(model, "dynamic", ids=prompt, n=16) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cpu_disk_map_matches_all_gpu(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama"]
    ref = tokens(tierlm.load(path, dtype="float32", device="cuda"))
    seed_disk = {**SEED_MAP, "model.norm": "disk"}
    model = tierlm.load(path, dtype="float32", device_map=seed_disk, offload_folder=tmp_path)
    assert model.device.type == "cuda"
    assert tokens(model) == ref
