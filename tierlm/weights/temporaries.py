"""Temporary files and folders named for the process that writes them, so that what a crashed (killed)
writer left behind is recognised and removed, and what a live writer is still writing never is.

A temporary sits beside its final path as `.<final name>.tmp-<pid>-<start>` (`.old-` for one being
replaced). <start> is the writer's start time (field 22 of /proc/<pid>/stat, clock ticks since boot), so
a pid the kernel has since handed to another process does not pass for the dead writer. Names written by
earlier tierlm versions (`.<name>.<pid>.tmp`, `.<name>.tmp-<pid>`) carry no start time and are judged by
the pid alone.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

_NAME = re.compile(r"^\..+\.(?:(?:tmp|old)-(?P<pid>\d+)(?:-(?P<start>\d+))?|(?P<legacy>\d+)\.tmp)$")


def temporary(target: Path, kind: str = "tmp") -> Path:
    """This process's temporary path for `target`; kind "tmp" (being written) or "old" (being replaced)."""
    pid = os.getpid()
    start = process_start(pid)
    tag = f"{pid}-{start}" if start is not None else str(pid)
    return target.with_name(f".{target.name}.{kind}-{tag}")


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None where /proc cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])  # the command name in (...) may hold spaces
    except (OSError, IndexError, ValueError):
        return None


def writer_of(path: Path) -> tuple[int, int | None] | None:
    """(pid, start time or None) of the process that named this temporary; None if it is not one."""
    m = _NAME.match(path.name)
    if m is None:
        return None
    if m["legacy"]:
        return int(m["legacy"]), None
    return int(m["pid"]), int(m["start"]) if m["start"] else None


def writer_alive(pid: int, start: int | None) -> bool:
    """Whether the process that named a temporary still runs (unknown counts as alive: never remove it)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    return start is None or process_start(pid) in (None, start)


def is_stale(path: Path) -> bool:
    """A temporary whose writer is gone."""
    writer = writer_of(path)
    return writer is not None and not writer_alive(*writer)


def stale_temporaries(folder: Path) -> list[Path]:
    """Temporaries directly inside `folder` whose writer is gone."""
    try:
        entries = list(folder.iterdir())
    except OSError:  # no folder (yet): nothing left behind
        return []
    return sorted(p for p in entries if is_stale(p))


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove what dead writers left directly inside `folder`; the paths removed."""
    removed = []
    for path in stale_temporaries(folder):
        try:
            remove(path)
        except OSError:  # not ours to remove (permissions): it stays, the load goes on
            continue
        removed.append(path)
    return removed


def remove(path: Path) -> None:
    """Remove a file or a folder tree; what is already gone (another process removed it) is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=_ignore_missing)
    else:
        path.unlink(missing_ok=True)


def _ignore_missing(_function, _path, exc_info) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]
