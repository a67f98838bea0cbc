"""The README's example, run as its users run it: ``torchrun --nproc_per_node 4 train.py``
(gloo on 127.0.0.1), text taken from the README itself so the two cannot drift apart."""
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from stpc.runtime.launch import free_port

pytestmark = pytest.mark.multirank

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    m = re.search(r"<!-- example: train.py -->\s*```python\n(.*?)```", text, re.S)
    assert m, "README lost its train.py example"
    return m.group(1)


def test_readme_example_under_torchrun(tmp_path):
    (tmp_path / "train.py").write_text(readme_example())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "4",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "train.py"]
    # (the fault handler prints each thread's Python stack if a rank dies by a signal)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=400)
    finally:  # torchrun and its workers are one process group: none is left behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, _failure(out)
    assert re.search(r"on mesh \[2, 2\]: parity MATCH", out), _failure(out)
    assert (tmp_path / "out" / "ckpt" / ".metadata").exists()


# What a rank that dies by a signal prints before it goes (C++ terminate, glibc's heap checks,
# Python's fault handler): kept from anywhere in the output, since the other ranks' tracebacks
# after it fill the tail. (A rank once died by SIGABRT here in CI and its message was lost.)
_DEATH = re.compile(r"terminate called|what\(\):|Fatal Python error|corrupted|double free|free\(\)|"
                    r"malloc\(\)|Segmentation fault|Aborted|Signal \d+")


def _failure(out: str) -> str:
    """The output's tail, with every line that says how a rank died first."""
    deaths = [line for line in out.splitlines() if _DEATH.search(line)]
    return "\n".join(["how ranks died:", *deaths[:40], "", "the output's tail:", out[-4000:]])
