"""report: what a plan leaves out, so the user hears of it.

* ``fallbacks``: nodes planned all-replicated because stpc has no sharding rule for their
  op (correct, but every rank does all of their work), with their source lines;
* ``hint_misses``: hints whose pattern matches no node or parameter, and parameter hints
  whose predicate accepted no placement a parameter can take (the search then ignores
  them for that parameter);
* ``indivisible``: inputs and parameters with dims that no mesh axis divides (those dims
  are never split).
``stpc.compile`` turns them into warnings (errors with ``strict=True``); the plan's
table lists the indivisible dims.
"""
from __future__ import annotations

import re

import torch

from stpc.planner.hints import Hints
from stpc.planner.strategies import placement_choices

__all__ = ["fallbacks", "hint_misses", "indivisible"]


def fallbacks(plan, tg) -> list[tuple[str, str, str]]:
    """(node, op, source line) of every node the plan runs all-replicated for want of a rule."""
    nodes = {n.name: n for n in tg.graph.nodes}
    return [(name, str(nodes[name].target) if name in nodes else n.op,
             nodes[name].meta.get("source", "") if name in nodes else "")
            for name, n in plan.nodes.items() if n.kind == "replicate-fallback" and n.role == "decision"]


def hint_misses(hints, tg, mesh_shape) -> list[str]:
    """One line per hint that had no effect (see the module docstring)."""
    if not isinstance(hints, Hints):
        return []
    keys = [(n.name, n.meta.get("module", "")) for n in tg.graph.nodes if n.op == "call_function"]
    out = [f"force {pattern!r} matches no node" for pattern, _ in hints.force
           if not any(re.search(pattern, k) for pair in keys for k in pair)]
    params = {}
    for n in tg.graph.nodes:
        if n.op == "placeholder" and n.name in tg.param_fqns and isinstance(n.meta.get("val"), torch.Tensor):
            params[tg.param_fqns[n.name]] = tuple(n.meta["val"].shape)
    mesh = tuple(int(x) for x in mesh_shape)
    for pattern, pred in hints.param_force:
        hit = [f for f in params if re.search(pattern, f)]
        if not hit:
            out.append(f"param_force {pattern!r} matches no parameter")
            continue
        ignored = [f for f in hit if not any(pred(c) for c in placement_choices(params[f], mesh))]
        if ignored:
            more = f" and {len(ignored) - 3} more" if len(ignored) > 3 else ""
            out.append(f"param_force {pattern!r} accepts no placement of {', '.join(ignored[:3])}{more} on mesh "
                       f"{mesh}: ignored for them")
    for fqn in hints.param_exact:
        if fqn not in params:
            out.append(f"param_exact names {fqn!r}, which is not a parameter")
    return out


def indivisible(tg, mesh_shape) -> dict[str, list[int]]:
    """Input / parameter name -> its dims of size > 1 that no mesh axis of size > 1 divides."""
    axes = [int(n) for n in mesh_shape if int(n) > 1]
    out = {}
    for n in tg.graph.nodes:
        v = n.meta.get("val")
        if n.op != "placeholder" or not isinstance(v, torch.Tensor) or not axes:
            continue
        dims = [d for d, s in enumerate(v.shape) if s > 1 and all(s % a for a in axes)]
        if dims:
            out[tg.param_fqns.get(n.name) or tg.buffer_fqns.get(n.name) or n.name] = dims
    return out
