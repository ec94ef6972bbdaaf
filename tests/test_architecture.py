"""The floors hold at import time: the config floor loads no torch, and the lazy public API still resolves.

The import direction itself is checked by `lint-imports` (the contract in pyproject.toml), run by `make
lint` and `make test`.
"""

import subprocess
import sys

import pytest

HEAVY = ("torch", "gguf", "jinja2", "tokenizers")


def imported_after(statement: str) -> set[str]:
    """The heavy modules a fresh interpreter has loaded after running `statement`."""
    code = f"import sys; {statement}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("statement", ["import tierlm.config", "import tierlm"])
def test_config_floor_and_package_load_no_torch(statement):
    assert imported_after(statement) == set()


def test_public_names_resolve_lazily():
    import tierlm
    from tierlm.compile import CompileConfig, CompileSkippedWarning
    from tierlm.config import ModelConfig
    from tierlm.generation.config import GenerationConfig
    from tierlm.model import Model, load

    assert tierlm.load is load and tierlm.Model is Model and tierlm.ModelConfig is ModelConfig
    assert tierlm.CompileConfig is CompileConfig and tierlm.CompileSkippedWarning is CompileSkippedWarning
    assert tierlm.GenerationConfig is GenerationConfig
    assert set(tierlm.__all__) <= set(dir(tierlm))
    with pytest.raises(AttributeError, match="no_such_name"):
        tierlm.no_such_name  # noqa: B018
