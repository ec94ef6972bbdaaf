"""The memory this process may still use: the least of the machine's MemAvailable and what its memory cgroup
(v1 or v2, each ancestor's limit included) leaves, so an "auto" map sized from it fits the real limit.

Pure reads of /proc and the cgroup files, no torch; `proc` and `root` let a test stand a fake tree in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# A limit at or above this is "no limit": cgroup v1 writes PAGE_COUNTER_MAX (~2**63, page-rounded) there.
_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    """available: bytes this process may still use; limit: the cgroup's limit in force (None: none);
    source: where `available` came from, as `tierlm plan` prints it."""

    available: int
    limit: int | None
    source: str

    def describe(self) -> str:
        from tierlm.placement.memory import format_bytes

        limit = f"limit {format_bytes(self.limit)}, " if self.limit is not None else ""
        return f"{limit}{format_bytes(self.available)} available ({self.source})"


def memory_limit(proc: Path = Path("/proc"), root: Path = Path("/")) -> MemoryLimit:
    """The memory this process may still use (see the module's docstring)."""
    machine = _meminfo_available(proc)
    best = MemoryLimit(machine, None, "MemAvailable") if machine is not None else None
    for found in _cgroup_limits(proc, root):
        if best is None or found.available < best.available:
            best = found
    if best is None:  # no /proc: what sysconf says is free
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        best = MemoryLimit(free, None, "free pages (sysconf)")
    return best


def _meminfo_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limits(proc: Path, root: Path) -> list[MemoryLimit]:
    """One MemoryLimit per limited memory cgroup on this process's path (v2 and v1 hierarchies)."""
    try:
        memberships = (proc / "self" / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    v2_path = v1_path = None
    for line in memberships:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    found = []
    for mount_root, mount_point, fstype, options in _cgroup_mounts(mounts):
        if fstype == "cgroup2" and v2_path is not None:
            folder = _inside(root, mount_point, mount_root, v2_path)
            if folder is not None:
                found += _v2_limits(folder, root / mount_point.lstrip("/"))
        elif fstype == "cgroup" and "memory" in options and v1_path is not None:
            folder = _inside(root, mount_point, mount_root, v1_path)
            if folder is not None:
                found += _v1_limit(folder)
    return found


def _cgroup_mounts(mounts: list[str]):
    """(root inside the hierarchy, mount point, fstype, super options) of each cgroup mount in mountinfo."""
    for line in mounts:
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or len(fields) < dash + 4:
            continue
        fstype = fields[dash + 1]
        if fstype in ("cgroup", "cgroup2"):
            yield fields[3], fields[4], fstype, fields[dash + 3].split(",")


def _inside(root: Path, mount_point: str, mount_root: str, path: str) -> Path | None:
    """The folder of cgroup `path` under a mount of the hierarchy's `mount_root` (None: not visible there)."""
    mount_root = mount_root.rstrip("/")
    if mount_root and not (path == mount_root or path.startswith(mount_root + "/")):
        return None
    relative = path[len(mount_root) :].strip("/")
    folder = root / mount_point.lstrip("/") / relative
    return folder if folder.is_dir() else None


def _v2_limits(folder: Path, top: Path) -> list[MemoryLimit]:
    """cgroup v2: each folder from this one up to the mount whose memory.max is set limits this process."""
    found = []
    while True:
        raw = _read(folder / "memory.max")
        if raw is not None and raw != "max":
            limit = _number(raw)
            usage = _number(_read(folder / "memory.current"))
            if limit is not None and limit < _UNLIMITED and usage is not None:
                reclaimable = _stat(folder / "memory.stat", "inactive_file")
                available = max(0, limit - usage + reclaimable)
                found.append(MemoryLimit(available, limit, f"cgroup v2 {folder / 'memory.max'}"))
        if folder == top or folder.parent == folder or top not in folder.parents:
            return found
        folder = folder.parent


def _v1_limit(folder: Path) -> list[MemoryLimit]:
    """cgroup v1: memory.stat's hierarchical_memory_limit is the least limit of the folder and its parents."""
    limit = _stat(folder / "memory.stat", "hierarchical_memory_limit", None)
    if limit is None:
        limit = _number(_read(folder / "memory.limit_in_bytes"))
    usage = _number(_read(folder / "memory.usage_in_bytes"))
    if limit is None or limit >= _UNLIMITED or usage is None:
        return []
    reclaimable = _stat(folder / "memory.stat", "total_inactive_file")
    available = max(0, limit - usage + reclaimable)
    return [MemoryLimit(available, limit, f"cgroup v1 {folder / 'memory.limit_in_bytes'}")]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _stat(path: Path, key: str, default: int | None = 0) -> int | None:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            number = _number(value.strip())
            return number if number is not None else default
    return default
