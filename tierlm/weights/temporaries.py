"""Temporary files and folders named for the process that writes them, so that what a crashed (killed)
writer left behind is recognised and removed, and what a live writer is still writing never is.

A temporary sits beside its final path as `.<final name>.tmp-<pid>-<start>-<host>` (`.old-` for one
being replaced). <start> is the writer's start time (field 22 of /proc/<pid>/stat, clock ticks since
boot), so a pid the kernel has since handed to another process does not pass for the dead writer. <host>
keeps a cache folder shared between machines or containers safe: another host's pids cannot be checked
from here, so its temporaries count as stale only once untouched for OTHER_HOST_STALE_S. Names written by
earlier tierlm versions (`.<name>.<pid>.tmp`, `.<name>.tmp-<pid>`) are judged by the pid alone.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OTHER_HOST_STALE_S = 24 * 3600
_NAME = re.compile(
    r"^\.(?P<final>.+)\.(?:(?:tmp|old)-(?P<pid>\d+)(?:-(?P<start>\d+)(?:-(?P<host>[A-Za-z0-9.-]+))?)?|(?P<legacy>\d+)\.tmp)$"
)


@dataclass(frozen=True)
class Writer:
    """The process a temporary's name records; start and host are None in older names."""

    pid: int
    start: int | None
    host: str | None

    @property
    def local(self) -> bool:
        return self.host in (None, this_host())


def temporary(target: Path, kind: str = "tmp") -> Path:
    """This process's temporary path for `target`; kind "tmp" (being written) or "old" (being replaced)."""
    pid = os.getpid()
    return target.with_name(f".{target.name}.{kind}-{pid}-{process_start(pid) or 0}-{this_host()}")


def this_host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()) or "localhost"


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None where /proc cannot tell."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold spaces
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 and fields[19].isdigit() else None


def writer_of(path: Path) -> Writer | None:
    """The process that named this temporary; None if `path` is not a temporary."""
    m = _NAME.match(path.name)
    if m is None:
        return None
    if m["legacy"]:
        return Writer(int(m["legacy"]), None, None)
    start = int(m["start"]) if m["start"] and m["start"] != "0" else None  # 0: start unknown to the writer
    return Writer(int(m["pid"]), start, m["host"])


def writer_alive(writer: Writer) -> bool:
    """Whether a local writer still runs (unknown counts as alive: never remove what may be in use)."""
    if writer.pid <= 0:
        return False
    try:
        os.kill(writer.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    fields = _proc_stat(writer.pid)
    if fields is None:
        return True
    if fields[0] in ("Z", "X"):  # killed, not yet reaped by its parent
        return False
    return writer.start is None or int(fields[19]) == writer.start


def is_stale(path: Path) -> bool:
    """A temporary whose writer is gone (on another host: one untouched for OTHER_HOST_STALE_S)."""
    writer = writer_of(path)
    if writer is None:
        return False
    if not writer.local:
        return time.time() - last_write(path) > OTHER_HOST_STALE_S
    return not writer_alive(writer)


def last_write(path: Path) -> float:
    """The newest modification time in a file or folder tree."""
    times = [path.lstat().st_mtime]
    if path.is_dir() and not path.is_symlink():
        for folder, _dirs, files in os.walk(path):
            times.extend(_mtime(Path(folder) / f) for f in files)
    return max(times)


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


def final_name(path: Path) -> str | None:
    """The name of the path a temporary stands for; None if `path` is not a temporary."""
    m = _NAME.match(path.name)
    return m["final"] if m else None


def stale_temporaries(folder: Path, owned: Callable[[str], bool] | None = None) -> list[Path]:
    """Temporaries directly inside `folder` whose writer is gone; with `owned`, only those whose final
    name it accepts (in a folder the user chose, a stray file of theirs may look like a temporary)."""
    try:
        entries = list(folder.iterdir())
    except OSError:  # no folder (yet): nothing left behind
        return []
    if owned is not None:
        entries = [p for p in entries if (name := final_name(p)) is not None and owned(name)]
    return sorted(p for p in entries if _stale_or_gone(p))


def _stale_or_gone(path: Path) -> bool:
    try:
        return is_stale(path)
    except OSError:  # removed meanwhile, by its writer or another sweep
        return False


def remove_stale_temporaries(folder: Path, owned: Callable[[str], bool] | None = None) -> list[Path]:
    """Remove what dead writers left directly inside `folder` (see stale_temporaries); the paths removed."""
    removed = []
    for path in stale_temporaries(folder, owned):
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
