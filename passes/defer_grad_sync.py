"""defer_grad_sync: data-parallel gradient all-reduces leave the graph for a bucketed reducer.

Expects: a graph after ``cleanup`` (duplicate reshards merged: a parameter's reshards
form a tree from its placeholder to its consumers).

A parameter replicated over a mesh axis whose consumers split their work there is read
through ``runtime.grad_all_reduce`` (Megatron's "f": identity forward, all-reduce of the
partial gradient backward), issued synchronously at every use. Where *every* path from a
parameter placeholder to a compute consumer goes through a ``grad_all_reduce`` on axis
``a`` (through other communication nodes only), the local gradient the rank computes
for that parameter is partial on ``a`` whatever path it takes, and the all-reduce can
wait and be batched: those nodes are removed (their forward is the identity) and the
parameter is recorded in ``gm.meta["stpc_deferred_grads"]`` (placeholder name -> group
names, in axis order), in the order backward completes their gradients: the reverse of
their first use in forward (a gradient is complete once backward has passed its
earliest consumer). ``stpc.runtime.GradReducer`` then sums those gradients over the
groups in buckets, launched asynchronously as they become ready during backward and
waited on at its end, as DDP's reducer does. A parameter that any consumer reads
without splitting on ``a`` (its gradient there is already complete) keeps its
synchronous reduction: summing a complete gradient over the axis would multiply it.

Guarantees: the same values forward; with the reducer, the same gradients (summed in
another order: fp32 rounding differs). ``verify`` no longer sees the deferred
all-reduces (the reducer issues them in the same order on every rank: the graph is
one SPMD program).
"""
from __future__ import annotations

import torch.fx as fx

from ._common import finish
from stpc import runtime


def _paths(node: fx.Node, path: tuple = ()):
    """Every path of communication nodes from ``node`` to a compute consumer: (nodes...)."""
    users = list(node.users)
    if not users:
        yield path
    for u in users:
        if u.op == "call_function" and "comm" in u.meta:
            yield from _paths(u, path + (u,))
        else:
            yield path


def defer_grad_sync(gm: fx.GraphModule, plan=None) -> fx.GraphModule:
    """Remove the ``grad_all_reduce`` nodes a bucketed reducer can take over; see the module
    docstring. ``gm.meta["stpc_deferred_grads"]`` lists what the reducer must sum. A tied
    parameter read through several placeholders (``gm.meta["stpc_tied_params"]``:
    placeholder -> the first one) is deferred on the axes all of them defer."""
    groups = list(gm.meta.get("stpc_groups", []))
    tied = dict(gm.meta.get("stpc_tied_params", {}))
    found: dict[str, dict[int, set]] = {}  # placeholder -> axis -> the grad_all_reduce nodes to remove
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        if not ph.meta.get("param") or plan is not None and getattr(plan.nodes.get(ph.name), "role", "") != "param":
            continue
        paths = list(_paths(ph))
        if not paths or paths == [()]:
            continue
        for a, g in enumerate(groups):
            on_a = [[n for n in p if n.target is runtime.grad_all_reduce and n.kwargs.get("group") == g]
                    for p in paths]
            if all(len(x) == 1 for x in on_a):
                found.setdefault(ph.name, {})[a] = {x[0] for x in on_a}
    # a tied parameter sums the gradients of all its placeholders: defer an axis only if all do
    members: dict[str, list[str]] = {}
    for ph in [n.name for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get("param")]:
        members.setdefault(tied.get(ph, ph), []).append(ph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def first_use(ph: str) -> int:
        node = next(n for n in gm.graph.nodes if n.name == ph)
        ends = [p[-1] if p else node for p in _paths(node)]
        return min((order[u] for e in ends for u in e.users), default=len(order))

    deferred: dict[str, list[str]] = {}
    for root, phs in members.items():
        axes = set.intersection(*[set(found.get(p, {})) for p in phs])
        for p in phs:
            for a in sorted(axes):
                for node in found[p][a]:
                    node.replace_all_uses_with(node.args[0])
                    gm.graph.erase_node(node)
        if axes:
            deferred[phs[0]] = [groups[a] for a in sorted(axes)]
    # ready order: the parameter used last in forward has its gradient first
    uses = {ph: min(first_use(p) for p in members[tied.get(ph, ph)]) for ph in deferred}
    gm.meta["stpc_deferred_grads"] = {ph: deferred[ph] for ph in sorted(deferred, key=lambda ph: -uses[ph])}
    return finish(gm)
