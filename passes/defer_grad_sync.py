"""defer_grad_sync: data-parallel gradient all-reduces leave the graph for a bucketed reducer.

Expects: a graph after ``cleanup`` (duplicate reshards merged: a parameter's reshards
form a tree from its placeholder to its consumers).

A parameter replicated over a mesh axis whose consumers split their work there is read
through ``runtime.grad_all_reduce`` (Megatron's "f": identity forward, all-reduce of the
partial gradient backward), issued synchronously at every use. Where *every* path from a
parameter placeholder to a compute consumer goes through a ``grad_all_reduce`` on axis
``a`` (through other communication nodes only), the local gradient the rank computes
for that parameter is partial on ``a`` whatever path it takes, and the all-reduce can
wait and be batched.

The same holds through computation that reads parameters and constants only (GPT's
position embedding: ``embedding(wpe, arange(S))``, replicated, then read by batch-split
work through an ``f``): its values are the same on every rank, so its backward, linear
in the incoming gradient, maps the partial gradient onto a partial gradient of the
parameters. Such nodes (no random op among them) count as part of the parameter's path.
An ``f`` there is removed only if every parameter it is computed from is deferred on its
axis; else that parameter's other gradient would be summed twice or not at all. Kept
in backward, that ``f`` was a blocking all-reduce on the group the reducer's buckets are
in flight on: it waited behind them all, and with it the rest of backward (the bench
runtime measured the 512 KiB one of ``gpt-50m``'s positions at about 9% of the step).

Deferred, those nodes are removed (their forward is the identity) and the
parameter is recorded in ``gm.meta["stpc_deferred_grads"]`` (placeholder name -> group
names, in axis order), in the order backward completes their gradients: the reverse of
their first use in forward (a gradient is complete once backward has passed its
earliest consumer). ``stpc.runtime.GradReducer`` then sums those gradients over the
groups in buckets, launched asynchronously as they become ready during backward and
waited on at its end, as DDP's reducer does. A parameter that any consumer reads
without splitting on ``a`` (its gradient there is already complete) keeps its
synchronous reduction: summing a complete gradient over the axis would multiply it.
So does a parameter *stored split* on ``a`` (ZeRO/FSDP): read through a gather whose
backward keeps this rank's slice of a gradient it takes as complete (GPT's position
embedding, gathered whole and looked up on every rank before its ``f``), its local
gradient is a slice of a partial sum, and summing slices over the axis adds different
rows of the parameter together: only the ``f`` ahead of the gather makes that gradient
complete first.

A parameter that keeps its ``f`` (a consumer reads it whole, or a tied copy does) still
has its gradient read only where autograd sums its uses: late in backward, at its
earliest consumer. Its ``f`` there is marked ``wait="on_read"``: backward issues the
all-reduce and goes on, and the sum waits for it (``runtime.lazy_wait.read_later``), so
it runs beside the rest of backward, as the cost model charges a parameter's gradient sync
(before, a tied head read whole by the embedding all-reduced the head's gradient, the
largest of the step, blocking at the start of backward). Only where such a sum exists: a
gradient with no other use would reach ``.grad`` unwaited.

Guarantees: the same values forward; with the reducer, the same gradients (summed in
another order: fp32 rounding differs). ``verify`` no longer sees the deferred
all-reduces (the reducer issues them in the same order on every rank: the graph is
one SPMD program).
"""
from __future__ import annotations

import torch.fx as fx

from ._common import finish, is_random
from stpc import runtime
from stpc.placement import REPLICATE


def _param_derived(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose values are computed from parameters and constants alone, the same on
    every rank (parameter placeholders included; nothing downstream of an input or of a
    random op)."""
    derived: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.meta.get("param"):
                derived.add(n)
        elif n.op == "get_attr" or (n.op == "call_function" and not is_random(n)
                                    and all(i in derived for i in n.all_input_nodes)):
            derived.add(n)
    return derived


def _paths(node: fx.Node, through: set[fx.Node], path: tuple = ()):
    """Every path from ``node`` to a consumer outside ``through`` (the parameter-derived
    nodes) along communication nodes and nodes of ``through``: (nodes...)."""
    users = list(node.users)
    if not users:
        yield path
    for u in users:
        if u.op == "call_function" and ("comm" in u.meta or u in through):
            yield from _paths(u, through, path + (u,))
        else:
            yield path


def _params_of(node: fx.Node) -> set[str]:
    """The parameter placeholders ``node`` is computed from."""
    seen, todo, out = set(), [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.meta.get("param"):
            out.add(n.name)
        todo.extend(n.all_input_nodes)
    return out


def _mark_read_later(gm: fx.GraphModule, members: dict[str, list[str]], through: set[fx.Node],
                     groups: list[str]) -> None:
    """Mark ``wait="on_read"`` the ``f`` nodes kept on a parameter's paths (``members``: each
    parameter's placeholders, tied copies together) whose gradient autograd sums with a use
    that has no ``f`` on that group: that sum is what first reads the all-reduce's result."""
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for phs in members.values():
        paths = [p for ph in phs for p in _paths(by_name[ph], through)]
        for g in groups:
            on_g = [[n for n in p if n.target is runtime.grad_all_reduce and n.kwargs.get("group") == g]
                    for p in paths]
            if any(not fs for fs in on_g):
                for node in {n for fs in on_g for n in fs}:
                    node.kwargs = {**node.kwargs, "wait": "on_read"}


def defer_grad_sync(gm: fx.GraphModule, plan=None) -> fx.GraphModule:
    """Remove the ``grad_all_reduce`` nodes a bucketed reducer can take over; see the module
    docstring. ``gm.meta["stpc_deferred_grads"]`` lists what the reducer must sum. A tied
    parameter read through several placeholders (``gm.meta["stpc_tied_params"]``:
    placeholder -> the first one) is deferred on the axes all of them defer."""
    groups = list(gm.meta.get("stpc_groups", []))
    tied = dict(gm.meta.get("stpc_tied_params", {}))
    through = _param_derived(gm) - {n for n in gm.graph.nodes if n.op == "placeholder"}
    found: dict[str, dict[int, set]] = {}  # placeholder -> axis -> the grad_all_reduce nodes to remove
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        if not ph.meta.get("param") or plan is not None and getattr(plan.nodes.get(ph.name), "role", "") != "param":
            continue
        paths = list(_paths(ph, through))
        if not paths or paths == [()]:
            continue
        stored = ph.meta.get("placement")
        for a, g in enumerate(groups):
            if stored is not None and stored[a] != REPLICATE:
                continue  # stored split on the axis: its gradient is a slice, not a partial sum
            on_a = [[n for n in p if n.target is runtime.grad_all_reduce and n.kwargs.get("group") == g]
                    for p in paths]
            if all(len(x) == 1 for x in on_a):
                found.setdefault(ph.name, {})[a] = {x[0] for x in on_a}
    # a tied parameter sums the gradients of all its placeholders: defer an axis only if all
    # do; an f after computation shared by several parameters goes only if all of them defer
    members: dict[str, list[str]] = {}
    for ph in [n.name for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get("param")]:
        members.setdefault(tied.get(ph, ph), []).append(ph)
    sources = {node: _params_of(node) for by_axis in found.values() for nodes in by_axis.values() for node in nodes}
    changed = True
    while changed:
        changed = False
        for phs in members.values():
            axes = set.intersection(*[set(found.get(p, {})) for p in phs])
            for p in phs:
                for a in set(found.get(p, {})) - axes:
                    del found[p][a]
                    changed = True
        for ph, by_axis in found.items():
            for a in [a for a, nodes in by_axis.items()
                      if any(a not in found.get(q, {}) for node in nodes for q in sources[node])]:
                del by_axis[a]
                changed = True
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def first_use(ph: str) -> int:
        node = next(n for n in gm.graph.nodes if n.name == ph)
        ends = [p[-1] if p else node for p in _paths(node, through)]
        return min((order[u] for e in ends for u in e.users), default=len(order))

    deferred: dict[str, list[str]] = {}
    for root, phs in members.items():
        if found.get(phs[0]):
            deferred[phs[0]] = [groups[a] for a in sorted(found[phs[0]])]
    uses = {ph: min(first_use(p) for p in members[tied.get(ph, ph)]) for ph in deferred}
    for node in {node for by_axis in found.values() for nodes in by_axis.values() for node in nodes}:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    _mark_read_later(gm, members, through, groups)
    # ready order: the parameter used last in forward has its gradient first
    gm.meta["stpc_deferred_grads"] = {ph: deferred[ph] for ph in sorted(deferred, key=lambda ph: -uses[ph])}
    return finish(gm)
