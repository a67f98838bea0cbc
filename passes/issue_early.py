"""issue_early: forward-only collectives issued as early as their inputs allow, waited late.

Expects: a graph after ``cleanup``.

A ``runtime.all_reduce`` with ``grad="identity"`` (a forward sum whose backward moves
nothing: e.g. the count of targets a row-split mean cross-entropy divides by) is a
synchronisation point where it stands: every rank waits there for the slowest. When the
values it sums depend on the user's inputs alone (no parameter, no activation), it can
be summed at the very start of the step instead:

  * its producers (the nodes it depends on, back to placeholders and constants) are
    moved to right after the last placeholder, in their order;
  * the collective becomes ``runtime.all_reduce_start`` (issued, not waited on) there,
    and ``runtime.wait`` right before its first use.

So the sum travels while the step computes, and the wait, late in forward, finds it done.

Such a sum that is an output of the step and nothing else (the loss: ``insert_collectives``
replicates the outputs) is issued where it stands and waited where the caller first reads
its value (``runtime.wait_on_read``): ``loss.backward()`` reads only its shape, so the
ranks go into backward without waiting for the slowest one's forward, as under DDP. Any
other collective whose inputs depend on the step's computation stays where it is.

Guarantees: the same values and gradients; every rank issues the same collectives in
the same order (the graph is one SPMD program), now earlier.
"""
from __future__ import annotations

import torch.fx as fx

from ._common import finish, is_random
from stpc import runtime


def _cone(node: fx.Node) -> list[fx.Node] | None:
    """The non-placeholder nodes ``node`` depends on, or None if it depends on a parameter,
    on communication or on a random op (anything but the step's inputs, buffers and
    constants and what is computed from them alone)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in seen:
                continue
            if a.op == "placeholder":
                if a.meta.get("param"):
                    return None
                continue
            if a.op != "call_function" or "comm" in a.meta or is_random(a):
                return None  # (a random op moved would draw in another order)
            seen.add(a)
            todo.append(a)
    return list(seen)


def issue_early(gm: fx.GraphModule, plan=None) -> fx.GraphModule:
    """Hoist and split the forward-only all-reduces that depend on user inputs alone, and
    leave an output's sum to be waited where it is read; see the module docstring."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return finish(gm)
    anchor = placeholders[-1]
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is runtime.all_reduce
                 and n.kwargs.get("grad", "identity") == "identity"]:
        if not node.users:
            continue
        output_only = all(u.op == "output" for u in node.users)
        cone = _cone(node)
        if cone is None and not output_only:
            continue
        where = node
        if cone is not None:
            for n in sorted(cone, key=order.get):  # producers first, in their order
                anchor.append(n)
                anchor = n
            where = anchor
        with gm.graph.inserting_after(where):
            start = gm.graph.call_function(runtime.all_reduce_start, (node.args[0],),
                                           {"group": node.kwargs["group"]})
        start.meta.update(node.meta)  # val, placement, comm: what verify and the dumps read
        if cone is not None:
            anchor = start
        first = min(node.users, key=order.get)
        with gm.graph.inserting_before(first):
            done = gm.graph.call_function(runtime.wait_on_read if output_only else runtime.wait, (start,))
        done.meta.update({k: v for k, v in node.meta.items() if k != "comm"})
        node.replace_all_uses_with(done)
        gm.graph.erase_node(node)
    return finish(gm)


__all__ = ["issue_early"]
