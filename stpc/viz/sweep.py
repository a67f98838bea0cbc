"""Modelled step time against the per-device memory budget: one plan per budget.

``budget_sweep(tg, mesh)`` plans ``tg`` with ``stpc.planner.search`` under a range of
budgets (by default from the smallest that any plan fits, which the solver computes exactly,
up to a little past the unconstrained plan's peak) and ``sweep(points)`` draws the curve.
Every point is an exact optimum under its budget, so the curve never rises as the budget
grows (a larger budget admits every plan a smaller one did); a budget below the smallest
feasible one comes back as a point marked infeasible, with the solver's ``min_budget``.

Both numbers are the planner's models (the cluster's cost model, the MemoryModel), not
measurements: the picture says "modelled".
"""
from __future__ import annotations

import numpy as np

from stpc.planner import InfeasibleBudget, search
from stpc.viz._figure import new_figure, save, unit


def budget_sweep(tg, mesh, budgets=None, points: int = 8, cluster="cpu-local", hints=None, **search_kw) -> dict:
    """Plan ``tg`` on ``mesh`` under each budget (bytes per device). ``budgets`` None:
    ``points`` budgets spaced geometrically from the smallest feasible budget to 1.1x the
    unconstrained plan's peak. Returns ``{"free": the unconstrained Plan, "min_budget": the
    smallest feasible budget (bytes), "points": [{"budget_bytes", "feasible", "plan" (None
    where infeasible), "step_time_s", "peak_bytes", "mesh"}] in budget order}``; ``search_kw``
    go to ``search`` (``dtype``, ``temporal``, ...)."""
    free = search(tg, mesh, cluster=cluster, hints=hints, **search_kw)
    try:
        search(tg, mesh, cluster=cluster, hints=hints, budget_bytes=1, **search_kw)
        min_budget = 1.0
    except InfeasibleBudget as e:
        min_budget = float(e.min_budget)
    if budgets is None:
        budgets = np.geomspace(min_budget, max(min_budget, free.peak_memory_bytes) * 1.1, max(2, points))
    out = []
    for b in sorted(float(x) for x in budgets):
        try:
            p = search(tg, mesh, cluster=cluster, hints=hints, budget_bytes=b, **search_kw)
        except InfeasibleBudget as e:
            out.append({"budget_bytes": b, "feasible": False, "plan": None, "step_time_s": None,
                        "peak_bytes": None, "mesh": None, "min_budget": float(e.min_budget)})
            continue
        out.append({"budget_bytes": b, "feasible": True, "plan": p, "step_time_s": p.modelled_step_time_s,
                    "peak_bytes": p.peak_memory_bytes, "mesh": list(p.mesh_shape)})
    return {"free": free, "min_budget": min_budget, "points": out}


def sweep(result: dict, out=None, title: str | None = None):
    """Modelled step time against the budget from :func:`budget_sweep`'s ``result``: one
    marker per feasible budget (labelled with its plan's mesh where that changes), joined as
    steps (the plan of one budget fits every larger one: between two markers the best step
    time is at most the left one's), the smallest feasible budget
    and the unconstrained plan's peak as dashed lines, infeasible budgets as crosses on the x
    axis. Returns the Figure; saves it to ``out`` when given."""
    pts = [p for p in result["points"] if p["feasible"]]
    free = result["free"]
    budgets = [p["budget_bytes"] for p in result["points"]] + [result["min_budget"], free.peak_memory_bytes]
    bscale, bu = unit(budgets, "bytes")
    tscale, tu = unit([p["step_time_s"] for p in pts] + [free.modelled_step_time_s], "seconds")
    fig = new_figure(8, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    x = [p["budget_bytes"] / bscale for p in pts]
    y = [p["step_time_s"] / tscale for p in pts]
    ax.plot(x, y, marker="o", drawstyle="steps-post", color="#4C72B0", label="modelled step time (best plan)")
    last = None
    for p, xi, yi in zip(pts, x, y):  # the plan's mesh shape, where it changes
        if p["mesh"] != last:
            ax.annotate("mesh " + "x".join(map(str, p["mesh"])), (xi, yi), xytext=(4, 4), textcoords="offset points",
                        fontsize=7, color="#555")
        last = p["mesh"]
    ax.axvline(result["min_budget"] / bscale, color="#C44E52", linestyle="--", linewidth=1,
               label=f"smallest feasible budget {result['min_budget'] / bscale:.3g} {bu}")
    ax.axvline(free.peak_memory_bytes / bscale, color="gray", linestyle="--", linewidth=1,
               label=f"unconstrained plan's peak {free.peak_memory_bytes / bscale:.3g} {bu}")
    bad = [p["budget_bytes"] / bscale for p in result["points"] if not p["feasible"]]
    if bad:
        ax.plot(bad, [0] * len(bad), "x", color="#C44E52", clip_on=False, label="infeasible budget")
    ax.set_xlabel(f"memory budget per device ({bu})")
    ax.set_ylabel(f"modelled step time ({tu})")
    ax.set_ylim(0, max(y, default=1.0) * 1.12)  # room for the labels above the highest point
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    mesh = "x".join(map(str, free.mesh_shape))
    ax.set_title(title or f"{free.model} on {int(np.prod(free.mesh_shape))} devices ({free.cluster}): modelled "
                 f"step time against the memory budget (unconstrained: mesh {mesh})", fontsize=9)
    return save(fig, out)
