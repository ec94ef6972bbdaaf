"""The names tierlm gives what it writes in its cache and offload folders, so that a sweep or a clear
touches those and never a file of the user's beside them. No torch here (`tierlm cache` imports it)."""

from __future__ import annotations

import re

KEY = r"[0-9a-f]{20}"  # an identity_key's form


def is_key(name: str) -> bool:
    """An identity_key (weights/files.py): 20 hex digits, a gguf/, offload/ or aot/ entry's name."""
    return re.fullmatch(KEY, name) is not None


def offload_entry(name: str) -> bool:
    """What tierlm writes in an offload folder: <key>[-<what>], or resident-<what> for the packed weights of
    a resident checkpoint. The folder is the user's to choose, so only temporaries of such names are ever
    swept from it."""
    return re.match(rf"(?:{KEY}|resident)(?:-|$)", name) is not None
