"""ring_decompose: collectives next to a matmul become P2P rings overlapped with it.

Expects: a graph after ``insert_collectives``, which emits every temporal linear of
the plan as its spatial equivalent, tagged ``meta["ring"]``:

  ag_ring   all_gather(x, dim=m)  -> aten.linear(x_full, w, b?)
  rs_ring   aten.linear(x, w)     -> reduce_scatter(dim=m) [-> add(b)]
  p2x2      runtime.grid_linear(x, w)

Guarantees: each pattern becomes the runtime op of ``stpc.runtime.ops.ring`` that runs
the same product as a schedule of P2P steps (each transfer hidden behind a
partial matmul; backward is the op's dual schedule):

  ag_ring   stpc.ring_allgather_matmul(x, t(w), m, group) [+ b]
  rs_ring   stpc.ring_matmul_reducescatter(x, t(w), m, group)   (the bias add stays)
  p2x2      getitem(stpc.primepar_linear(x, t(w), group, k), 0)

so no all-gather / reduce-scatter remains on those edges, and the result keeps
the node's placement and local value. The weight enters as ``aten.t`` of the
torch weight: ring ops take ``[N, K]``, nn.Linear stores ``[K, N]``. A tagged
pattern that is no longer intact (its collective has other users) is an error
naming the node: a ring cannot feed anyone the gathered tensor.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

import stpc.runtime.ops  # noqa: F401  (registers torch.ops.stpc.*)
from stpc import runtime
from ._common import carry_taps, fail, fake, fake_mode_of, finish

aten = torch.ops.aten


def _transpose(g: fx.Graph, w: fx.Node, before: fx.Node, mode, device) -> fx.Node:
    with g.inserting_before(before):
        wt = g.call_function(aten.t.default, (w,))
    v = w.meta["val"]
    wt.meta["val"] = fake(mode, (v.shape[1], v.shape[0]), v.dtype, device)
    gv = w.meta.get("global_val", v)
    wt.meta["global_val"] = fake(mode, (gv.shape[1], gv.shape[0]), gv.dtype, device)
    wt.meta["placement"] = tuple({"S0": "S1", "S1": "S0"}.get(t, t) for t in w.meta.get("placement", ()))
    wt.meta["source"] = before.meta.get("source", "")
    return wt


def _ring_meta(n: fx.Node, like: fx.Node, kind: str, axis: int, group: str, size: int) -> None:
    for k in ("val", "global_val", "placement", "source"):
        if k in like.meta:
            n.meta[k] = like.meta[k]
    n.meta["ring"] = {"kind": kind, "axis": axis, "decomposed": True}
    n.meta["comm"] = {"op": kind, "axis": axis, "group": group, "p2p": True, "size": size}


def ring_decompose(gm: fx.GraphModule, plan=None) -> fx.GraphModule:
    """Replace the tagged AG->linear, linear->RS and grid_linear patterns by ring ops."""
    g = gm.graph
    mode = fake_mode_of(gm)
    device = gm.meta.get("stpc_device", torch.device("cpu"))
    mesh = tuple(gm.meta.get("stpc_mesh", plan.mesh_shape if plan is not None else ()))
    for n in list(g.nodes):
        ring = n.meta.get("ring")
        if n.op != "call_function" or not ring or ring.get("decomposed"):
            continue
        kind, a = ring["kind"], ring["axis"]
        if kind == "ag_ring" and n.target is runtime.all_gather:
            users = list(n.users)
            if len(users) != 1 or users[0].target is not aten.linear.default or users[0].args[0] is not n:
                raise fail(n, "its AG-ring all-gather feeds something other than exactly one linear",
                           "run ring_decompose right after insert_collectives")
            lin = users[0]
            x, w = n.args[0], lin.args[1]
            bias = lin.args[2] if len(lin.args) > 2 else None
            group, dim = n.kwargs["group"], n.kwargs["dim"]
            wt = _transpose(g, w, lin, mode, device)
            with g.inserting_before(lin):
                r = g.call_function(torch.ops.stpc.ring_allgather_matmul.default, (x, wt, dim, group))
            _ring_meta(r, lin, "ring_allgather_matmul", a, group, mesh[a])
            out = r
            if bias is not None:
                with g.inserting_after(r):
                    out = g.call_function(aten.add.Tensor, (r, bias))
                for k in ("val", "global_val", "placement", "source"):
                    out.meta[k] = lin.meta[k]
            carry_taps(out, lin)
            lin.replace_all_uses_with(out)
            g.erase_node(lin)
            g.erase_node(n)
        elif kind == "rs_ring" and n.target is runtime.reduce_scatter:
            lin = n.args[0]
            if lin.target is not aten.linear.default or len(lin.users) != 1:
                raise fail(n, "its RS-ring reduce-scatter does not consume exactly one linear's only use",
                           "run ring_decompose right after insert_collectives")
            x, w = lin.args[0], lin.args[1]
            group, dim = n.kwargs["group"], n.kwargs["dim"]
            wt = _transpose(g, w, lin, mode, device)
            with g.inserting_before(n):
                r = g.call_function(torch.ops.stpc.ring_matmul_reducescatter.default, (x, wt, dim, group))
            _ring_meta(r, n, "ring_matmul_reducescatter", a, group, mesh[a])
            carry_taps(r, lin, n)  # the linear's partial sums are the reduce-scatter's value, split
            n.replace_all_uses_with(r)
            g.erase_node(n)
            g.erase_node(lin)
        elif kind == "p2x2" and n.target is runtime.grid_linear:
            x, w = n.args
            group = n.kwargs["group"]
            k = round(math.log(mesh[a], 4))
            wt = _transpose(g, w, n, mode, device)
            with g.inserting_before(n):
                pp = g.call_function(torch.ops.stpc.primepar_linear.default, (x, wt, group, k))
                out = g.call_function(operator.getitem, (pp, 0))
            xv, wv = x.meta["val"], wt.meta["val"]
            rows = math.prod(xv.shape[:-1])
            pp.meta["val"] = (n.meta["val"], fake(mode, (rows, wv.shape[0]), xv.dtype, device),
                              fake(mode, tuple(wv.shape), wv.dtype, device))
            pp.meta["ring"] = {"kind": "p2x2", "axis": a, "decomposed": True}
            pp.meta["comm"] = {"op": "primepar_linear", "axis": a, "group": group, "p2p": True, "size": mesh[a]}
            pp.meta["source"] = n.meta.get("source", "")
            for key in ("val", "global_val", "placement", "source"):
                out.meta[key] = n.meta[key]
            carry_taps(out, n)
            n.replace_all_uses_with(out)
            g.erase_node(n)
        elif kind in ("ag_ring", "rs_ring", "p2x2") and n.target is aten.linear.default:
            continue  # the linear half of a pattern: handled from its collective
        else:
            raise fail(n, f"it is tagged {kind} but is not the collective of that pattern",
                       "run ring_decompose right after insert_collectives")
    return finish(gm)
