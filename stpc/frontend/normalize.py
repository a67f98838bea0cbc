"""normalize: multi-output views become single-output ones, so every piece is planned.

``split``, ``split_with_sizes``, ``chunk`` and ``unbind`` return a tuple, read by
``getitem`` nodes. A tuple is no tensor: the planner would see neither the op nor its
input edge, and a sharded input would be cut at the wrong places (GPT-2's fused
``c_attn`` output split into q, k, v). Each ``getitem(split(x, ...), i)`` becomes the
view it is, ``aten.slice.Tensor(x, dim, start, end)`` (``aten.select.int`` for
``unbind``), with the getitem's FakeTensor and source kept; the tuple node goes.
Outputs and values are unchanged. Other tuple-valued ops stay as they are (the passes
run them on replicated operands).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}


def _bounds(node: fx.Node) -> tuple[int, list[tuple[int, int]]] | None:
    """(dim, [(start, end), ...]) of each output of a split-like node."""
    x = node.args[0]
    shape = x.meta["val"].shape
    t = node.target
    if t is aten.unbind.int:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        dim %= len(shape)
        return dim, [(i, i + 1) for i in range(shape[dim])]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    dim %= len(shape)
    n = shape[dim]
    if t is aten.split_with_sizes.default:
        sizes = list(node.args[1])
    elif t is aten.split.Tensor:
        step = int(node.args[1])
        sizes = [min(step, n - s) for s in range(0, n, step)] or [0]
    else:  # chunk: torch.chunk's sizes
        sizes = [v.shape[dim] for v in node.meta["val"]]
    out, start = [], 0
    for s in sizes:
        out.append((start, start + int(s)))
        start += int(s)
    return dim, out


def split_to_slices(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite split-like nodes read only through ``getitem`` into slices; see the module
    docstring. Returns ``gm`` (linted, recompiled)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SPLITS:
            continue
        users = list(node.users)
        if not users or any(u.target is not operator.getitem for u in users):
            continue  # the tuple escapes as a whole: leave it
        dim, bounds = _bounds(node)
        x = node.args[0]
        for u in users:
            i = u.args[1]
            start, end = bounds[i]
            with graph.inserting_before(u):
                if node.target is aten.unbind.int:
                    new = graph.call_function(aten.select.int, (x, dim, start))
                else:
                    new = graph.call_function(aten.slice.Tensor, (x, dim, start, end))
            new.meta.update({k: v for k, v in u.meta.items()})
            for k in ("stack_trace", "nn_module_stack", "source_fn_stack"):
                if k in node.meta and k not in new.meta:
                    new.meta[k] = node.meta[k]
            u.replace_all_uses_with(new)
            graph.erase_node(u)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
