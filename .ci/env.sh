# Sourced by the README's commands: make .venv with the CPU torch wheel and stpc installed.
# Idempotent. torch is pinned to the CPU build first, so nothing later pulls a CUDA torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, stpc, ortools, sympy, pytest, hypothesis, triton, pyflakes, transformers, matplotlib, nbclient, nbformat, ipykernel" 2>/dev/null; then
  echo "setting up .venv (CPU torch 2.13.0, stpc and its test extras; log: .venv/install.log)"
  pip_install() { .venv/bin/python -m pip install -q "$@" >>.venv/install.log 2>&1; }
  pip_install --upgrade pip || true
  # The CPU wheel; the PyTorch CPU index for machines without it locally.
  pip_install "torch==2.13.0" || pip_install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
    || { cat .venv/install.log; echo "could not install torch==2.13.0 (CPU)" >&2; exit 1; }
  pip_install -e ".[test]" || { cat .venv/install.log; echo "could not install stpc" >&2; exit 1; }
  .venv/bin/python -c "import torch; assert not torch.version.cuda, 'a CUDA build of torch was installed'"
fi
export PATH="$PWD/.venv/bin:$PATH"
