"""stpc.viz.budget_sweep / sweep: one exact plan per memory budget, drawn as modelled step
time against the budget. A larger budget admits every plan a smaller one did, so the curve
never rises; below the smallest feasible budget the point says infeasible."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("matplotlib")

import stpc  # noqa: E402
from stpc import models, viz  # noqa: E402
from stpc.planner import InfeasibleBudget, search  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tg():
    with torch.device("meta"):
        m = models.build("gpt-tiny")
    return stpc.trace(m, models.example_inputs("gpt-tiny", 16, 64))


@pytest.fixture(scope="module")
def result(tg):
    return viz.budget_sweep(tg, 2, points=6, cluster="cpu-local")


def test_the_sweep_spans_the_smallest_feasible_budget_to_past_the_free_peak(tg, result):
    with pytest.raises(InfeasibleBudget) as e:
        search(tg, 2, cluster="cpu-local", budget_bytes=1)
    assert result["min_budget"] == e.value.min_budget
    pts = result["points"]
    assert len(pts) == 6 and all(p["feasible"] for p in pts)
    assert pts[0]["budget_bytes"] == pytest.approx(result["min_budget"])
    assert pts[-1]["budget_bytes"] == pytest.approx(1.1 * result["free"].peak_memory_bytes)
    for p in pts:
        assert p["peak_bytes"] <= p["budget_bytes"] * (1 + 1e-9) and p["plan"].modelled_step_time_s == p["step_time_s"]


def test_step_time_never_rises_as_the_budget_grows(result):
    steps = [p["step_time_s"] for p in result["points"]]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(steps, steps[1:])), steps
    assert steps[0] > steps[-1]  # the budget binds at the low end
    assert steps[-1] == pytest.approx(result["free"].modelled_step_time_s)  # and not past the free peak


def test_a_budget_below_the_smallest_is_an_infeasible_point(tg, result):
    low = result["min_budget"] * 0.9
    got = viz.budget_sweep(tg, 2, budgets=[result["min_budget"], low], cluster="cpu-local")
    assert [p["feasible"] for p in got["points"]] == [False, True]  # sorted by budget
    assert got["points"][0]["min_budget"] == result["min_budget"] and got["points"][0]["plan"] is None


def test_the_figure_says_modelled_and_marks_the_bounds(tg, result, tmp_path):
    low = viz.budget_sweep(tg, 2, budgets=[result["min_budget"] * 0.9, result["min_budget"]], cluster="cpu-local")
    for res in (result, low):
        fig = viz.sweep(res, out=tmp_path / "sweep.png")
        (ax,) = fig.axes
        assert "modelled" in ax.get_ylabel() and "budget" in ax.get_xlabel()
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert any("smallest feasible" in t for t in labels) and any("unconstrained" in t for t in labels)
        assert (tmp_path / "sweep.png").read_bytes().startswith(PNG)
    assert any("infeasible" in t.get_text() for t in fig.axes[0].get_legend().get_texts())
