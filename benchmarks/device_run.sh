#!/usr/bin/env bash
# One lent GPU's checks, in priority order, each bounded so a slow one cannot eat the rest:
#   bash benchmarks/device_run.sh OUTDIR
# Run from the repository root on the device machine (its image has torch and triton but no
# OR-Tools: carry the wheels in .whl/, see the device tool's README). Each check writes its
# own JSON and markdown under OUTDIR, so what finished survives a later timeout.
set -u
OUT=${1:?usage: device_run.sh OUTDIR}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
# The installed names live under stpc. (pyproject's package-dir); without an install, links do it.
[ -e stpc/passes ] || ln -s ../passes stpc/passes
[ -e stpc/cost_models ] || ln -s ../cost_models stpc/cost_models
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, stpc, ortools; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 1

step() {  # step SECONDS NAME ARGS...: one cuda_check run, its tail printed
  local t=$1 name=$2; shift 2
  echo "== $name"
  timeout "$t" python3 benchmarks/cuda_check.py "$@" --json "$OUT/$name.json" --markdown "$OUT/$name.md" \
    >"$OUT/$name.log" 2>&1
  echo "rc $?"; tail -n 4 "$OUT/$name.log"
}
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_lower_cuda.py tests/test_cuda_check.py tests/test_kernels.py 2>&1 | tail -n 2
# Parity: one NCCL rank (eager, inductor), then 4 ranks sharing the GPU over gloo for the plans
# gloo can run on CUDA tensors (all-reduces alone).
step 200 parity --skip gloo memory bf16 --parity-families dp solved --steps 10
# Memory and time: the data-parallel plan on 4 ranks, then one rank (solved, recompute).
step 120 memory4 --skip parity single gloo bf16 --memory-ranks 4 --memory-plans dp --batch 16 --steps 5
step 120 memory1 --skip parity single gloo bf16 --batch 16 --steps 10
