"""The memory a process may use, as "auto" maps read it: MemAvailable and cgroup v1/v2 limits, from fake
/proc and cgroup trees, and from a real cgroup v1 limit set on a subprocess (root only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tierlm.placement.limits import memory_limit

MIB = 2**20
V1_MEMORY = Path("/sys/fs/cgroup/memory")


def fake_tree(
    tmp_path: Path, *, meminfo_mib=8192, cgroup="0::/\n", mounts=(), files=None
) -> tuple[Path, Path]:
    """(proc, root) of a fake machine: /proc/meminfo, /proc/self/{cgroup,mountinfo} and cgroup files."""
    proc, root = tmp_path / "proc", tmp_path / "root"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_mib * 1024} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    lines = [
        f"{30 + i} 23 0:{40 + i} {r} {point} rw,relatime - {fs} {fs} {opts}"
        for i, (r, point, fs, opts) in enumerate(mounts)
    ]
    (proc / "self" / "mountinfo").write_text("\n".join(["1 0 8:1 / / rw - ext4 /dev/sda1 rw", *lines]) + "\n")
    for name, text in (files or {}).items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc, root


def test_no_cgroup_limit_is_memavailable(tmp_path):
    proc, root = fake_tree(
        tmp_path,
        mounts=[("/", "/sys/fs/cgroup", "cgroup2", "rw")],
        files={"/sys/fs/cgroup/cgroup.procs": "1\n"},  # the root cgroup has no memory.max
    )
    assert memory_limit(proc, root) == memory_limit_of(8192 * MIB, None, "MemAvailable")


def memory_limit_of(available, limit, source):
    from tierlm.placement.limits import MemoryLimit

    return MemoryLimit(available, limit, source)


def test_cgroup_v2_limit_less_usage_plus_reclaimable_cache(tmp_path):
    folder = "/sys/fs/cgroup/app/job"
    proc, root = fake_tree(
        tmp_path,
        cgroup="0::/app/job\n",
        mounts=[("/", "/sys/fs/cgroup", "cgroup2", "rw")],
        files={
            f"{folder}/memory.max": f"{1000 * MIB}\n",
            f"{folder}/memory.current": f"{300 * MIB}\n",
            f"{folder}/memory.stat": f"anon {250 * MIB}\nactive_file 0\ninactive_file {50 * MIB}\n",
            "/sys/fs/cgroup/app/memory.max": "max\n",
        },
    )
    found = memory_limit(proc, root)
    assert (found.available, found.limit) == (750 * MIB, 1000 * MIB)
    assert found.source == f"cgroup v2 {root}{folder}/memory.max"
    assert "limit 1.0 GB, 786.4 MB available (cgroup v2" in found.describe()


def test_cgroup_v2_an_ancestors_tighter_limit_wins(tmp_path):
    proc, root = fake_tree(
        tmp_path,
        cgroup="0::/app/job\n",
        mounts=[("/", "/sys/fs/cgroup", "cgroup2", "rw")],
        files={
            "/sys/fs/cgroup/app/job/memory.max": "max\n",
            "/sys/fs/cgroup/app/job/memory.current": f"{100 * MIB}\n",
            "/sys/fs/cgroup/app/memory.max": f"{600 * MIB}\n",
            "/sys/fs/cgroup/app/memory.current": f"{400 * MIB}\n",  # a sibling uses memory too
            "/sys/fs/cgroup/app/memory.stat": "inactive_file 0\n",
        },
    )
    found = memory_limit(proc, root)
    assert (found.available, found.limit) == (200 * MIB, 600 * MIB)


def test_cgroup_v1_hierarchical_limit_inside_a_container_mount(tmp_path):
    """A container sees its own cgroup as the mount's root (/docker/abc mounted at /sys/fs/cgroup/memory)."""
    proc, root = fake_tree(
        tmp_path,
        cgroup="5:cpu:/\n4:memory:/docker/abc\n0::/\n",
        mounts=[("/docker/abc", "/sys/fs/cgroup/memory", "cgroup", "rw,memory")],
        files={
            "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes": f"{200 * MIB}\n",
            "/sys/fs/cgroup/memory/memory.stat": (
                f"total_rss {150 * MIB}\nhierarchical_memory_limit {512 * MIB}\ntotal_inactive_file {10 * MIB}\n"
            ),
        },
    )
    found = memory_limit(proc, root)
    assert (found.available, found.limit) == (322 * MIB, 512 * MIB)
    assert "cgroup v1" in found.source


def test_memavailable_below_the_cgroup_room_wins(tmp_path):
    proc, root = fake_tree(
        tmp_path,
        meminfo_mib=100,
        cgroup="4:memory:/job\n",
        mounts=[("/", "/sys/fs/cgroup/memory", "cgroup", "rw,memory")],
        files={
            "/sys/fs/cgroup/memory/job/memory.limit_in_bytes": f"{4096 * MIB}\n",
            "/sys/fs/cgroup/memory/job/memory.usage_in_bytes": f"{10 * MIB}\n",
        },
    )
    assert memory_limit(proc, root) == memory_limit_of(100 * MIB, None, "MemAvailable")


def test_unlimited_v1_and_unreadable_files_are_no_limit(tmp_path):
    proc, root = fake_tree(
        tmp_path,
        cgroup="4:memory:/job\n",
        mounts=[("/", "/sys/fs/cgroup/memory", "cgroup", "rw,memory")],
        files={"/sys/fs/cgroup/memory/job/memory.limit_in_bytes": "9223372036854771712\n"},
    )
    assert memory_limit(proc, root).source == "MemAvailable"
    (proc / "self" / "mountinfo").write_text("garbage line\n")
    assert memory_limit(proc, root).source == "MemAvailable"


# ---------------------------------------------------------------- a real cgroup v1 limit


# The child moves into a cgroup of its own, plans once (the runtime and the planning's own memory in use), sets
# its limit to what it uses now + `room`, then plans the checkpoint with device_map "auto" and no max_memory
# (what `tierlm plan --device-map auto` does).
_CHILD = r"""
import json, os, sys
from pathlib import Path
folder = Path(sys.argv[1])
(folder / "cgroup.procs").write_text(str(os.getpid()))
import tierlm.plan
tierlm.plan.plan(sys.argv[3], device_map="auto", max_memory={"cpu": "1GB"})  # the runtime first: the limit
usage = int((folder / "memory.usage_in_bytes").read_text())
(folder / "memory.limit_in_bytes").write_text(str(usage + int(sys.argv[2])))
from tierlm.placement.limits import memory_limit
from tierlm.placement.device_map import available_memory
found = memory_limit()
out = {"limit": found.limit, "source": found.source, "available": found.available,
       "budget": available_memory()["cpu"]}
try:
    p = tierlm.plan.plan(sys.argv[3], device_map="auto")
    out["tiers"] = sorted(set(p.placement.module_map.values()))
    out["cpu_bytes"] = sum(b for m, b in p.module_bytes.items() if p.placement.module_map[m] == "cpu")
    out["total_bytes"] = sum(p.module_bytes.values())
except ValueError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


@pytest.fixture
def memory_cgroup():
    if os.geteuid() != 0 or not os.access(V1_MEMORY, os.W_OK):
        pytest.skip("needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    folder = V1_MEMORY / f"tierlm-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    for pid in (folder / "cgroup.procs").read_text().split():
        (V1_MEMORY / "cgroup.procs").write_text(pid)  # a straggler back to the root before removal
    folder.rmdir()


@pytest.fixture(scope="module")
def wide_layers(tmp_path_factory) -> Path:
    """A random fp32 Llama of 8 layers of 7.3 MB (58 MB in all) and a small vocabulary."""
    from conftest import write_tiny_checkpoint

    folder = tmp_path_factory.mktemp("wide") / "llama"
    overrides = dict(hidden_size=256, intermediate_size=2048, num_hidden_layers=8)
    return write_tiny_checkpoint(folder, "llama", overrides)


def in_cgroup(folder: Path, room: int, checkpoint: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), str(room), str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_auto_map_fits_a_real_cgroup_limit_below_the_model(memory_cgroup, wide_layers):
    """Under a limit that leaves 30 MB beside the runtime, a 58 MB model no longer fits in RAM: "auto" reads
    the cgroup, puts what fits on the cpu and the rest on disk."""
    out = in_cgroup(memory_cgroup, 30 * MIB, wide_layers)
    assert out["source"] == f"cgroup v1 {memory_cgroup}/memory.limit_in_bytes", out
    assert out["limit"] is not None and out["available"] < out["limit"] < 2**40
    assert out["budget"] == int(out["available"] * 0.9)
    assert out["total_bytes"] > out["budget"], out  # the case is real: the model does not fit the limit
    assert out["tiers"] == ["cpu", "disk"] and 0 < out["cpu_bytes"] <= out["budget"], out


def test_a_limit_too_small_names_the_limit_that_works(memory_cgroup, wide_layers):
    """One error naming the smallest limit that runs, and that limit does run."""
    out = in_cgroup(memory_cgroup, 2 * MIB, wide_layers)
    error = out.get("error", "")
    assert error.startswith("the memory this process may use (limit "), out
    assert "is too small: the streamed layer model.layers." in error and "A memory limit of at least" in error
    least = error.rsplit("A memory limit of at least ", 1)[1].removesuffix(" works.")
    from tierlm.placement.memory import parse_memory

    needed = parse_memory(least.replace(" ", "")) - (out["limit"] - out["available"])  # room past the usage
    rerun = in_cgroup(memory_cgroup, needed + 2 * MIB, wide_layers)  # format_bytes rounds to 0.1 MB
    assert "error" not in rerun and "disk" in rerun["tiers"], rerun
