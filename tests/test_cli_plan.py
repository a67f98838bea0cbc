import json
import subprocess
import sys

import pytest


def test_plan_cli_json(tmp_path):
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "stpc", "plan", "--model", "llama-tiny", "--mesh", "4",
                        "--cluster", "dgx-h100", "--batch", "8", "--seq", "64", "--json", str(out),
                        "--dump", str(tmp_path / "p.txt")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    for key in ("plan_hash", "modelled_step_time_s", "peak_memory_bytes", "solve_time_s", "total_time_s",
                "num_nodes", "num_variables", "strategy_counts", "search_time_s"):
        assert key in d, key
    assert d["total_time_s"] >= d["search_time_s"] >= d["solve_time_s"] > 0
    # the mesh-independent analysis is part of the trace, timed on its own
    assert d["trace_time_s"] > d["analysis_time_s"] > 0
    assert d["total_time_s"] >= d["trace_time_s"] + d["search_time_s"]
    assert sum(d["strategy_counts"].values()) > 0 and len(d["plan_hash"]) == 64
    assert d["optimal"] is True and d["unresolved"] == [] and "not proven optimal" not in r.stdout
    from stpc.planner import Plan
    assert Plan.load(str(tmp_path / "p.plan.json")).hash() == d["plan_hash"]
    assert "modelled step" in (tmp_path / "p.txt").read_text()
    # the default print is the plan's summary; its split is in the JSON too
    assert "compute + exposed comm = the step time" in r.stdout and "(x 2, tied: planned once)" in r.stdout
    bd = d["breakdown"]
    # (the solver's objective is whole nanoseconds per group: under half a nanosecond off each)
    assert abs(bd["compute_s"] + bd["exposed_s"] - d["modelled_step_time_s"]) <= 0.5e-9 * d["num_nodes"]


def test_plan_cli_infeasible_budget_message(tmp_path):
    """No plan fits: a failure (exit code 1), one line on stderr naming the smallest budget
    that fits and the fix, no traceback."""
    r = subprocess.run([sys.executable, "-m", "stpc", "plan", "--model", "llama-tiny", "--mesh", "2",
                        "--cluster", "dgx-h100", "--batch", "8", "--seq", "64", "--budget-gib", "0.000001"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "smallest feasible budget" in r.stderr and "Fix: --budget-gib" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


# ---------------------------------------------------------------- --model: zoo, factory, Hugging Face config

FACTORY = '''
import torch
from stpc import models


def build(batch=4, seq=16, layers=2):
    with torch.device("meta"):
        model = models.build("llama-tiny", n_layers=layers)
    return model, models.example_inputs("llama-tiny", batch, seq)


def keywords():
    with torch.device("meta"):
        model = models.build("gpt-tiny")
    idx, tgt = models.example_inputs("gpt-tiny", 4, 16)
    return model, {"idx": idx, "targets": tgt}
'''


def _main(capsys, *argv):
    from stpc.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_a_factory_at_reduced_depth(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = _main(capsys, "plan", "--model", "my_models:build", "--mesh", "4", "--cluster", "cpu-local",
                           "--layers", "3", "--batch", "8", "--seq", "32")
    assert code == 0, err
    assert "model my_models:build (n_layers=3)" in out and "batch 8 seq 32" in out
    assert "layers.0 .. layers.2  (x 3, tied: planned once)" in out and "attn.q_proj" in out
    code, out, err = _main(capsys, "plan", "--model", "my_models:keywords", "--mesh", "2", "--cluster", "cpu-local",
                           "--brief")
    assert code == 0, err
    assert "layout: mesh 2" in out and "strategies:" in out and "x 2, tied" not in out
    # a flag the factory does not take is a usage error, not a traceback
    code, out, err = _main(capsys, "plan", "--model", "my_models:keywords", "--mesh", "2", "--batch", "3")
    assert code == 2 and "takes no batch parameter" in err and "Traceback" not in err


def test_plan_and_trace_a_hugging_face_config(tmp_path, capsys):
    pytest.importorskip("transformers")
    cfg = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 0}
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    code, out, err = _main(capsys, "plan", "--model", str(folder / "config.json"), "--mesh", "2x2", "--cluster",
                           "cpu-local", "--batch", "4", "--seq", "128", "--layers", "3")
    assert code == 0, err
    assert "llama:tiny-llama (n_layers=3)" in out and "batch 4 seq 64" in out  # seq capped at the positions
    assert "model.layers.0 .. model.layers.2  (x 3, tied: planned once)" in out
    assert "self_attn.q_proj" in out and "lm_head" in out
    code, out, err = _main(capsys, "trace", "--model", str(folder), "--batch", "2", "--seq", "16")
    assert code == 0, err
    assert "parameters" in out and "nodes" in out


def test_unknown_model_is_a_usage_error(capsys):
    from stpc import models

    for verb in ("plan", "trace"):
        argv = [verb, "--model", "llama-7b"] + (["--mesh", "2"] if verb == "plan" else [])
        code, out, err = _main(capsys, *argv)
        assert code == 2, (verb, out, err)
        assert len(err.strip().splitlines()) == 1 and "unknown model 'llama-7b'" in err
        assert all(name in err for name in models.CONFIGS) and "config.json" in err and "module:factory" in err
    code, _, err = _main(capsys, "plan", "--model", "no_such_module_x:build", "--mesh", "2")
    assert code == 2 and "no module 'no_such_module_x'" in err
    code, _, err = _main(capsys, "plan", "--model", "missing/config.json", "--mesh", "2")
    assert code == 2 and "no such Hugging Face config file" in err


def test_plan_cli_solver_time_limit_must_be_positive(capsys):
    code, _, err = _main(capsys, "plan", "--model", "llama-tiny", "--mesh", "2", "--solver-time-limit", "0")
    assert code == 2 and "--solver-time-limit 0" in err and "Fix: give a number of seconds above 0" in err


def test_plan_cli_recompute(tmp_path):
    """``--recompute full`` plans every layer recomputed, ``selective`` all but the outputs it
    keeps (the layout and the summary say so, and the peaks order full < selective < none)."""
    peaks = {}
    for mode in ("none", "selective", "full"):
        out = tmp_path / f"{mode}.json"
        r = subprocess.run([sys.executable, "-m", "stpc", "plan", "--model", "llama-tiny", "--mesh", "4",
                            "--cluster", "cpu-local", "--batch", "8", "--seq", "64", "--recompute", mode,
                            "--json", str(out)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        d = json.loads(out.read_text())
        assert (d["layout"] or {}).get("recompute") == (None if mode == "none" else mode)
        assert ("layers recomputed in backward" in r.stdout) == (mode != "none")
        assert ("but for their matmuls" in r.stdout) == (mode == "selective")
        peaks[mode] = d["peak_memory_bytes"]
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    # --recompute-layers 1: the first of llama-tiny's two layers only, between none and full
    out = tmp_path / "first.json"
    r = subprocess.run([sys.executable, "-m", "stpc", "plan", "--model", "llama-tiny", "--mesh", "4",
                        "--cluster", "cpu-local", "--batch", "8", "--seq", "64", "--recompute", "full",
                        "--recompute-layers", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["layout"]["recompute_layers"] == 1 and "the first layer recomputed in backward" in r.stdout
    assert peaks["full"] < d["peak_memory_bytes"] < peaks["none"]


def test_plan_cli_recompute_layers_needs_a_level(capsys):
    code, _, err = _main(capsys, "plan", "--model", "llama-tiny", "--mesh", "2", "--recompute-layers", "1")
    assert code == 2 and "--recompute-layers 1" in err and "Fix: add --recompute full" in err


def test_plan_cli_bucket_mb(tmp_path, capsys):
    """``--bucket-mb``: the plan is costed with the program's gradient buckets (``none``: each
    gradient summed where backward makes it, dearer), the JSON says which; a size that is no
    positive number is a usage error naming the fix."""
    got = {}
    for mb in ("25", "none"):
        out = tmp_path / f"{mb}.json"
        code, _, err = _main(capsys, "plan", "--model", "llama-tiny", "--mesh", "4", "--cluster", "cpu-local",
                             "--batch", "32", "--seq", "128", "--hints", "dp", "--bucket-mb", mb, "--brief",
                             "--json", str(out))
        assert code == 0, err
        got[mb] = json.loads(out.read_text())
    assert got["25"]["grad_bucket_bytes"] == 25 * 2**20 and got["none"]["grad_bucket_bytes"] is None
    assert got["none"]["modelled_step_time_s"] > got["25"]["modelled_step_time_s"]
    for bad in ("0", "-3", "lots"):
        code, _, err = _main(capsys, "plan", "--model", "llama-tiny", "--mesh", "2", "--bucket-mb", bad)
        assert code == 2 and f"--bucket-mb {bad}" in err and "Fix: e.g. --bucket-mb 25" in err, err
