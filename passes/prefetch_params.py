"""prefetch_params: ZeRO/FSDP parameter gathers coalesced per layer and issued one layer ahead.

Expects: a graph after ``cleanup`` (one gather per parameter and layout);
``gm.meta["stpc_joint_groups"]`` (optional, set by ``stpc.compile``): ``{axes: group}``, the
process group of each set of mesh axes taken together.

A parameter stored sharded over a mesh axis and read whole is gathered by one
``runtime.all_gather`` per parameter, waited on where it is issued, right before its op:
dozens of small synchronous collectives per layer. This pass does what FSDP does with
its per-module groups:

  * a parameter split on one dim over several mesh axes and read whole is gathered axis by
    axis (one gather per axis, each reading the last: only the first reads the parameter,
    so the others could be neither coalesced nor issued ahead); where the dim splits evenly
    and the gathers agree on their gradient, the chain becomes one gather over the axes'
    joint group (FSDP over a flattened mesh), which the next steps coalesce and prefetch;
  * the gathers of parameters read directly from their placeholder are grouped: the
    parameters one layer reads (the module path of their first consumer up to its first
    index, ``layers.3``; outside any indexed module, a run of consecutive gathers), on one
    group of ranks, with one dtype and gradient kind;
  * each group becomes one ``runtime.gather_start`` (one all-gather of the group's shards
    flattened) and one ``runtime.gather_wait`` (waits, cuts each parameter out), the wait
    placed right before the group's first consumer;
  * the start of each group is issued right after the previous group's wait, so the
    next layer's parameters travel while this layer computes (prefetch one layer ahead);
    in backward the gradients of a group are reduce-scattered in one collective;
  * the groups outside any layer read after the last layer's last op (the head: final
    norm, output projection; and a weight the head shares with the embedding, whose one
    gather ``cleanup`` made, issued before the embedding in a group of its own, so that
    the embeddings' other tables are not kept with it) are waited with ``keep=True``:
    their whole parameters are kept for their backward, which runs first (FSDP2 keeps its
    root module's alike, a tied embedding's included), not gathered again there.

Guarantees: the same values and gradients (a reduce-scatter of a concatenation is the
concatenation of the reduce-scatters). In flight, one more layer's whole parameters. The
compiled model runs an eager program inside ``runtime.RegatherSaved``, so the whole
parameters are not kept from forward to backward: backward gathers each layer again
(FSDP2's default), but the head's; under ``torch.compile`` they are saved for backward.
"""
from __future__ import annotations

import math
import operator

import torch.fx as fx

from ._common import fake, fake_mode_of, finish
from stpc import runtime
from stpc.placement import parse
from stpc.planner.analysis import indexed_module


def _block(node: fx.Node, order: dict) -> str:
    """The layer a gather belongs to: its first consumer's module path up to the first index."""
    path, todo = "", sorted(node.users, key=lambda u: order[u])
    while todo and not path:  # through communication nodes (no module of their own) to the compute
        u = todo.pop(0)
        path = u.meta.get("module", "") if "comm" not in u.meta else ""
        todo += sorted(u.users, key=lambda v: order[v]) if "comm" in u.meta else []
    return indexed_module(path)


def _gathers(gm: fx.GraphModule) -> list[fx.Node]:
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is runtime.all_gather:
            src = n.args[0]
            if isinstance(src, fx.Node) and src.op == "placeholder" and src.meta.get("param"):
                out.append(n)
    return out


def _chain(first: fx.Node) -> list[fx.Node]:
    """``first`` and the gathers that read it one after another, on its dim with its gradient."""
    out = [first]
    while len(out[-1].users) == 1:
        (u,) = out[-1].users
        if not (u.op == "call_function" and u.target is runtime.all_gather
                and u.kwargs["dim"] == first.kwargs["dim"]
                and u.kwargs.get("grad", "rs") == first.kwargs.get("grad", "rs")):
            break
        out.append(u)
    return out


def join_chains(gm: fx.GraphModule) -> int:
    """Replace each chain of per-axis gathers of one parameter on one dim by one gather over
    the joint group of those axes (``gm.meta["stpc_joint_groups"]``); returns how many.

    Why it is the same value: a dim split over axes a < b lays its chunks out row-major over
    (a, b), as DTensor shards a dim over several mesh dims (evenly: each piece of the outer
    split is cut again by the inner one), and a joint group's ranks run row-major over its
    axes (``runtime.joint_group``), so one all-gather over it concatenates the chunks in
    order. Its backward, a reduce-scatter over the joint group, sums over every axis at once
    where the chain summed axis by axis (``grad="rs"``), or slices this rank's part of a
    complete gradient (``"slice"``). A dim that does not split evenly keeps its chain
    (torch.chunk's pieces of pieces are not the pieces of one cut)."""
    joint = gm.meta.get("stpc_joint_groups") or {}
    mesh = tuple(gm.meta.get("stpc_mesh", ()))
    joined = 0
    for first in _gathers(gm):
        chain = _chain(first)
        axes = tuple(sorted(n.meta["comm"]["axis"] for n in chain))
        if len(chain) < 2 or len(set(axes)) != len(axes) or axes not in joint:
            continue
        dim, last = first.kwargs["dim"], chain[-1]
        if first.args[0].meta["global_val"].shape[dim] % math.prod(mesh[a] for a in axes):
            continue
        with gm.graph.inserting_before(last):
            one = gm.graph.call_function(runtime.all_gather, (first.args[0],),
                                         {**first.kwargs, "group": joint[axes]})
        one.meta.update(last.meta)
        one.meta["comm"] = {**first.meta["comm"], "axis": axes, "group": joint[axes]}
        last.replace_all_uses_with(one)
        for n in reversed(chain):
            gm.graph.erase_node(n)
        joined += 1
    return joined


def prefetch_params(gm: fx.GraphModule, plan=None) -> fx.GraphModule:
    """Join, coalesce and prefetch the parameter gathers; see the module docstring."""
    join_chains(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    gathers = _gathers(gm)
    if not gathers:
        return finish(gm)

    def first_use(n):
        return min(order[u] for u in n.users)

    # the last layer's last op (None in a model without indexed layers): a gather outside any
    # layer read after it is the head's, kept for its backward
    in_layers = [order[n] for n in gm.graph.nodes if "comm" not in n.meta and indexed_module(n.meta.get("module", ""))]
    end = max(in_layers, default=None)

    def read_by_head(n):
        return end is not None and max(order[u] for u in n.users) > end

    # groups: the gathers of one layer on one group of ranks, with one dtype and gradient kind
    # (a layer's gathers on two mesh axes make two groups); outside any indexed module, a run
    # of consecutive gathers (the embedding at the start, the head at the end: not one group),
    # those the head reads apart from the others (a tied table, read by the embedding too, is
    # kept to the head's backward, its neighbours not)
    groups: list[list[fx.Node]] = []
    blocks: dict[int, str] = {}  # id(group) -> its layer ("" outside any indexed module)
    open_groups: dict = {}
    block = None
    for n in sorted(gathers, key=first_use):
        b = _block(n, order)
        if b != block:  # the next layer (or a run of root-level gathers) starts
            open_groups, block = {}, b
        key = (n.kwargs["group"], n.kwargs.get("grad", "rs"), n.meta["val"].dtype, n.meta["val"].device,
               not b and read_by_head(n))
        if key not in open_groups:
            open_groups[key] = []
            groups.append(open_groups[key])
            blocks[id(open_groups[key])] = b
        open_groups[key].append(n)
    mode = fake_mode_of(gm)
    previous_wait = None
    groups.sort(key=lambda members: min(first_use(n) for n in members))
    # the head: the groups outside any layer read after the last layer's last op, whether or
    # not any layer's weights are gathered
    head = {k for k, members in enumerate(groups) if not blocks[id(members)] and read_by_head(members[0])}
    for k, members in enumerate(groups):
        shards = [n.args[0] for n in members]
        dims = [n.kwargs["dim"] for n in members]
        group, grad = members[0].kwargs["group"], members[0].kwargs.get("grad", "rs")
        comm = members[0].meta["comm"]
        n_ranks = members[0].meta["val"].shape[dims[0]] // shards[0].meta["val"].shape[dims[0]]
        numel = sum(s.meta["val"].numel() for s in shards)
        val = members[0].meta["val"]
        first = min((u for n in members for u in n.users), key=lambda u: order[u])
        # the start goes right after the previous group's wait (prefetch), else before its use
        anchor = previous_wait.next if previous_wait is not None else first
        with gm.graph.inserting_before(anchor):
            start = gm.graph.call_function(runtime.gather_start, (shards, group, grad))
        start.meta["val"] = fake(mode, (numel * n_ranks,), val.dtype, val.device)
        start.meta["comm"] = {**{k: v for k, v in comm.items() if k not in ("dim",)}, "op": "all_gather",
                              "grad": grad, "coalesced": len(members), "flat_numel": numel}
        with gm.graph.inserting_before(first):
            wait = gm.graph.call_function(runtime.gather_wait,
                                          (start, [list(s.meta["val"].shape) for s in shards], dims, group),
                                          {"keep": True} if k in head else {})
            wait.meta["val"] = tuple(n.meta["val"] for n in members)
            for i, n in enumerate(members):
                got = gm.graph.call_function(operator.getitem, (wait, i))
                got.meta.update({k: v for k, v in n.meta.items() if k != "comm"})
                n.replace_all_uses_with(got)
                gm.graph.erase_node(n)
        previous_wait = got  # the last getitem: the next start goes after this group's wait
    _check_axes(gm)
    return finish(gm)


def _check_axes(gm: fx.GraphModule) -> None:
    """Every coalesced gather's dims are real splits (a stale graph would mis-cut parameters)."""
    for n in gm.graph.nodes:
        if n.target is runtime.gather_wait:
            for src, d in zip(n.args[0].args[0], n.args[2]):
                p = src.meta.get("placement")
                if p is not None and not any(parse(t)[0] == "S" and parse(t)[1][0] == d for t in p):
                    raise AssertionError(f"prefetch_params: {src.name} is not split on dim {d} ({p})")


__all__ = ["prefetch_params", "join_chains"]
