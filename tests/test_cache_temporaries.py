"""Temporaries of a killed writer are removed by the next run; a live writer's never are (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

import tierlm
from tierlm.weights import gguf_cache
from tierlm.weights.temporaries import (
    OTHER_HOST_STALE_S,
    process_start,
    remove_stale_temporaries,
    temporary,
    this_host,
)

DISK_MAP = {"": "cpu", "model.layers.1": "disk"}


def write_tiny_gguf(path):
    """A one-tensor llama GGUF: enough for the dequantized-weights cache, not for a whole model."""
    writer = GGUFWriter(str(path), "llama")
    for add, value in [
        (writer.add_block_count, 1),
        (writer.add_embedding_length, 8),
        (writer.add_feed_forward_length, 16),
        (writer.add_head_count, 2),
        (writer.add_context_length, 64),
        (writer.add_layer_norm_rms_eps, 1e-5),
    ]:
        add(value)
    writer.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Makes temporaries for each target through tierlm's own naming, prints them, then waits to be killed.
WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tierlm.weights.temporaries import temporary
    for target in map(Path, sys.argv[1:]):
        tmp = temporary(target)
        if target.suffix:
            tmp.write_bytes(b"half a tensor")
        else:
            tmp.mkdir()
            (tmp / "weights.safetensors").write_bytes(b"half a tensor")
        print(tmp, flush=True)
    time.sleep(300)
    """
)


def start_writer(*targets) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, *map(str, targets)], stdout=subprocess.PIPE, text=True
    )
    return proc, [proc.stdout.readline().strip() for _ in targets]


@pytest.fixture
def writers(tmp_path):
    """Two writer processes with temporaries in a GGUF cache folder and in an offload folder: one killed
    with SIGKILL mid-write (its temporaries stay behind), one alive."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    targets = [
        gguf_cache.cache_dir(gguf) / "weights-float32.safetensors",
        tmp_path / "offload" / "0123456789abcdef0123",
    ]
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
    dead, dead_paths = start_writer(*targets)
    dead.kill()
    dead.wait()
    live, live_paths = start_writer(*targets)
    yield gguf, dead_paths, live_paths, dead.pid
    live.kill()
    live.wait()


def test_next_gguf_load_removes_a_killed_writers_temporaries_not_a_live_ones(writers, tmp_path):
    gguf, dead_paths, live_paths, dead_pid = writers
    legacy = gguf_cache.cache_dir(gguf) / f".weights-bfloat16.safetensors.{dead_pid}.tmp"  # tierlm <= 0.x
    legacy.write_bytes(b"half a tensor")
    cached = gguf_cache.ensure(gguf, torch.float32)
    assert torch.equal(cached.load("model.embed_tokens.weight"), torch.ones(16, 8))
    assert not os.path.exists(dead_paths[0]) and not legacy.exists()
    assert os.path.exists(live_paths[0])


def test_next_offloaded_load_removes_a_killed_writers_folder_not_a_live_ones(
    writers, tiny_checkpoints, tmp_path
):
    _, dead_paths, live_paths, _ = writers
    model = tierlm.load(
        tiny_checkpoints["llama"], dtype="bfloat16", device_map=DISK_MAP, offload_folder=tmp_path / "offload"
    )
    assert model.device_map["model.layers.1"] == "disk"
    assert not os.path.exists(dead_paths[1])
    assert os.path.exists(live_paths[1])


def test_an_offload_folder_keeps_a_users_files_that_look_like_a_dead_writers(
    writers, tiny_checkpoints, tmp_path
):
    """The offload folder is the user's to choose (their home, a project folder): only temporaries of names
    tierlm writes there go, never a file of theirs that happens to look like a killed writer's."""
    _, dead_paths, _, dead_pid = writers
    folder = tmp_path / "offload"
    theirs = [
        folder / f".notes.txt.tmp-{dead_pid}",
        folder / f".report.{dead_pid}.tmp",
        folder / ".draft.old-1-0",
    ]
    for path in theirs:
        path.write_text("the user's")
    tierlm.load(tiny_checkpoints["llama"], dtype="bfloat16", device_map=DISK_MAP, offload_folder=folder)
    assert not os.path.exists(dead_paths[1])  # tierlm's own leftover still goes
    assert [p.read_text() for p in theirs] == ["the user's"] * 3


def test_killed_gguf_cache_write_leaves_a_temporary_the_next_load_removes(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        import tierlm.weights.gguf_cache as gc
        def dying(path, shapes, dtype, tensors):
            path.write_bytes(b"the header and half a tensor")
            os.kill(os.getpid(), signal.SIGKILL)
        gc.write_safetensors = dying
        gc.ensure(gc.Path({str(gguf)!r}), torch.float32)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -9
    folder = gguf_cache.cache_dir(gguf)
    (leftover,) = [p for p in folder.iterdir() if ".tmp-" in p.name]
    assert leftover.name.startswith(".weights-float32.safetensors.tmp-")
    gguf_cache.ensure(gguf, torch.float32)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "source.json",
        "weights-float32.safetensors",
    ]


def test_a_reused_pid_does_not_keep_a_dead_writers_temporary(tmp_path):
    """The pid is alive (this very process) but started at another time: the writer is gone."""
    pid, start, host = os.getpid(), process_start(os.getpid()), this_host()
    assert start is not None
    reused = tmp_path / f".weights-float32.safetensors.tmp-{pid}-{start - 1}-{host}"
    mine = temporary(tmp_path / "weights-float32.safetensors")
    reused.write_bytes(b"x")
    mine.write_bytes(b"x")
    assert remove_stale_temporaries(tmp_path) == [reused]
    assert mine.exists() and mine.name == f".weights-float32.safetensors.tmp-{pid}-{start}-{host}"


def test_another_hosts_temporary_stays_until_untouched_for_a_day(tmp_path):
    """A cache folder shared between machines: another host's pids cannot be checked from here."""
    fresh = tmp_path / ".weights-float32.safetensors.tmp-1-2-elsewhere"
    old = tmp_path / ".0123456789abcdef0123.tmp-1-2-elsewhere"
    fresh.write_bytes(b"x")
    old.mkdir()
    (old / "weights.safetensors").write_bytes(b"x")
    two_days_ago = time.time() - 2 * OTHER_HOST_STALE_S
    for path in (old / "weights.safetensors", old):
        os.utime(path, (two_days_ago, two_days_ago))
    assert remove_stale_temporaries(tmp_path) == [old]
    assert fresh.exists()


def test_a_killed_but_unreaped_writer_counts_as_gone(tmp_path):
    proc, (path,) = start_writer(tmp_path / "weights-float32.safetensors")
    os.kill(proc.pid, signal.SIGKILL)  # a zombie until waited for
    for _ in range(200):
        if Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    assert remove_stale_temporaries(tmp_path) == [Path(path)]
    proc.wait()


def test_a_folder_another_process_committed_meanwhile_stays_and_this_ones_goes(tmp_path):
    """Two processes that build the same offload folder at once: the second to finish keeps the first's folder
    (a process may be reading it by path) instead of renaming it away, and removes its own copy."""
    from tierlm.weights.files import commit_folder, folder_matches, fresh_tmp_folder

    folder, want = tmp_path / "offload" / "key", {"source": "model", "dtype": "torch.float32"}
    ours = fresh_tmp_folder(folder)
    (ours / "weights.safetensors").write_bytes(b"x" * 64)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "weights.safetensors").write_bytes(b"x" * 64)
    commit_folder(theirs, folder, want)  # the other process finished first
    inode = folder.stat().st_ino
    commit_folder(ours, folder, want)
    assert folder.stat().st_ino == inode and folder_matches(folder, want)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["key"]  # no temporary left beside it


def test_a_write_that_fills_the_disk_names_the_folder_and_leaves_no_temporary(tiny_checkpoints, tmp_path):
    """A write that fails without naming a file (a full disk; here a file size limit, the same for the
    writer) is one error naming the offload folder, and the half-written folder is removed."""
    import resource

    script = textwrap.dedent(
        f"""
        import resource, sys, tierlm
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
        try:
            tierlm.load({str(tiny_checkpoints["llama"])!r}, dtype="float32", device_map={{"": "disk"}},
                        offload_folder={str(tmp_path / "off")!r}, quantize="int8")
        except OSError as e:
            print(e)
        """
    )
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "File too large" in proc.stdout and f"'{tmp_path / 'off'}" in proc.stdout, proc.stdout
    leftovers = [p for p in (tmp_path / "off").rglob("*") if p.name.startswith(".")]
    assert leftovers == []


def test_a_folder_commits_where_the_file_system_has_no_flock(tmp_path, monkeypatch):
    """Some network file systems refuse flock (ENOLCK): a commit then goes on without taking turns, as
    before commits took them, instead of failing every offloaded load there."""
    import errno

    from tierlm.weights import files

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(files.fcntl, "flock", refuse)
    folder, want = tmp_path / "offload" / "key", {"dtype": "torch.float32"}
    tmp = files.fresh_tmp_folder(folder)
    (tmp / "weights.safetensors").write_bytes(b"x" * 8)
    files.commit_folder(tmp, folder, want)
    assert files.folder_matches(folder, want) and not tmp.exists()
