#!/usr/bin/env bash
# GPU checks in one call (about 4 minutes on an H200, the machine's start not counted): the GPU-marked tests
# and the CUDA offload benchmark. The lent machine reaches no registry: its image's python3 holds torch
# (CUDA), transformers, accelerate, safetensors, tokenizers; tierlm's other dependencies travel as wheels.
#   here:       bash scripts/gpu_wheels.sh            (fills .whl/, ignored by git)
#   device:     run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=330)
# Outside the device tool: OUT=/tmp/gpu_check PY=python3 bash scripts/gpu_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/gpu_check}
PY=${PY:-python3}
mkdir -p "$OUT"
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0), '| transformers', transformers.__version__)"
  nproc
} 2>&1 | tee "$OUT/env.txt"
# The gpu-marked tests: the seed map (accelerator + cpu + disk) vs all-GPU; all-GPU compile (reduce-overhead);
# pinned cpu-tier weights copied on the side stream into the compiled layer body; CUDA int8/int4 linears.
timeout 200 $PY -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_compile.py tests/test_compile_offload.py \
  tests/test_offload.py tests/test_quant.py 2>&1 | tee "$OUT/gpu_tests.txt"
status=${PIPESTATUS[0]}
# Decode with layers streamed from pinned RAM: eager vs layer-compiled vs resident, against the copy bound.
timeout 170 $PY benchmarks/offload_cuda.py --runs 3 --new-tokens 64 --work-dir /tmp/tierlm-bench \
  --json "$OUT/offload_cuda.json" 2>&1 | tee "$OUT/offload_cuda.txt"
exit "$status"
