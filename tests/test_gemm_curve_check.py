"""benchmarks/gemm_curve_check.py on the CPU: the GEMMs are the split linears' three phases,
each is timed and set beside the preset's gemm_time, and runs merge into one refitted curve."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import gemm_curve_check  # noqa: E402
from stpc.cost_models import gemm_time, get_device  # noqa: E402

SCRIPT = gemm_curve_check.__file__


def test_shapes_are_each_linears_forward_input_and_weight_gradient():
    rows = gemm_curve_check.gemm_shapes(["gpt-tiny"], tokens=[64], shards=[4])   # d 32, ffn 128
    got = {(r["linear"], r["phase"]): (r["m"], r["k"], r["n"]) for r in rows}
    assert got == {("up", "fwd"): (64, 32, 32), ("up", "dgrad"): (64, 32, 32), ("up", "wgrad"): (32, 64, 32),
                   ("down", "fwd"): (64, 32, 32), ("down", "dgrad"): (64, 32, 32), ("down", "wgrad"): (32, 64, 32)}
    # the up projection's output columns and the down projection's input rows are what the shards cut
    rows = gemm_curve_check.gemm_shapes(["gpt-tiny"], tokens=[8], shards=[1])
    up = next(r for r in rows if r["linear"] == "up" and r["phase"] == "fwd")
    down = next(r for r in rows if r["linear"] == "down" and r["phase"] == "fwd")
    assert (up["k"], up["n"]) == (32, 128) and (down["k"], down["n"]) == (128, 32)


def _run(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--spec", "cpu", "--dtype", "fp32",
                           "--models", "gpt-tiny", "--window-ms", "1", "--windows", "2", "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_cpu_runs_time_every_gemm_beside_the_preset_and_merge_into_one_fit(tmp_path):
    a = _run(tmp_path, "a", "--tokens", "64", "--shards", "1")
    b = _run(tmp_path, "b", "--tokens", "256", "--shards", "2")
    doc = json.loads(a.read_text())
    cpu = get_device("cpu")
    assert doc["spec"] == "CPU" and len(doc["rows"]) == 6
    for r in doc["rows"]:
        assert r["seconds"] > 0 and r["flops"] == 2.0 * r["m"] * r["k"] * r["n"]
        assert r["model_s"] == pytest.approx(gemm_time(cpu, r["flops"], 4 * (r["m"] * r["k"] + r["k"] * r["n"]
                                                                              + r["m"] * r["n"]), "fp32"))
        assert r["error"] == pytest.approx(r["model_s"] / r["seconds"] - 1)
    assert doc["curves"]["preset"] == {"efficiency": cpu.efficiency, "ramp_s": cpu.ramp_s("fp32")}
    md = tmp_path / "all.md"
    proc = subprocess.run([sys.executable, SCRIPT, "--from-json", str(a), str(b), "--markdown", str(md)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = md.read_text()
    assert text.count("--tokens") == 2 and "Commands:" in text   # both runs named
    merged = gemm_curve_check.merge([json.loads(a.read_text()), json.loads(b.read_text())])
    assert len(merged["rows"]) == 12
    rate, ramp = gemm_curve_check.fit_gemm_curve(merged["rows"])
    assert merged["curves"]["fitted"]["efficiency"] == pytest.approx(rate / cpu.peak_flops["fp32"])
    assert f"| fitted to these rows (in-sample) | {rate / cpu.peak_flops['fp32']:.3f} |" in text


def test_runs_under_other_presets_do_not_merge(tmp_path):
    doc = json.loads(_run(tmp_path, "a", "--tokens", "64", "--shards", "1").read_text())
    other = {**doc, "curves": {**doc["curves"], "preset": {"efficiency": 0.5, "ramp_s": 0.0}}}
    with pytest.raises(ValueError, match="different presets"):
        gemm_curve_check.merge([doc, other])
    with pytest.raises(ValueError, match="cannot merge a run on"):
        gemm_curve_check.merge([doc, {**doc, "dtype": "bf16"}])
