"""normalize: multi-output views become single-output ones, so every piece is planned; an
RMSNorm written out in elementwise ops becomes one ``rms_norm`` node.

``split``, ``split_with_sizes``, ``chunk`` and ``unbind`` return a tuple, read by
``getitem`` nodes. A tuple is no tensor: the planner would see neither the op nor its
input edge, and a sharded input would be cut at the wrong places (GPT-2's fused
``c_attn`` output split into q, k, v). Each ``getitem(split(x, ...), i)`` becomes the
view it is, ``aten.slice.Tensor(x, dim, start, end)`` (``aten.select.int`` for
``unbind``), with the getitem's FakeTensor and source kept; the tuple node goes.
Outputs and values are unchanged. Other tuple-valued ops stay as they are (the passes
run them on replicated operands).

RMSNorm as Llama writes it, ``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``, traces
to five ops. Planned one by one, the mean over the last dim of a tensor held in
PrimePar's grid layout has no placement to go to (a sum over the grid's columns only,
kept split over its rows), so a Llama layer could not stay in grid layout through its
norms. ``fuse_rms_norm`` makes the five one ``aten.rms_norm(x, [d], None, eps)``, which
the planner treats as a norm over the last dim, as it does LayerNorm (kept in the grid
layout by exchanging per-row statistics, ``runtime.grid_rms_norm``). The weight's ``mul``
stays a node of its own. aten's ``rms_norm`` without a weight is those five ops
(CompositeImplicitAutograd on CPU: the same kernels, bit for bit, and the same tensors
saved for backward), so the program computes what the model does.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
_ADDS = (aten.add.Tensor, aten.add.Scalar)


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


def _only_user(node: fx.Node, target) -> fx.Node | None:
    """``node``'s one user if it calls ``target`` (one of ``target``), else None."""
    if len(node.users) != 1:
        return None
    (u,) = node.users
    targets = target if isinstance(target, tuple) else (target,)
    return u if u.op == "call_function" and u.target in targets else None


def _rms_chain(pow_node: fx.Node) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """(x, eps, [pow, mean, add, rsqrt, mul]) if ``pow_node`` opens Llama's written-out
    RMSNorm over the last dim, ``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``,
    whose intermediate results nothing else reads; else None."""
    if pow_node.target is not aten.pow.Tensor_Scalar or pow_node.args[1] != 2:
        return None
    x = pow_node.args[0]
    if not isinstance(x, fx.Node) or not isinstance(x.meta.get("val"), torch.Tensor) or x.meta["val"].dim() < 1:
        return None
    ndim = x.meta["val"].dim()
    mean = _only_user(pow_node, aten.mean.dim)
    if mean is None or len(mean.args) < 2 or [d % ndim for d in mean.args[1]] != [ndim - 1]:
        return None
    keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not keep or mean.kwargs.get("dtype") is not None:
        return None
    add = _only_user(mean, _ADDS)
    if add is None or add.args[0] is not mean or not isinstance(add.args[1], (int, float)) or add.kwargs:
        return None
    rsqrt = _only_user(add, aten.rsqrt.default)
    mul = rsqrt and _only_user(rsqrt, aten.mul.Tensor)
    if mul is None or set(mul.args) != {x, rsqrt} or len(mul.args) != 2:
        return None
    if mul.meta["val"].shape != x.meta["val"].shape or mul.meta["val"].dtype != x.meta["val"].dtype:
        return None
    return x, float(add.args[1]), [pow_node, mean, add, rsqrt, mul]


def fuse_rms_norm(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite each written-out RMSNorm into one ``aten.rms_norm(x, [d], None, eps)``
    node, with the FakeTensor, source and module of the ``mul`` it replaces (see the
    module docstring). Returns ``gm`` (linted, recompiled)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.pow.Tensor_Scalar:
            continue
        chain = _rms_chain(node)
        if chain is None:
            continue
        x, eps, ops = chain
        mul = ops[-1]
        with graph.inserting_before(mul):
            fused = graph.call_function(aten.rms_norm.default, (x, [x.meta["val"].shape[-1]], None, eps))
        fused.meta.update(mul.meta)
        mul.replace_all_uses_with(fused)
        for op in reversed(ops):
            graph.erase_node(op)
    graph.lint()
    gm.recompile()
    return gm
