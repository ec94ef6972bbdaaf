"""Module and parameter names (Hugging Face's dotted paths): the one test of whether a name lies in a module.

No torch here, and nothing from tierlm: every floor may ask it.
"""


def under(name: str, prefix: str) -> bool:
    """Whether `name` is the module `prefix` or lies inside it: "model.layers.1.mlp" is under "model.layers.1",
    "model.layers.10" is not. The empty prefix names no module here (a device map's "" key is its default)."""
    return name == prefix or name.startswith(prefix + ".")
