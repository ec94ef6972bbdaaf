"""What tierlm keeps in its cache folder (gguf_cache.cache_root()): the entries, their sizes, removing them.

The folder holds gguf/<key>/ (dequantized GGUF weights per dtype and the tokenizer), offload/<key>/ (disk
offloaded weights converted to the compute dtype or packed int8/int4, or streamed layers' fused projections), aot/<key>/ (compiled decode steps
built ahead of time, tierlm.aot), inductor/ (compiled kernels), kernels/ (tierlm's own C++ kernels, built
once per machine: tierlm.kernels), and
temporaries of writes in progress (weights/temporaries.py), which are entries of their own: a live
writer's are never removed, a dead writer's are leftovers. Anything else beside them, or under gguf/,
offload/ and aot/ by a name tierlm does not give (weights/entry_names.py), and any symlink there, is not
tierlm's: listed, never removed, never followed. An entry made from files that are gone (or, for a GGUF,
changed) is orphaned: no load ever uses it again, and `clear --stale` removes it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tierlm.placement.device_map import format_bytes
from tierlm.weights.entry_names import is_key, offload_entry
from tierlm.weights.temporaries import final_name, is_stale, remove, writer_of


@dataclass(frozen=True)
class CacheEntry:
    """One removable thing in the cache folder."""

    path: Path
    kind: str  # "gguf", "offload", "aot", "inductor", "kernels", "temporary", "other" or "foreign"
    nbytes: int
    about: str  # what it holds, in words
    live_writer: int | None = None  # pid of the process still writing it (temporaries only)
    orphaned: bool = False  # made from files that are gone or changed: never used again

    @property
    def foreign(self) -> bool:
        """Not tierlm's: beside tierlm's folders, under a name tierlm never writes (a cache folder set to a
        folder that holds other things); listed, never removed."""
        return self.kind == "foreign"

    @property
    def stale(self) -> bool:
        """A temporary its (killed) writer left behind, or an orphaned entry."""
        return (self.kind == "temporary" and self.live_writer is None) or self.orphaned


def cache_entries(root: Path) -> list[CacheEntry]:
    """Every entry under `root`, in path order; [] when the folder does not exist."""
    entries: list[CacheEntry] = []
    for path in _children(root):
        if path.name in ("gguf", "offload", "aot") and path.is_dir() and not path.is_symlink():
            for child in _children(path):
                entries.extend(_entries_of(child, path.name))
        elif path.name == "inductor" and path.is_dir() and not path.is_symlink():
            entries.append(CacheEntry(path, "inductor", tree_size(path), "compiled kernels (torch inductor)"))
        elif path.name == "kernels" and path.is_dir() and not path.is_symlink():
            entries.append(
                CacheEntry(path, "kernels", tree_size(path), "tierlm's CPU kernels (int4/int8), built")
            )
        elif writer_of(path) is not None:
            entries.append(_temporary(path))
        else:
            entries.append(CacheEntry(path, "foreign", tree_size(path), FOREIGN))
    return entries


FOREIGN = "not tierlm's: cache clear leaves it"


def _entries_of(path: Path, kind: str) -> list[CacheEntry]:
    """The entry for `path`, and for a GGUF cache folder the temporaries inside it as entries of their own.
    Only names tierlm writes there are its entries (a key, or for offload a key with a suffix); anything else,
    and any symlink (whose target clear would empty), is foreign."""
    final = final_name(path) if writer_of(path) is not None else path.name
    if path.is_symlink() or final is None or not _owned(final, kind):
        return [CacheEntry(path, "foreign", tree_size(path), FOREIGN)]
    if writer_of(path) is not None:
        return [_temporary(path)]
    if kind == "gguf" and path.is_dir():
        children = _children(path)
        inside = [_temporary(p) for p in children if writer_of(p) is not None]
        if len(inside) == len(children):  # only a write in progress: the temporary is the entry
            return inside
        size = tree_size(path) - sum(e.nbytes for e in inside)
        return [_entry(path, kind, size, _describe_gguf(path), _gguf_gone(path)), *inside]
    if kind == "offload" and path.is_dir():
        return [_entry(path, kind, tree_size(path), _describe_offload(path), _sources_gone(path))]
    if kind == "aot" and path.is_dir():
        return [_entry(path, kind, tree_size(path), _describe_aot(path), _sources_gone(path))]
    return [CacheEntry(path, kind, tree_size(path), "not written by this tierlm version")]


def _entry(path: Path, kind: str, nbytes: int, about: str, gone: str | None) -> CacheEntry:
    if gone is None:
        return CacheEntry(path, kind, nbytes, about)
    return CacheEntry(path, kind, nbytes, f"{about}; orphaned: {gone}", orphaned=True)


def _gguf_gone(folder: Path) -> str | None:
    """Why a GGUF cache folder is never used again (its GGUF file is gone or changed: the folder's name is
    its identity), or None."""
    from tierlm.weights.files import file_identity, identity_key

    try:
        source = Path(json.loads((folder / "source.json").read_text())["gguf"])
        if not source.is_absolute():
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a write in progress, or an older tierlm's: not judged
    try:
        same = identity_key([file_identity(source)]) == folder.name
    except FileNotFoundError:
        return f"{source} is gone"
    except (OSError, ValueError):  # unreadable here (permissions, a bad name): not judged
        return None
    return None if same else f"{source} has changed since"


def _sources_gone(folder: Path) -> str | None:
    """Why an offload folder or a compiled package is never used again (a file it was made from, by its
    resolved path, is gone), or None (its manifest names none: an older tierlm's, not judged)."""
    try:
        sources = json.loads((folder / "manifest.json").read_text())["sources"]
        if not isinstance(sources, list) or not all(isinstance(s, str) and os.path.isabs(s) for s in sources):
            return None
        gone = [s for s in sources if not os.path.exists(s)]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return f"{gone[0]} is gone" if gone else None


def _owned(name: str, kind: str) -> bool:
    """Whether `name` is one tierlm writes under gguf/, offload/ or aot/ (an identity_key, 20 hex digits)."""
    if kind == "offload":
        return offload_entry(name)
    return is_key(name)


def _temporary(path: Path) -> CacheEntry:
    writer = writer_of(path)
    process = f"process {writer.pid}" + ("" if writer.local else f" on {writer.host}")
    if is_stale(path):
        return CacheEntry(path, "temporary", tree_size(path), f"left by {process}, which is gone")
    return CacheEntry(path, "temporary", tree_size(path), f"being written by {process}", writer.pid)


def _describe_gguf(folder: Path) -> str:
    """ "SmolLM2.gguf: weights bfloat16 (270.0 MB), tokenizer (2.2 MB)"."""
    try:
        source = Path(json.loads((folder / "source.json").read_text())["gguf"]).name
    except (OSError, ValueError, KeyError, TypeError):
        source = "unknown GGUF file"
    parts = [
        f"weights {f.name.removeprefix('weights-').removesuffix('.safetensors')} ({format_bytes(_size(f))})"
        for f in sorted(folder.glob("weights-*.safetensors"))
    ]
    tokenizer = _size(folder / "tokenizer.json") + _size(folder / "tokenizer-meta.json")
    if tokenizer:
        parts.append(f"tokenizer ({format_bytes(tokenizer)})")
    return f"{source}: {', '.join(parts) or 'no weights yet'}"


def _describe_offload(folder: Path) -> str:
    """ "bfloat16 weights of 9 tensors from /models/x", "int8 packed units: model.layers.1" or "bfloat16 fused
    projections of streamed layers: 4 groups"."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return "incomplete (no manifest): rebuilt on next use"
    dtype = str(manifest.get("dtype", "?")).removeprefix("torch.")
    if "groups" in manifest:  # tierlm.placement.fused
        quant = manifest.get("quantization")
        kind = f"{quant[0]} packed {dtype}" if quant else dtype
        return f"{kind} fused projections of streamed layers: {len(manifest['groups'])} groups"
    if "mode" in manifest:
        return f"{manifest['mode']} packed {dtype} units: {', '.join(manifest.get('units', []))}"
    source = f" from {manifest['source']}" if "source" in manifest else ""
    return f"{dtype} weights of {len(manifest.get('tensors', []))} tensors{source}"


def _describe_aot(folder: Path) -> str:
    """ "compiled step of SmolLM2.gguf: batch 1, cache 512, bfloat16, int8; built <UTC time>"."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        key = manifest["key"]
        quant = "" if key["quantization"] == "none" else f", {key['quantization']}"
        shape = f"batch {key['batch']}, cache {key['cache_len']}, {key['dtype']}{quant}"
        return f"compiled step of {Path(manifest['source']).name}: {shape}; built {manifest['built']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "incomplete or unreadable (no manifest): rebuilt on next use"


def clear_cache(
    root: Path, stale_only: bool = False, progress=None
) -> tuple[list[CacheEntry], list[CacheEntry]]:
    """Remove the cache's entries (only dead writers' leftovers when `stale_only`); never a temporary a live
    process is writing, nor what is not tierlm's (`CacheEntry.foreign`). Returns (removed, kept).
    progress(entry) is called before each removal. `root` must be a folder, or not exist."""
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"the cache folder {root} is a file, not a folder (TIERLM_CACHE_DIR?)")
    removed: list[CacheEntry] = []
    while True:  # with stale_only, removing a GGUF's weights orphans the offload folders made from them
        kept, before = [], len(removed)
        for entry in cache_entries(root):
            if entry.live_writer is not None or entry.foreign or (stale_only and not entry.stale):
                kept.append(entry)
                continue
            if progress is not None:
                progress(entry)
            _remove_entry(entry)
            removed.append(entry)
        if not stale_only or len(removed) == before:
            break
    for folder in (root / "gguf", root / "offload", root / "aot"):
        _remove_if_empty(folder)
    return removed, kept


def _remove_entry(entry: CacheEntry) -> None:
    """A GGUF cache folder goes file by file, so that a live writer's temporary inside it stays."""
    if entry.kind != "gguf" or not entry.path.is_dir():
        remove(entry.path)
        return
    for child in _children(entry.path):
        if writer_of(child) is None:
            remove(child)
    _remove_if_empty(entry.path)


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty (a live writer's temporary) or already gone
        pass


def tree_size(path: Path) -> int:
    """Bytes in a file or a folder tree (symlinks count as themselves, never followed)."""
    if not path.is_dir() or path.is_symlink():
        return _size(path)
    total = 0
    for folder, _dirs, files in os.walk(path):
        total += sum(_size(Path(folder) / f) for f in files)
    return total


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:  # removed meanwhile
        return 0


def _children(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []
