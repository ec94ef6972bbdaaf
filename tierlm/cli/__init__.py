"""`tierlm generate | chat | plan | bench | serve | compile | cache`: argument parsing and printing only.

Each command is a function of the parsed arguments in a module of its own; they import what they need inside
each command, so `tierlm --help` stays fast."""

from __future__ import annotations

import argparse
import sys

from tierlm.cli.args import build_parser
from tierlm.cli.common import show_library_progress, show_warnings_as_lines
from tierlm.cli.generate import cmd_chat, cmd_generate
from tierlm.cli.serve import cmd_compile, cmd_serve
from tierlm.cli.tools import cmd_bench, cmd_cache, cmd_plan

COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "plan": cmd_plan,
    "bench": cmd_bench,
    "serve": cmd_serve,
    "compile": cmd_compile,
    "cache": cmd_cache,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after it is benchmarks/decode.py's, verbatim
        args = argparse.Namespace(command="bench", args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    show_library_progress()
    show_warnings_as_lines()
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"tierlm: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntierlm: interrupted", file=sys.stderr)
        return 130
