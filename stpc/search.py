"""search: plan on every logical mesh shape of N devices and keep the best.

A shape views the N devices as up to three axes (row-major, the last axis
innermost). Every factorisation of N into at most three factors >= 2 is tried,
each ordered largest-first so the smallest axes are innermost and stay inside
a node (a permutation of the same factors only moves which groups cross node
boundaries; pass an explicit shape such as ``4x8`` to choose it yourself).
Each shape is solved exactly; the lowest modelled step time wins (ties: the
fewer axes, then the earlier shape). Each shape after the first is solved with
an objective cap just below the best so far, so a shape that cannot win is
discarded as soon as CP-SAT's bound proves it.
"""
from __future__ import annotations

import time

from stpc.cost_models import CostModel, get_cluster
from stpc.hints import preset
from stpc.plan import Plan
from stpc.planner import HintUnsatisfiable, Hints, plan_graph
from stpc.solver import InfeasibleBudget, NoBetterPlan
from stpc.trace import TracedGraph


def mesh_shapes(n: int, max_axes: int = 3) -> list[tuple[int, ...]]:
    """Every factorisation of ``n`` into at most ``max_axes`` factors >= 2, largest first."""
    out = []

    def rec(rest, prefix, hi):
        if rest == 1:
            if prefix:
                out.append(tuple(prefix))
            return
        if len(prefix) == max_axes:
            return
        for f in range(min(hi, rest), 1, -1):
            if rest % f == 0:
                rec(rest // f, prefix + [f], f)

    rec(n, [], n)
    return sorted(out, key=lambda s: (len(s), s)) or [(1,)]


def parse_mesh(spec) -> tuple[tuple[int, ...] | None, int]:
    """``"32"`` -> (None, 32): the planner chooses the shape; ``"4x8"`` -> ((4, 8), 32)."""
    if isinstance(spec, int):
        return None, spec
    if isinstance(spec, (tuple, list)):
        shape = tuple(int(x) for x in spec)
        return shape, _prod(shape)
    parts = [int(x) for x in str(spec).lower().split("x")]
    return (None, parts[0]) if len(parts) == 1 else (tuple(parts), _prod(parts))


def _prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


def search(tg: TracedGraph, mesh, cluster="cpu-local", budget_bytes: float | None = None,
           hints: str | Hints | None = None, temporal: bool = True, dtype: str = "fp32",
           optimizer_layout: str = "fp32-adam") -> Plan:
    """Plan ``tg`` on ``mesh`` (an int N, "N", "AxB", or a shape tuple)."""
    t0 = time.perf_counter()
    cl = get_cluster(cluster) if isinstance(cluster, str) else cluster
    shape, n = parse_mesh(mesh)
    shapes = [shape] if shape else mesh_shapes(n)
    if hints == "megatron" and shape is None:
        shapes = [s for s in shapes if len(s) <= 2]  # Megatron's DP x TP
    best, tried, infeasible = None, [], []
    for s in shapes:
        h = preset(hints, s) if isinstance(hints, str) else (hints or Hints())
        if not temporal:
            h.temporal = False
        cm = CostModel(cl, s)
        try:
            # Shapes after the first only matter if they beat the best so far: cap them,
            # and CP-SAT can drop a shape as soon as its bound proves it cannot win.
            cap = None if best is None else best.modelled_step_time_s - 1e-9
            t_shape = time.perf_counter()
            p = plan_graph(tg, cm, budget_bytes, h, optimizer_layout, dtype, cap_s=cap)
        except InfeasibleBudget as e:
            infeasible.append(e)
            continue
        except HintUnsatisfiable as e:  # e.g. a forced family this shape cannot run
            tried.append({"mesh": list(s), "modelled_step_time_s": None, "skipped": str(e),
                          "solve_time_s": 0.0})
            continue
        except NoBetterPlan:
            tried.append({"mesh": list(s), "modelled_step_time_s": None, "pruned": True,
                          "solve_time_s": time.perf_counter() - t_shape})
            continue
        tried.append({"mesh": list(s), "modelled_step_time_s": p.modelled_step_time_s, "pruned": False,
                      "peak_memory_bytes": p.peak_memory_bytes, "solve_time_s": p.stats["solve_time_s"]})
        best = p  # (capped: it is better than the previous best)
    if best is None and infeasible:
        raise InfeasibleBudget(int(budget_bytes), min(e.min_budget for e in infeasible))
    if best is None:
        raise HintUnsatisfiable("no mesh shape satisfies the hints: "
                                + "; ".join(t["skipped"] for t in tried if t.get("skipped")))
    best.stats["search_time_s"] = time.perf_counter() - t0
    best.stats["mesh_shapes_tried"] = tried
    best.stats["solve_time_s"] = sum(t["solve_time_s"] for t in tried)
    return best
