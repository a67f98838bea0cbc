"""benchmarks/cuda_check.py without a GPU: it says so and stops, and its RESULTS.md section
is rendered from a run's JSON as the run recorded it (no figure typed anywhere else)."""
import json
import os
import subprocess
import sys

import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "cuda_check.py")

RUN = {"device": "NVIDIA H100 80GB HBM3", "gpus": 1, "torch": "2.11.0+cu130", "date": "2026-11-25 17:14 UTC",
       "command": "python benchmarks/cuda_check.py --skip parity", "records": [
           {"check": "parity", "case": "llama-tiny/solved/inductor/1xnccl", "ranks": 1, "backend": "nccl",
            "ok": True, "worst_loss": 0.001, "worst_grad": 0.0197, "worst_param": 0.0, "steps": 10,
            "graph_breaks": 0},
           {"check": "parity", "case": "gpt-tiny/megatron/eager/4xcpu:gloo,cuda:gloo", "ranks": 4,
            "backend": "cpu:gloo,cuda:gloo", "ok": False,
            "error": "SpawnError: rank 0 failed:\nprocess exited with code -11 without reporting\n"
                     "(ranks [1, 2, 3] failed after it, probably as a consequence)"},
           {"check": "gloo-cuda", "op": "all_reduce", "ok": True},
           {"check": "gloo-cuda", "op": "send_recv", "ok": False,
            "error": "RuntimeError: pair.cc:339] writev: Bad address |  | (ranks [0, 1, 2] failed after it)"},
           {"check": "memory", "plan": "recompute", "compiler": "eager", "layout": "mesh 1", "ranks": 1,
            "backend": "nccl", "cluster": "dgx-h100", "model": "gpt-50m d1024 L4", "batch": 16, "seq": 512,
            "predicted_peak_bytes": 1986420740.0, "cuda_peak_bytes": 1717859328, "memory_error": 0.1563,
            "predicted_step_s": 0.08504, "measured_step_s": 0.0905, "time_error": -0.0603},
           {"check": "bf16-time", "model": "llama2-7b (4 layers)", "batch": 4, "seq": 2048, "compiler": "eager",
            "predicted_step_s": 0.1, "predicted_compute_s": 0.098, "predicted_optimizer_s": 0.002,
            "measured_step_s": 0.125, "measured_fwd_bwd_s": 0.12, "time_error": -0.2},
           {"check": "bf16-time", "model": "llama2-7b", "ok": False, "error": "RuntimeError: out of memory"}]}


def test_without_cuda_it_says_so_and_stops():
    if torch.cuda.is_available():  # (on a GPU machine the script runs for real: nothing to check here)
        return
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_the_section_is_rendered_from_the_runs_json(tmp_path):
    js, md = tmp_path / "cuda.json", tmp_path / "cuda.md"
    js.write_text(json.dumps(RUN))
    proc = subprocess.run([sys.executable, SCRIPT, "--from-json", str(js), "--markdown", str(md)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = md.read_text()
    assert "Command: `python benchmarks/cuda_check.py --skip parity`" in text
    assert "| llama-tiny/solved/inductor | 1, nccl | 10 | 0.001 | 0.020 | 0.000 | 0 | pass |" in text
    assert "failed: a rank died with exit code -11 (SIGSEGV)" in text
    assert "`all_reduce` ran; `send_recv` failed: RuntimeError: pair.cc:339] writev: Bad address." in text
    assert "| recompute | eager | 1 | 1,894 | 1,638 | +15.6% | 85.0 | 90.5 | -6.0% |" in text
    assert "bf16 step time: llama2-7b (4 layers), batch 4 x seq 2048" in text
    assert "| eager | 100.0 | 2.0 | 125.0 | 120.0 | 5.0 | -20.0% |" in text
    assert "The bf16-time check failed: RuntimeError: out of memory." in text


def test_parity_families_picks_the_cases_it_names(monkeypatch):
    """``--parity-families dp``: only the data-parallel cases spawn ranks (each case's failure is its record)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("cuda_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    spawned = []

    def fake_spawn(fn, world, cases, **kw):
        spawned.append(cases[0]["id"])
        raise RuntimeError("no GPU here")
    monkeypatch.setattr(mod, "spawn", fake_spawn)
    recs = mod.parity(4, "gloo", 1, only=["dp"])
    assert spawned == ["gpt-tiny/dp/eager/4xgloo", "gpt-tiny/dp/inductor/4xgloo"]
    assert [r["ok"] for r in recs] == [False, False] and all("no GPU here" in r["error"] for r in recs)
    assert len(mod.parity(4, "gloo", 1, only=[])) == 0
