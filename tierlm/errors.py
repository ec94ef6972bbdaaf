"""tierlm's errors: one ValueError subclass per kind of bad input, so a caller can tell them apart.

Every class is a ``ValueError`` (code written against earlier releases that catches ``ValueError`` keeps
working); the message names the problem in one line, and the CLI prints it without a traceback.

>>> from tierlm.errors import PlacementError
>>> try:
...     raise PlacementError("device_map: 'model.layer.0' names no module; did you mean 'model.layers.0'?")
... except ValueError as e:
...     print(type(e).__name__)
PlacementError
"""

from __future__ import annotations

__all__ = ["ModelFileError", "OptionError", "PlacementError", "RequestError", "TierlmError"]


class TierlmError(ValueError):
    """The base of tierlm's errors: bad input that tierlm refused with a message naming it."""


class ModelFileError(TierlmError):
    """A model file or folder that cannot be read: missing, truncated, corrupt, or of an unknown family."""


class PlacementError(TierlmError):
    """A device map, memory budget or offload folder that cannot place the model."""


class OptionError(TierlmError):
    """A load-time or engine option that is unknown or conflicts: compile, quantization, dtype, threads."""


class RequestError(TierlmError):
    """One request's bad input: its prompt, messages, sampling settings, stop strings or response format."""
