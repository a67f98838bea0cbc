"""cleanup: dead code and redundant reshards.

Expects: a graph after ``insert_collectives`` (and usually ``ring_decompose``).

Guarantees (the program computes the same values and gradients, with fewer nodes):
  * ``_assert_tensor_metadata`` checks from export are dropped (they checked the
    traced, full tensors);
  * duplicate reshards are merged: two communication nodes with the same function,
    input and arguments (e.g. the same layer-norm output all-gathered once per
    q/k/v projection) become one — their gradients add up before the one
    backward collective, which is the same sum;
  * a gather whose only use slices the result straight back to the layout it
    gathered from (``all_gather(grad="slice")`` -> ``shard_slice`` on the same dim
    and group, ``grid_gather(grad="slice")`` -> ``grid_slice`` of the same layout)
    is removed: both directions are the identity;
  * dead nodes are removed, then parameter/buffer placeholders nobody reads (a
    tied weight's second name) — the caller feeds placeholders by name
    (``DistributedModel`` does).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ._common import finish
from stpc import runtime

aten = torch.ops.aten


def _key(n: fx.Node):
    return (n.target, n.args, tuple(sorted(n.kwargs.items(), key=lambda kv: kv[0])))


def _hashable(x):
    try:
        hash(x)
        return True
    except TypeError:
        return False


def cleanup(gm: fx.GraphModule, plan=None) -> fx.GraphModule:
    """Drop asserts, merge duplicate reshards, cancel gather->slice pairs, DCE; see the module docstring."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op == "call_function" and n.target is aten._assert_tensor_metadata.default:
            g.erase_node(n)
    seen: dict = {}
    for n in list(g.nodes):
        if n.op != "call_function" or "comm" not in n.meta or "ring" in n.meta:
            continue
        k = _key(n)
        if not _hashable(k):
            continue
        if k in seen:
            n.replace_all_uses_with(seen[k])
            g.erase_node(n)
        else:
            seen[k] = n
    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in (runtime.shard_slice, runtime.grid_slice):
            continue
        src = n.args[0]
        if not isinstance(src, fx.Node) or src.kwargs.get("group") != n.kwargs.get("group"):
            continue
        same = (src.target is runtime.all_gather and n.target is runtime.shard_slice
                and src.kwargs.get("dim") == n.kwargs.get("dim")) or \
               (src.target is runtime.grid_gather and n.target is runtime.grid_slice
                and all(src.kwargs.get(k) == n.kwargs.get(k) for k in ("kind", "i", "j")))
        if same and src.kwargs.get("grad") == "slice" and len(src.users) == 1:
            n.replace_all_uses_with(src.args[0])
            g.erase_node(n)
            g.erase_node(src)
    g.eliminate_dead_code()
    for n in list(g.nodes):
        if n.op == "placeholder" and n.meta.get("param") and not n.users:
            g.erase_node(n)
    return finish(gm)
