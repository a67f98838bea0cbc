"""verify: a static check that every rank will issue matching communication.

Expects: a graph after the other passes (communication nodes carry meta["comm"],
tensor nodes meta["global_val"] and meta["placement"]).

For every rank of the mesh it derives, from the graph alone, the sequence of
communication that rank will issue — forward in graph order, then the backward
duals in reverse order for the nodes that carry a gradient — with the shape
and dtype that rank will pass, computed from the global shape and the
placement (uneven splits give ranks different shapes). Then:

  * collectives: every rank of each process group (a mesh axis, the other
    coordinates fixed) must issue the same sequence of collectives on that
    group, with the same op, shape and dtype;
  * P2P (the ring ops, the PrimePar skew): every send from rank s to rank d on
    a channel must meet the matching receive posted by d from s, step by step,
    with the same shape.

A mismatch (which would hang or corrupt data at run time) raises
:class:`VerifyError` naming the ranks, the group, the position and the nodes
involved — before anything runs. ``rank_graphs`` checks a set of per-rank
graphs (e.g. the graphs the ranks each compiled) instead of one SPMD graph.
The graph is returned unchanged.
"""
from __future__ import annotations

import itertools
import math
from collections import defaultdict

import torch
import torch.fx as fx

from stpc import runtime
from stpc.placement import parse
from ._common import finish
from .recompute import inline


class VerifyError(RuntimeError):
    """Ranks would issue mismatched collectives or P2P transfers."""


# the backward collective of each forward communication function (None: no communication)
_BWD = {
    ("all_gather", "rs"): "reduce_scatter", ("all_gather", "slice"): None,
    ("all_reduce", "all_reduce"): "all_reduce", ("all_reduce", "identity"): None,
    ("reduce_scatter", None): "all_gather", ("all_to_all", None): "all_to_all",
    ("shard_slice", None): "all_gather", ("to_partial", None): None,
    ("grad_all_reduce", None): "all_reduce", ("grid_gather", "rs"): "reduce_scatter",
    ("grid_gather", "slice"): None, ("grid_slice", None): "all_gather",
    ("redistribute", None): "redistribute", ("grid_layer_norm", None): "grid_layer_norm",
    ("grid_rms_norm", None): "grid_rms_norm", ("grid_cross_entropy", None): None,
}
_FWD_NONE = {"shard_slice", "to_partial", "grad_all_reduce", "grid_slice"}  # local forward


def _coords(rank, mesh):
    return runtime.mesh_coords(rank, mesh)


def _global(coords, mesh):
    r = 0
    for c, n in zip(coords, mesh):
        r = r * n + c
    return r


def _group_of(axis, mesh, coords):
    """(group key, this rank's index in it, the members' global ranks) of a collective on one
    mesh axis or on several taken together (a joint group: row-major over its axes, as
    ``runtime.joint_group`` orders it)."""
    axes = axis if isinstance(axis, tuple) else (axis,)
    rest = tuple(c for i, c in enumerate(coords) if i not in axes)
    members, grank = [], 0
    for k, sub in enumerate(itertools.product(*(range(mesh[a]) for a in axes))):
        at = list(coords)
        for a, j in zip(axes, sub):
            at[a] = j
        members.append(_global(tuple(at), mesh))
        if tuple(at) == tuple(coords):
            grank = k
    return (axis, rest), grank, members


def _rank_shape(global_shape, placement, mesh, coords):
    """This rank's local shape (torch.chunk sizes: an uneven split differs between ranks)."""
    shape = list(global_shape)
    for tok, n, i in zip(placement, mesh, coords):
        kind, dims = parse(tok)
        if kind == "S":
            sizes = [t.shape[0] for t in torch.empty(shape[dims[0]], device="meta").chunk(n)]
            shape[dims[0]] = sizes[i] if i < len(sizes) else 0
        elif kind in "BXW":
            q = math.isqrt(n)
            for d in dims:
                shape[d] = -(-shape[d] // q) if shape[d] % q else shape[d] // q
    return tuple(shape)


def _input_shape(node, mesh, coords):
    src = node.args[0]
    if not isinstance(src, fx.Node) or "global_val" not in src.meta:
        v = src.meta.get("val") if isinstance(src, fx.Node) else None
        return (tuple(v.shape) if v is not None else (), str(getattr(v, "dtype", "")))
    gv = src.meta["global_val"]
    return _rank_shape(tuple(gv.shape), src.meta["placement"], mesh, coords), str(gv.dtype)


def _needs_grad(graph: fx.Graph, plan) -> set:
    ng = set()
    for n in graph.nodes:
        np = plan.nodes.get(n.name) if plan is not None else None
        if (n.op == "placeholder" and (np.role == "param" if np is not None else bool(n.meta.get("param")))) \
                or any(a in ng for a in n.all_input_nodes):
            ng.add(n)
    return ng


def _p2p_steps(c, node, grank, n):
    """[(peer group rank to send to, peer to receive from, tag)] per step of a P2P node."""
    op = c["op"]
    if op == "grid_skew":
        to, frm = runtime.skew_peers(grank, n, c.get("inverse", False))
        return [(to, frm, 0)]
    if op in ("ring_allgather_matmul", "ring_matmul_reducescatter"):
        to, frm = runtime.ops.ring_peers(grank, n)  # the rule the ring ops run
        return [(to, frm, 0)] * (n - 1)
    if op == "primepar_linear":
        q = math.isqrt(n)
        return runtime.ops.primepar_peers(grank, q.bit_length() - 1) * (q - 1)
    return []


def comm_schedule(gm: fx.GraphModule, plan, rank: int) -> list[dict]:
    """The communication ``rank`` will issue running ``gm`` forward then backward. A layer
    the program recomputes (``passes.recompute``) issues its forward communication again in
    backward, before its own backward duals (phase ``"recompute"``)."""
    mesh = tuple(gm.meta.get("stpc_mesh", plan.mesh_shape))
    coords = _coords(rank, mesh)
    graph = inline(gm)
    ng = _needs_grad(graph, plan)
    fwd, bwd = [], []
    region, replay = None, []  # the recomputed layer being read, and its forward events so far

    def end_region():
        bwd.extend({**e, "phase": "recompute"} for e in reversed(replay))
        replay.clear()

    for node in graph.nodes:
        if node.meta.get("recompute") != region:
            end_region()
            region = node.meta.get("recompute")
        c = node.meta.get("comm")
        if node.op != "call_function" or not c:
            continue
        n_fwd = len(fwd)
        group, grank, members = _group_of(c["axis"], mesh, coords)
        n = len(members)
        shape, dtype = _input_shape(node, mesh, coords)
        if "flat_numel" in c:  # a coalesced gather: one flat buffer of every shard it carries
            shape, dtype = (c["flat_numel"],), str(node.meta["val"].dtype)
        base = {"group": group, "members": members, "node": node.name, "shape": shape, "dtype": dtype}
        if c.get("p2p") or c["op"] == "grid_skew":
            for step, (to, frm, tag) in enumerate(_p2p_steps(c, node, grank, n)):
                ev = {**base, "kind": "p2p", "op": c["op"], "step": step, "tag": tag,
                      "send_to": members[to], "recv_from": members[frm]}
                fwd.append(ev)
                if node in ng:
                    bwd.append({**ev, "send_to": members[frm], "recv_from": members[to], "phase": "bwd"})
        elif c["op"] == "grid_linear":
            fwd += [{**base, "kind": "collective", "op": "all_gather"}] * 2
            if node in ng:
                bwd += [{**base, "kind": "collective", "op": "reduce_scatter", "phase": "bwd"}] * 2
        else:
            op = c["op"]
            if op not in _FWD_NONE:
                fwd.append({**base, "kind": "collective", "op": op})
            key = (op, c.get("grad"))
            b = _BWD.get(key, _BWD.get((op, None)))
            if b and node in ng:
                bwd.append({**base, "kind": "collective", "op": b, "phase": "bwd"})
        if region is not None:
            replay.extend(fwd[n_fwd:])
    end_region()
    for e in fwd:
        e.setdefault("phase", "fwd")
    return fwd + bwd[::-1]


def _check(schedules: dict[int, list[dict]]) -> list[str]:
    problems = []
    # collectives: per group, every member's sequence must agree
    per_group: dict = defaultdict(dict)
    for rank, evs in schedules.items():
        for e in evs:
            if e["kind"] == "collective":
                per_group[e["group"]].setdefault(rank, []).append(e)
    for group, by_rank in per_group.items():
        ranks = sorted(by_rank)
        ref_rank = ranks[0]
        ref = by_rank[ref_rank]
        for r in ranks[1:]:
            seq = by_rank[r]
            for i in range(max(len(ref), len(seq))):
                x = ref[i] if i < len(ref) else None
                y = seq[i] if i < len(seq) else None
                sig = lambda e: None if e is None else (e["op"], e["phase"], e["shape"], e["dtype"])  # noqa: E731
                if sig(x) != sig(y):
                    def show(rk, e):
                        return f"rank {rk}: " + ("nothing" if e is None else
                                                 f"{e['phase']} {e['op']} {e['shape']} {e['dtype']} (node {e['node']})")
                    problems.append(f"mesh axis {group[0]} group at {group[1]}: collective #{i} differs — "
                                    f"{show(ref_rank, x)}; {show(r, y)}")
                    break
        members = ref[0]["members"]
        silent = [m for m in members if m not in by_rank and m in schedules]
        if silent:
            problems.append(f"mesh axis {group[0]} group at {group[1]}: ranks {silent} issue no collective on "
                            f"it, rank {ref_rank} issues {len(ref)} (first: {ref[0]['op']}, node {ref[0]['node']})")
    # P2P: sends s->d on (op node, step, tag) must meet receives at d from s
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, evs in schedules.items():
        for e in evs:
            if e["kind"] == "p2p":
                sends[(rank, e["send_to"], e["tag"])].append(e)
                recvs[(e["recv_from"], rank, e["tag"])].append(e)
    for ch in sorted(set(sends) | set(recvs)):
        s, r = sends.get(ch, []), recvs.get(ch, [])
        for i in range(max(len(s), len(r))):
            x = s[i] if i < len(s) else None
            y = r[i] if i < len(r) else None
            if x is None or y is None or x["shape"] != y["shape"] or x["node"] != y["node"]:
                sx = "nothing" if x is None else f"{x['phase']} send #{i} {x['shape']} (node {x['node']} step {x['step']})"
                sy = "nothing" if y is None else f"{y['phase']} recv #{i} {y['shape']} (node {y['node']} step {y['step']})"
                problems.append(f"P2P rank {ch[0]} -> rank {ch[1]} (tag {ch[2]}): rank {ch[0]} posts {sx}, "
                                f"rank {ch[1]} posts {sy}")
                break
    return problems


def verify(gm: fx.GraphModule, plan=None, *, rank_graphs: dict[int, fx.GraphModule] | None = None) -> fx.GraphModule:
    """Raise :class:`VerifyError` if ranks would issue mismatched communication; see the module docstring."""
    mesh = tuple(gm.meta.get("stpc_mesh", plan.mesh_shape if plan is not None else ()))
    world = math.prod(mesh)
    graphs = rank_graphs or {r: gm for r in range(world)}
    missing = sorted(set(range(world)) - set(graphs))
    if missing:
        raise VerifyError(f"verify: no graph for ranks {missing} of the {world}-rank mesh {mesh}")
    schedules = {r: comm_schedule(g, plan, r) for r, g in graphs.items()}
    problems = _check(schedules)
    if problems:
        head = f"verify: ranks would issue mismatched communication ({len(problems)} problem(s)); " \
               f"running this program would hang or corrupt data:\n  "
        raise VerifyError(head + "\n  ".join(problems[:20]) +
                          "\nFix: every rank must run the same plan on evenly divisible shapes; re-plan, "
                          "or check the pass that produced these nodes.")
    gm.meta["stpc_comm_per_rank"] = len(schedules[0])
    return finish(gm)
