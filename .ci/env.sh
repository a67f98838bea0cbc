# Sourced by the README's commands: make .venv with the CPU torch wheel and stpc installed.
# Idempotent; torch is pinned to the CPU build first so nothing later pulls a CUDA torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, stpc, ortools, pytest, hypothesis, triton" 2>/dev/null; then
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  # The CPU wheel; index fallback for machines without the local wheel.
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || \
    .venv/bin/python -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  .venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import torch, stpc; assert not torch.version.cuda, 'a CUDA torch was installed'"
fi
export PATH="$PWD/.venv/bin:$PATH"
