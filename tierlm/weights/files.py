"""Low-level file helpers: atomic file and folder writes, and for memory-mapped tensors their page spans,
madvise and this process's file mappings.

Nothing here knows about models or tiers; `weights.gguf_cache`, `weights.layout` and `placement` build on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import mmap
import os
import shutil
from pathlib import Path

import torch

from tierlm.errors import PlacementError
from tierlm.weights.entry_names import offload_entry
from tierlm.weights.temporaries import remove_stale_temporaries, temporary

_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22
_LIBC = ctypes.CDLL(None, use_errno=True)


def populate(tensors) -> None:
    """Fault memory-mapped tensors' pages in ahead of use (reading the file only where the page cache lacks
    them), without copying: MADV_POPULATE_READ, or MADV_WILLNEED read-ahead on kernels before 5.14."""
    for t in tensors:
        addr, length = page_span(t)
        if _LIBC.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_POPULATE_READ) != 0:
            _LIBC.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_WILLNEED)


def madvise_dontneed(addr: int, length: int) -> None:
    """MADV_DONTNEED over [addr, addr + length): only for file-backed memory (anonymous pages would read
    back as zeros)."""
    _LIBC.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_DONTNEED)


def file_mappings() -> list[tuple[int, int, int, Path]]:
    """(start, end, file offset, path) of this process's file-backed mappings (/proc/self/maps)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, int(parts[2], 16), Path(parts[5])))
    return out


def page_span(t: torch.Tensor) -> tuple[int, int]:
    page = mmap.PAGESIZE
    start = t.data_ptr()
    aligned = start - start % page
    return aligned, t.numel() * t.element_size() + (start - aligned)


def file_identity(path: Path) -> str:
    """A file's resolved path, size and modification time: what changes when the file is replaced or edited."""
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def identity_key(parts: list[str]) -> str:
    """A short, stable name (a folder name in the cache) for the identity `parts` describe."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def atomic_write(target: Path, write) -> None:
    """Write `target` through write(temporary path), then rename: a reader sees the old file or the new one."""
    tmp = temporary(target)
    try:
        with naming(target):
            write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


# What a write raises when the disk or a limit cannot take it (the error names no file).
FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


@contextlib.contextmanager
def naming(path: Path):
    """A full disk (or quota, or file size limit) met by a write in the block names `path` in its error."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno in FULL:
            e.filename = str(path)  # the same exception, its type, attributes and traceback
        raise


@contextlib.contextmanager
def filling(tmp: Path | None, folder: Path):
    """The block writes `folder`'s files into `tmp` (from fresh_tmp_folder; None: nothing to write); an error
    removes it, and a full disk met there names `folder` (`naming`)."""
    if tmp is None:
        yield
        return
    try:
        with naming(folder):
            yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def folder_matches(folder: Path, want: dict) -> bool:
    """Whether a folder written by commit_folder holds what `want` describes, its files whole: each at the
    size the manifest recorded (a truncated or deleted file failed inside numpy or safetensors on every
    load; now the folder is rebuilt). A manifest of an older tierlm, without sizes, is not trusted.
    want["sources"], the paths it was made from, is not compared: the key of their identities is."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        files = manifest.pop("files")
        manifest.pop("sources", None)
        want = {k: v for k, v in want.items() if k != "sources"}
        return manifest == want and all(
            (folder / name).stat().st_size == size for name, size in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def fresh_tmp_folder(folder: Path) -> Path:
    """An empty temporary folder beside `folder` (an entry of an offload folder), to fill and then
    commit_folder(); what killed writers left beside it goes first."""
    tmp = temporary(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(folder.parent, offload_entry)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise PlacementError(
            f"offload folder {folder.parent} is not writable ({e.strerror}); pass a writable offload_folder"
        ) from None
    return tmp


def commit_folder(tmp: Path, folder: Path, want: dict, parent_locked: bool = False) -> None:
    """Make a filled temporary folder `folder`: the manifest is written last, then one rename, so a folder
    without a manifest (an interrupted write) is never trusted. Commits beside it take turns (a lock on the
    parent folder, `locked_folder`, unless the caller holds it; readers take none): where another process
    committed the same folder meanwhile, its folder stays (a process may be reading it) and this one's is
    removed; a stale one is replaced."""
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    with filling(tmp, folder):
        (tmp / "manifest.json").write_text(json.dumps({**want, "files": files}))
        with contextlib.nullcontext() if parent_locked else locked_folder(folder.parent):
            if folder_matches(folder, want):
                shutil.rmtree(tmp, ignore_errors=True)  # mapped files stay readable where they are mapped
                return
            old = temporary(folder, "old")
            with contextlib.suppress(FileNotFoundError):
                os.rename(folder, old)  # a stale or damaged folder
            try:
                os.rename(tmp, folder)
            finally:
                shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def locked_folder(folder: Path, waiting=None):
    """An exclusive lock on `folder` itself (flock on its descriptor: no file of its own), held for the block;
    `waiting()` is called first if another process holds it. Not reentrant: a second lock on the same
    folder in one process waits for itself."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # a file system without flock (some network ones): no turns, as before locks
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)  # closing releases the lock
