"""viz: pictures of a plan (matplotlib, drawn on the Agg canvas: no display needed).

In: a Plan (planned in this process for the full pictures; a plan loaded from disk gives what
it keeps), optionally its traced graph and a baseline plan; or a schedule name and a device
count; or a traced graph and a mesh to plan under a range of memory budgets. Out: matplotlib Figures, saved as PNG when given a path.

* ``memory(plan, tg=None, out=None)``: per-device memory over the step as the planner's
  memory model counts it (parameters, gradients, optimizer state, activations kept for
  backward growing through forward and released through backward, each op's transient),
  and the parts at the peak (``memory_timeline`` gives the numbers);
* ``layers(plan, baseline=None, out=None)``: per distinct layer, modelled compute / exposed
  communication / hidden communication of the plan beside a baseline's (``layer_costs``
  gives the numbers; they add up to ``plan.stats["breakdown"]``);
* ``schedule(kind, devices=4, out=None)``: the AG-ring, RS-ring and P(2^k x 2^k) schedules,
  which block of I, W, O each device holds at each step (``schedule_blocks``: simulated
  from the runtime's own peer rules);
* ``sweep(budget_sweep(tg, mesh), out=None)``: modelled step time against the memory budget,
  one exact plan per budget (``budget_sweep`` plans them and gives the numbers);
* ``plot_plan(plan, path, baseline=None, tg=None)``: what ``python -m stpc plan --plot`` writes.
"""
from __future__ import annotations

import os

from stpc.viz.costs import layer_costs, layers
from stpc.viz.rings import schedule, schedule_blocks
from stpc.viz.sweep import budget_sweep, sweep
from stpc.viz.timeline import memory, memory_timeline


def plot_paths(path: str | os.PathLike) -> tuple[str, str]:
    """``FILE.png`` -> (``FILE-memory.png``, ``FILE-layers.png``)."""
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}-memory{ext or '.png'}", f"{root}-layers{ext or '.png'}"


def plot_plan(plan, path: str | os.PathLike, baseline=None, tg=None) -> tuple[str, str]:
    """Write the memory picture and the per-layer cost picture (beside ``baseline`` if
    given) of ``plan`` to :func:`plot_paths` of ``path``; returns the two paths."""
    mem_path, layers_path = plot_paths(path)
    memory(plan, tg, out=mem_path)
    layers(plan, baseline, out=layers_path)
    return mem_path, layers_path


__all__ = ["memory", "memory_timeline", "layers", "layer_costs", "schedule", "schedule_blocks", "budget_sweep",
           "sweep", "plot_plan", "plot_paths"]
