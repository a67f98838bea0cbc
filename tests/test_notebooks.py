"""The notebooks run top to bottom in a Jupyter kernel (nbclient), as a reader runs them, and
show what they say they show.

Each is executed in memory with one extra cell appended (never saved) that prints, as JSON,
the facts its text claims; the test reads them back: graph_dumps.ipynb's diffs show the
collectives insert_collectives adds and the ring ops ring_decompose puts in their place;
plan_explorer.ipynb's budget sweep never rises as the budget grows; spatial_temporal.ipynb's
primitives agree with the plain matmul on 4 ranks. The files themselves are committed
without outputs.
"""
import json
import pathlib

import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(p.name for p in ROOT.glob("*.ipynb"))

PROBES = {
    "graph_dumps.ipynb": """
import json
print(json.dumps({"passes": log.names, "strategy_counts": plan.strategy_counts(),
                  "diffs": {d.title: {**d.counts(), "ops_added": dict(d.ops_added()),
                                      "ops_removed": dict(d.ops_removed())} for d in log.diffs()}}))
""",
    "plan_explorer.ipynb": """
import json
print(json.dumps({"nodes": len(plan.nodes), "min_budget": sweep["min_budget"],
                  "free_peak": sweep["free"].peak_memory_bytes, "free_step": sweep["free"].modelled_step_time_s,
                  "points": [[p["budget_bytes"], p["feasible"], p["step_time_s"], p["peak_bytes"]]
                             for p in sweep["points"]]}))
""",
    "spatial_temporal.ipynb": """
import json
print(json.dumps({"errors": errors, "tol": tol}))
""",
}
MULTIRANK = {"spatial_temporal.ipynb"}  # spawns gloo ranks


def _execute(name: str):
    nb = nbformat.read(ROOT / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBES[name].strip()))
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError (with the cell and its traceback) if any cell fails
    probe = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    return nb, json.loads(probe)


def _outputs(nb, kind: str) -> list:
    return [o["data"][kind] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if kind in o.get("data", {})]


def _check_graph_dumps(nb, facts):
    assert facts["passes"][:4] == ["traced", "shard_params", "insert_collectives", "ring_decompose"]
    diffs, counts = facts["diffs"], facts["strategy_counts"]
    assert diffs["insert_collectives"]["ops_added"].get("all_gather", 0) > 0
    assert diffs["insert_collectives"]["ops_added"].get("reduce_scatter", 0) > 0
    ring = diffs["ring_decompose"]
    assert ring["ops_added"]["ring_allgather_matmul"] == counts["ag_ring"] > 0
    assert ring["ops_added"]["ring_matmul_reducescatter"] == counts["rs_ring"] > 0
    assert ring["ops_removed"]["linear"] == counts["ag_ring"] + counts["rs_ring"]
    assert diffs["verify"]["added"] == diffs["verify"]["removed"] == diffs["verify"]["changed"] == 0
    html = "".join(_outputs(nb, "text/html"))
    assert "#e6ffec" in html and "#ffebe9" in html and "#fff8c5" in html  # added / removed / changed rows
    assert "ring_allgather_matmul" in html


def _check_plan_explorer(nb, facts):
    assert facts["nodes"] > 0
    points = facts["points"]
    assert len(points) >= 5 and all(feasible for _, feasible, _, _ in points)
    budgets = [b for b, *_ in points]
    assert budgets == sorted(budgets) and budgets[0] == pytest.approx(facts["min_budget"])
    assert budgets[-1] >= facts["free_peak"]
    steps = [t for _, _, t, _ in points]
    for a, b in zip(steps, steps[1:]):  # a larger budget never gives a slower plan
        assert b <= a * (1 + 1e-9), steps
    assert steps[0] > steps[-1]  # the budget binds at the low end
    assert steps[-1] == pytest.approx(facts["free_step"])
    assert all(peak <= b * (1 + 1e-9) for b, _, _, peak in points)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "the smallest feasible budget is" in text  # InfeasibleBudget's min_budget, printed
    assert len(_outputs(nb, "image/png")) >= 3  # layers, memory, sweep


def _check_spatial_temporal(nb, facts):
    errors, tol = facts["errors"], facts["tol"]
    assert set(errors) == {"ag_ring", "rs_ring", "p2x2"}
    for prim, errs in errors.items():
        assert set(errs) == {"out", "dx", "dw"} and max(errs.values()) <= tol, (prim, errs)
    assert len(_outputs(nb, "image/png")) == 3  # the three schedules


CHECKS = {"graph_dumps.ipynb": _check_graph_dumps, "plan_explorer.ipynb": _check_plan_explorer,
          "spatial_temporal.ipynb": _check_spatial_temporal}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.multirank) if n in MULTIRANK else n
                                  for n in NOTEBOOKS])
def test_notebook_runs_and_shows_what_it_says(name):
    assert name in CHECKS, f"{name}: a new notebook needs a probe and a check here"
    nb, facts = _execute(name)
    CHECKS[name](nb, facts)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
    nb = nbformat.read(ROOT / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}:{cell.id}: clear its outputs"
