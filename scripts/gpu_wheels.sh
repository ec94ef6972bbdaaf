#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the wheels of tierlm's dependencies that the lent GPU machine's
# image lacks (it has torch, transformers, safetensors, tokenizers, numpy, jinja2, httpx; nothing can be
# installed there from a registry). They go to .whl/ (ignored by git: add "/.whl/" to .git/info/exclude);
# the device call carries it and scripts/gpu_check.sh installs it. Versions: those of this venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
names="gguf fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection llguidance
opentelemetry-api typing_extensions"
specs=$($PY - $names <<'PYEOF'
import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))
PYEOF
)
platforms=""
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64 any; do platforms="$platforms --platform $p"; done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $platforms -d .whl $specs
ls .whl
