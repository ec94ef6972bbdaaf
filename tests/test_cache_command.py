"""`tierlm cache list | clear` on a real cache folder: entries with their sizes, a total, and a clear that
never removes what a live process is writing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_cache_temporaries import DISK_MAP, start_writer, write_tiny_gguf

import tierlm
from tierlm.cache_folder import tree_size
from tierlm.placement.device_map import format_bytes
from tierlm.weights import gguf_cache


def tierlm_cli(*args, cache: str):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TIERLM_CACHE_DIR": cache}
    return subprocess.run(
        [sys.executable, "-m", "tierlm.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.fixture
def cache(tmp_path, tiny_checkpoints, monkeypatch):
    """A cache folder filled by real loads (a GGUF's dequantized weights, a disk-offloaded checkpoint), some
    compiled kernels, a killed writer's temporary and a live writer's one."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(root))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    gguf_cache.ensure(gguf, torch.float32)
    tierlm.load(tiny_checkpoints["llama"], dtype="bfloat16", device_map=DISK_MAP)
    (root / "inductor" / "kernels").mkdir(parents=True)
    (root / "inductor" / "kernels" / "step.so").write_bytes(bytes(5000))
    target = root / "offload" / "0123456789abcdef0123"
    dead, (dead_tmp,) = start_writer(target)
    dead.kill()
    dead.wait()
    live, (live_tmp,) = start_writer(gguf_cache.cache_dir(gguf) / "weights-bfloat16.safetensors")
    yield root, dead_tmp, live_tmp, live.pid
    live.kill()
    live.wait()


def test_cache_list_shows_each_entry_with_its_size_and_the_total(cache, tiny_checkpoints):
    root, dead_tmp, live_tmp, live_pid = cache
    proc = tierlm_cli("cache", "list", cache=str(root))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"cache folder: {root}"
    (gguf,) = [line for line in lines if " gguf/" in line and ".tmp-" not in line]
    weights = next((root / "gguf").iterdir()) / "weights-float32.safetensors"
    assert f"tiny.gguf: weights float32 ({format_bytes(weights.stat().st_size)})" in gguf
    offload, fused = sorted(
        (line for line in lines if " offload/" in line and ".tmp-" not in line),
        key=lambda line: "fused" in line,
    )
    assert "bfloat16 weights of" in offload and str(tiny_checkpoints["llama"]) in offload
    assert (
        "bfloat16 fused projections of streamed layers: 2 groups" in fused
    )  # the disk layer's q/k/v, gate/up
    assert any(" inductor " in line and "5.0 KB" in line for line in lines)
    (killed,) = [line for line in lines if os.path.basename(dead_tmp) in line]
    assert "which is gone" in killed
    (writing,) = [line for line in lines if os.path.basename(live_tmp) in line]
    assert f"being written by process {live_pid}" in writing
    assert lines[-1].startswith(f"total: {format_bytes(tree_size(root))} in 6 entries (1 left by killed")
    assert "orphaned" not in proc.stdout  # every entry's source is still there


def test_cache_clear_stale_removes_only_what_killed_writers_left(cache):
    root, dead_tmp, live_tmp, _ = cache
    before = {p for p in root.rglob("*") if ".tmp-" not in str(p)}
    proc = tierlm_cli("cache", "clear", "--stale", cache=str(root))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"tierlm: removing {dead_tmp} ({format_bytes(13)})",
        f"tierlm: removed 1 entry ({format_bytes(13)}) from {root}; kept 1 entry still being written",
    ]
    assert not os.path.exists(dead_tmp) and os.path.exists(live_tmp)
    assert {p for p in root.rglob("*") if ".tmp-" not in str(p)} == before


def test_entries_made_from_files_that_are_gone_are_orphaned_and_cleared_as_stale(
    cache, tmp_path, tiny_checkpoints
):
    """A GGUF's dequantized weights and a checkpoint's offload folders outlive their sources in the cache;
    no load can use them again (each is keyed by its files' identity): list marks them, clear --stale
    removes them with what killed writers left, and nothing else."""
    import shutil

    root, _dead_tmp, live_tmp, _ = cache  # the offloaded load below removes the dead writer's
    copy = shutil.copytree(tiny_checkpoints["llama"], tmp_path / "copy")
    tierlm.load(copy, dtype="bfloat16", device_map=DISK_MAP)  # its converted and fused disk layers
    gone = write_tiny_gguf(tmp_path / "gone.gguf")
    gguf_cache.ensure(gone, torch.float32)
    made = {p for p in root.rglob("*") if ".tmp-" not in str(p)}
    shutil.rmtree(copy)
    gone.unlink()
    listing = tierlm_cli("cache", "list", cache=str(root)).stdout.splitlines()
    orphans = [line for line in listing if "; orphaned: " in line]
    assert len(orphans) == 3, listing  # the GGUF's folder, the converted and the fused offload folders
    assert sum(f"orphaned: {gone} is gone" in line for line in orphans) == 1
    assert sum(f"orphaned: {copy}" in line for line in orphans) == 2
    assert listing[-1].endswith("in 8 entries (3 orphaned: tierlm cache clear --stale removes them)")
    proc = tierlm_cli("cache", "clear", "--stale", cache=str(root))
    assert proc.returncode == 0 and "removed 3 entries" in proc.stderr, proc.stderr
    kept = {p for p in root.rglob("*") if ".tmp-" not in str(p)}
    assert kept < made and os.path.exists(live_tmp)
    listing = tierlm_cli("cache", "list", cache=str(root)).stdout.splitlines()
    assert listing[-1].startswith("total: ") and listing[-1].endswith(" in 5 entries"), listing


def test_an_entry_made_from_a_relative_path_is_not_orphaned_seen_from_elsewhere(tmp_path, tiny_checkpoints):
    """Sources are recorded resolved: a model loaded as `copy` from its parent folder still exists when `cache
    list` runs in another folder (clear --stale removed its usable offload folders); a manifest of the
    wrong shape is not judged, never a crash."""
    import shutil

    root = tmp_path / "cache"
    shutil.copytree(tiny_checkpoints["llama"], tmp_path / "copy")
    script = "import tierlm; tierlm.load('copy', dtype='bfloat16', device_map={'': 'cpu', 'model.layers.1': 'disk'})"
    env = {**os.environ, "TIERLM_CACHE_DIR": str(root)}
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True, timeout=300)
    odd = root / "offload" / "0123456789abcdef0123"
    odd.mkdir()
    (odd / "manifest.json").write_text('{"sources": 5, "files": {}}')
    listing = tierlm_cli("cache", "list", cache=str(root))  # run from this process's folder, not tmp_path
    assert listing.returncode == 0 and "orphaned" not in listing.stdout, listing.stdout + listing.stderr
    assert len([line for line in listing.stdout.splitlines() if " offload/" in line]) == 3


def test_cache_clear_removes_everything_but_a_live_writers_temporary(cache):
    root, dead_tmp, live_tmp, _ = cache
    proc = tierlm_cli("cache", "clear", cache=str(root))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("tierlm: removed 5 entries (")
    assert sum(line.startswith("tierlm: removing ") for line in proc.stderr.splitlines()) == 5
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert left == [os.path.relpath(live_tmp, root)]
    listing = tierlm_cli("cache", "list", cache=str(root)).stdout.splitlines()
    assert listing[-1] == f"total: {format_bytes(13)} in 1 entry"


def test_cache_list_of_a_missing_folder_says_so(tmp_path):
    proc = tierlm_cli("cache", "list", cache=str(tmp_path / "none"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"cache folder: {tmp_path / 'none'} (does not exist)",
        "total: 0 B in 0 entries",
    ]


def test_cache_clear_leaves_what_tierlm_did_not_write(tmp_path):
    """A cache folder set to a folder that holds other things: `clear` removes tierlm's entries only, and
    says what it left; `list` marks the others."""
    root = tmp_path / "mixed"
    (root / "inductor").mkdir(parents=True)
    (root / "inductor" / "step.so").write_bytes(bytes(100))
    (root / "notes.txt").write_text("important")
    (root / "sub").mkdir()
    (root / "sub" / "data.bin").write_bytes(bytes(10))
    listing = tierlm_cli("cache", "list", cache=str(root)).stdout.splitlines()
    assert sum("not tierlm's: cache clear leaves it" in line for line in listing) == 2
    proc = tierlm_cli("cache", "clear", cache=str(root))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"tierlm: removing {root / 'inductor'} ({format_bytes(100)})",
        f"tierlm: removed 1 entry ({format_bytes(100)}) from {root}; left 2 entries that tierlm did not write "
        "(notes.txt, ...)",
    ]
    assert (root / "notes.txt").read_text() == "important" and (root / "sub" / "data.bin").exists()
    assert not (root / "inductor").exists()


def test_a_cache_folder_that_is_a_file_is_an_error_for_clear(tmp_path):
    path = tmp_path / "afile"
    path.write_text("keep me")
    listing = tierlm_cli("cache", "list", cache=str(path))
    assert listing.stdout.splitlines()[0] == f"cache folder: {path} (a file, not a folder)"
    proc = tierlm_cli("cache", "clear", cache=str(path))
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"tierlm: error: the cache folder {path} is a file, not a folder (TIERLM_CACHE_DIR?)"
    ]
    assert path.read_text() == "keep me"


def test_cache_clear_leaves_a_users_files_and_links_under_tierlms_folder_names(tmp_path):
    """A cache folder set where models live (TIERLM_CACHE_DIR=~/models, with a gguf/ of the user's): only
    entries named as tierlm names them go; a symlink is never followed (clear emptied its target before)."""
    root, outside = tmp_path / "models", tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.gguf").write_bytes(bytes(64))
    (root / "gguf" / "project").mkdir(parents=True)
    (root / "gguf" / "my-llama.Q4_K_M.gguf").write_bytes(bytes(32))
    (root / "gguf" / "project" / "weights.bin").write_bytes(bytes(16))
    (root / "gguf" / "linked").symlink_to(outside)
    (root / "offload").mkdir()
    (root / "offload" / "0123456789abcdef0123").symlink_to(outside)  # a key's name, but a link
    ours = root / "gguf" / "0123456789abcdef0123"
    ours.mkdir()
    (ours / "config.json").write_text("{}")
    listing = tierlm_cli("cache", "list", cache=str(root)).stdout.splitlines()
    assert sum("not tierlm's: cache clear leaves it" in line for line in listing) == 4
    proc = tierlm_cli("cache", "clear", cache=str(root))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == f"tierlm: removing {ours} ({format_bytes(2)})"
    assert not ours.exists() and (outside / "keep.gguf").stat().st_size == 64
    assert (root / "gguf" / "my-llama.Q4_K_M.gguf").exists() and (
        root / "gguf" / "project" / "weights.bin"
    ).exists()
    assert (root / "gguf" / "linked").is_symlink() and (
        root / "offload" / "0123456789abcdef0123"
    ).is_symlink()


def test_a_load_in_progress_reads_on_when_another_process_clears_the_cache(tmp_path, monkeypatch):
    """A disk-mapped load maps its tensors one by one from the cached GGUF weights; `tierlm cache clear` in
    another process between two of them removed the file, and the next one failed (FileNotFoundError)."""
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    checkpoint = gguf_cache.ensure(write_tiny_gguf(tmp_path / "tiny.gguf"), torch.float32)
    (name,) = checkpoint.names()
    proc = tierlm_cli("cache", "clear", cache=str(tmp_path / "cache"))
    assert proc.returncode == 0 and "removed 1 entry" in proc.stderr, proc.stderr
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # the file is gone
    assert torch.equal(checkpoint.load_mapped(name), torch.ones(16, 8))
