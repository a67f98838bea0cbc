import json
import subprocess
import sys


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
    from stpc.planner import Plan
    assert Plan.load(str(tmp_path / "p.plan.json")).hash() == d["plan_hash"]
    assert "modelled step" in (tmp_path / "p.txt").read_text()


def test_plan_cli_infeasible_budget_message(tmp_path):
    r = subprocess.run([sys.executable, "-m", "stpc", "plan", "--model", "llama-tiny", "--mesh", "2",
                        "--cluster", "dgx-h100", "--batch", "8", "--seq", "64", "--budget-gib", "0.000001"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3
    assert "smallest feasible budget" in r.stdout
