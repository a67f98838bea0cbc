"""benchmarks/fused_ops_check.py on 2 CPU gloo ranks: stpc's ring ops run beside the unfused
collective + matmul and agree with it, torch's fused ops say why they did not run, and
the shapes are the model's split linears."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import fused_ops_check  # noqa: E402

SCRIPT = fused_ops_check.__file__


def test_op_shapes_are_one_ranks_operands_of_the_split_linears():
    rows = fused_ops_check.op_shapes("gpt-tiny", 2, 256)
    ag = [r for r in rows if r["op"].startswith("all_gather")]
    rs = [r for r in rows if r["op"].startswith("matmul")]
    assert {tuple(r["linears"]) for r in ag} == {("q_proj", "k_proj", "v_proj"), ("fc1",)}
    assert {tuple(r["linears"]) for r in rs} == {("o_proj",), ("fc2",)}
    for r in ag:  # the token shard is gathered: its rows are 1/P of the tokens, the weight's columns 1/P
        assert r["x"][0] == 128 and r["x"][1] == r["w"][0]
    for r in rs:  # the contraction dim is split; the tokens are whole before the scatter
        assert r["x"][0] == 256 and r["x"][1] == r["w"][0]
    with pytest.raises(ValueError, match="divide over 3 ranks"):
        fused_ops_check.op_shapes("gpt-tiny", 3, 256)


def test_two_cpu_ranks_measure_and_agree(tmp_path):
    out = tmp_path / "fused.json"
    md = tmp_path / "fused.md"
    proc = subprocess.run([sys.executable, SCRIPT, "--ranks", "2", "--model", "gpt-tiny", "--tokens", "256",
                           "--iters", "2", "--warmup", "1", "--json", str(out), "--markdown", str(md)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["config"]["backend"] == "gloo" and len(data["rows"]) == 4
    for r in data["rows"]:
        assert r["stpc_ring_agrees"] is True
        assert r["unfused_s"] > 0 and r["stpc_ring_s"] > 0
        assert r["torch_fused_not_run"] == "symmetric memory needs CUDA tensors"
    text = md.read_text()
    assert "| matmul + reduce_scatter | fc2 | 256x64 | 64x32 |" in text
    assert "symmetric memory needs CUDA tensors" in text
