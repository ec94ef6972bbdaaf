"""`tierlm plan`, `tierlm bench` and `tierlm cache`: commands that inspect, measure or tidy up."""

from __future__ import annotations

import sys
from pathlib import Path

from tierlm.cli.common import placement_kwargs, status


def cmd_plan(args) -> int:
    from tierlm.plan import describe_plan

    kwargs = placement_kwargs(args)
    kwargs.pop("offload_folder", None)
    plan = describe_plan(
        args.model, dtype=args.dtype, cache=args.cache, compile=args.compile, device=args.device, **kwargs
    )
    print(plan)
    return 0


def cmd_bench(args) -> int:
    import runpy

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "decode.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: tierlm bench runs from a source checkout")
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def cmd_cache(args) -> int:
    from tierlm.cache_folder import cache_entries, clear_cache
    from tierlm.placement.memory import format_bytes
    from tierlm.weights.gguf_cache import cache_root

    root = cache_root()
    if args.action == "list":
        print(cache_listing(root, cache_entries(root)))
        return 0

    def progress(entry) -> None:
        status(f"tierlm: removing {entry.path} ({format_bytes(entry.nbytes)})")

    removed, kept = clear_cache(root, stale_only=args.stale, progress=progress)
    busy = [e for e in kept if e.live_writer is not None]
    foreign = [e for e in kept if e.foreign]
    freed = format_bytes(sum(e.nbytes for e in removed))
    note = f"; kept {entries_text(len(busy))} still being written" if busy else ""
    if foreign:
        note += f"; left {entries_text(len(foreign))} that tierlm did not write ({foreign[0].path.name}"
        note += ", ...)" if len(foreign) > 1 else ")"
    status(f"tierlm: removed {entries_text(len(removed))} ({freed}) from {root}{note}")
    return 0


def entries_text(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def cache_listing(root: Path, entries) -> str:
    """The text of `tierlm cache list`: one line per entry, then the total."""
    from tierlm.placement.memory import format_bytes

    state = "" if root.is_dir() else " (a file, not a folder)" if root.exists() else " (does not exist)"
    lines = [f"cache folder: {root}{state}"]
    for e in entries:
        lines.append(f"  {format_bytes(e.nbytes):>10}  {e.path.relative_to(root)}  {e.about}")
    orphaned = sum(e.orphaned for e in entries)
    killed = sum(e.stale for e in entries) - orphaned
    total = f"total: {format_bytes(sum(e.nbytes for e in entries))} in {entries_text(len(entries))}"
    why = [f"{killed} left by killed processes"] * bool(killed) + [f"{orphaned} orphaned"] * bool(orphaned)
    if why:
        total += f" ({', '.join(why)}: tierlm cache clear --stale removes them)"
    return "\n".join([*lines, total])
