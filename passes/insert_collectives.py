"""insert_collectives: wherever placements change along an edge, insert the collective.

Expects: the output of ``shard_params`` (placeholders local, ``gm.meta`` holds the
mesh, one group name per axis and the device) and the same Plan.

Guarantees: the graph is a correct SPMD program over local tensors — every rank
runs it on its own shards and, forward and backward, computes the single-device
model's values under the plan's placements:

  * on every edge (producer -> operand of a decision node, the input of a
    follower whose layout could not be kept, the graph outputs) the producer's
    placement is turned into the one the consumer needs by the
    :mod:`stpc.runtime` functions, axis by axis (``reshard_steps``: forward
    collective and the backward dual that the cost model charges — see
    ``stpc/planner/costs.py`` — including Megatron's "f", identity forward /
    all-reduce backward, where a consumer splits its work on an axis but
    reads a Replicate operand, so replicated parameters get complete,
    identical gradients);
  * ops that split change locally: view/reshape/expand shapes become local,
    a vocabulary-split embedding becomes a masked local lookup
    (``runtime.vocab_parallel_embedding``), a ``mean`` over a split dim is
    rescaled by 1/n (mean of means), a row-split mean ``cross_entropy`` sums
    its rows and divides by the all-reduced count of targets that count (the
    ignored ones need not fall evenly), a scalar added to a Partial tensor is
    divided by n;
  * a LayerNorm or RMSNorm the plan keeps in a grid block layout becomes
    ``runtime.grid_layer_norm`` / ``runtime.grid_rms_norm`` (its statistics exchanged
    along the grid row), an operand whole beside a grid block along its columns only
    (RMSNorm's weight, a per-head attention bias) its grid column's slice
    (``runtime.grid_column``), and a cross-entropy reading its logits in a grid block
    layout ``runtime.grid_cross_entropy`` (row statistics exchanged along the grid row);
  * temporal (spatial-temporal) linears are emitted as their *spatial
    equivalent*, a collective next to an ordinary matmul, each tagged
    ``meta["ring"]`` so ``ring_decompose`` can fuse it into the P2P ring:
      ag_ring:  all_gather(x, seq dim) -> linear(x, w S0, b S0)
      rs_ring:  linear(x, w S1) -> reduce_scatter(seq dim) -> + b
      p2x2:     runtime.grid_linear(x, w) (gathers a grid row of x and a grid
                column of w; the step schedule replaces it) [-> runtime.grid_bias_add(b),
                the whole bias's grid-column slice]
    so the graph between the two passes still runs and is still correct;
  * the outputs are made Replicate (every rank returns the full loss/output), or,
    with ``replicate_outputs=False``, only those DTensor cannot describe (Partial,
    grid blocks);
  * every tensor node has meta["val"] (local FakeTensor), meta["global_val"],
    meta["placement"]; communication nodes have meta["comm"].
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.fx as fx

from ._common import carry_taps, fail, fake, fake_mode_of, finish, is_tensor_node, set_local
from stpc import runtime
from stpc.placement import PARTIAL, REPLICATE, fmt, local_shape, parse
from stpc.planner.strategies import Strategy, follow, tensor_operands

aten = torch.ops.aten

_FN = {
    "all_gather": runtime.all_gather, "all_reduce": runtime.all_reduce,
    "reduce_scatter": runtime.reduce_scatter, "all_to_all": runtime.all_to_all,
    "shard_slice": runtime.shard_slice, "to_partial": runtime.to_partial,
    "grad_all_reduce": runtime.grad_all_reduce, "grid_gather": runtime.grid_gather,
    "grid_slice": runtime.grid_slice, "grid_skew": runtime.grid_skew, "redistribute": runtime.redistribute,
}
_GRID_NORMS = (aten.layer_norm.default, aten.rms_norm.default)  # kept in a grid layout by a runtime op
_SHAPE_ARG = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}


# --------------------------------------------------------------------------- the edge algebra


def _dims(tok: str) -> set[int]:
    kind, dims = parse(tok)
    return set(dims) if kind in "SBXW" else set()


def _is_split(tok: str) -> bool:
    return tok[0] in "SBXW"


def reshard_steps(src, dst, mesh, consumer_split=None, needs_grad=True,
                  joint: bool = False) -> list[tuple[str, int | tuple, dict, str | tuple]]:
    """The per-axis operations that turn placement ``src`` into ``dst``.

    Returns ``[(function, axis, kwargs, token after), ...]`` in execution order.
    Nested splits of one dim are ordered outer axis first (row-major, as
    DTensor), so an axis can only be gathered or re-split while no inner axis
    splits a dim it touches: such inner axes are gathered first and split
    again afterwards. Phase A (innermost axis first) removes splits and
    partial sums or exchanges them directly (all-to-all, the PrimePar skew, a
    redistribution by slice overlap between any two other split layouts,
    reduce-scatter) when no other changing axis touches the same dims;
    phase B (outermost first) slices or makes Partial. Backward duals
    (``grad=``) follow ``stpc.planner.costs``: a Replicate result whose consumer splits
    its work on the axis receives a partial gradient.

    ``joint``: the program has a process group over every set of mesh axes
    (``gm.meta["stpc_joint_groups"]``). Where the axes taken one by one would gather a
    split whole and cut it again, and every axis that changes (or is gathered for the
    order of the nesting) holds a plain split before and after, one redistribution over
    those axes' joint group moves each block's overlaps instead: ``(function, axes,
    kwargs, tokens after)`` with ``axes`` a tuple (the cost model charges the per-axis
    exchanges, a named simplification: ``stpc.planner.costs``).
    """
    steps = _axis_steps(src, dst, mesh, consumer_split, needs_grad)
    nd = len(mesh)
    src, dst = tuple(src), tuple(dst)
    gathered = {a for fn, a, _, _ in steps if fn in ("all_gather", "grid_gather")}
    changed = sorted(gathered | {a for a in range(nd) if src[a] != dst[a] and mesh[a] > 1})
    if (joint and gathered and len(changed) > 1
            and all(src[a][0] == "S" and dst[a][0] == "S" for a in changed)):
        axes = tuple(changed)
        after = tuple(dst[a] for a in axes)
        rest = [st for st in steps if st[0] == "grad_all_reduce"]  # (an R axis's f: unchanged)
        return [("redistribute", axes, {"src": tuple(src[a] for a in axes), "dst": after,
                                        "sizes": tuple(mesh[a] for a in axes)}, after)] + rest
    return steps


def _axis_steps(src, dst, mesh, consumer_split, needs_grad) -> list[tuple[str, int, dict, str]]:
    """:func:`reshard_steps` axis by axis."""
    nd = len(mesh)
    src, dst = tuple(src), tuple(dst)
    consumer_split = tuple(consumer_split) if consumer_split is not None else (False,) * nd
    dirty = {a for a in range(nd) if src[a] != dst[a] and mesh[a] > 1}
    safety: set[int] = set()
    grown = True
    while grown:
        grown = False
        for a in sorted(dirty):
            touch = _dims(src[a]) | _dims(dst[a])
            for b in range(a + 1, nd):
                if b not in dirty and _is_split(src[b]) and _dims(src[b]) & touch:
                    dirty.add(b)
                    safety.add(b)
                    grown = True
    steps: list[tuple[str, int, dict, str]] = []
    cur = list(src)
    for a in range(nd):
        if mesh[a] == 1:
            cur[a] = dst[a]  # a size-1 axis holds everything whatever the token says
    def direct(a):
        """May axis a go straight from its token to the target (all-to-all, skew,
        reduce-scatter)? Only if no other changing axis touches the same dims: else
        the order of the nested splits would come out wrong, so it goes through R."""
        if a in safety:
            return False
        mine = _dims(src[a]) | _dims(dst[a])
        outer = any(mine & (_dims(src[b]) | _dims(dst[b])) for b in dirty if b < a)
        inner = any(mine & _dims(cur[b]) for b in range(a + 1, nd))  # already processed
        return not (outer or inner)

    for a in sorted(dirty, reverse=True):  # phase A: innermost first
        t, q = cur[a], dst[a]
        tk, qk = t[0], q[0]
        partial_grad = consumer_split[a] and needs_grad
        if tk in "SBXW":
            if direct(a) and tk == "S" and qk == "S":
                steps.append(("all_to_all", a, {"src_dim": _dims(t).pop(), "dst_dim": _dims(q).pop()}, q))
                cur[a] = q
            elif direct(a) and {tk, qk} == {"B", "X"} and parse(t)[1] == parse(q)[1]:
                steps.append(("grid_skew", a, {"inverse": tk == "X"}, q))
                cur[a] = q
            elif direct(a) and qk in "SBXW":  # split to split: only the slices' overlaps move
                steps.append(("redistribute", a, {"src": t, "dst": q}, q))
                cur[a] = q
            else:
                grad = "rs" if (q == REPLICATE and partial_grad) else "slice"
                if tk == "S":
                    steps.append(("all_gather", a, {"dim": _dims(t).pop(), "grad": grad}, REPLICATE))
                else:
                    i, j = parse(t)[1]
                    steps.append(("grid_gather", a, {"kind": tk, "i": i, "j": j, "grad": grad}, REPLICATE))
                cur[a] = REPLICATE
        elif tk == "P":
            if qk == "R":
                grad = "all_reduce" if partial_grad else "identity"
                steps.append(("all_reduce", a, {"grad": grad}, REPLICATE))
                cur[a] = REPLICATE
            elif qk == "S" and direct(a):
                steps.append(("reduce_scatter", a, {"dim": _dims(q).pop()}, q))
                cur[a] = q
            else:
                steps.append(("all_reduce", a, {"grad": "identity"}, REPLICATE))
                cur[a] = REPLICATE
    for a in sorted(dirty):  # phase B: outermost first
        if cur[a] == dst[a]:
            continue
        assert cur[a] == REPLICATE, (src, dst, cur)
        q = dst[a]
        if q[0] == "S":
            steps.append(("shard_slice", a, {"dim": _dims(q).pop()}, q))
        elif q[0] in "BXW":
            i, j = parse(q)[1]
            steps.append(("grid_slice", a, {"kind": q[0], "i": i, "j": j}, q))
        elif q == PARTIAL:
            steps.append(("to_partial", a, {}, q))
        cur[a] = q
    for a in range(nd):  # Megatron's f: identity forward, all-reduce of the partial gradient
        if mesh[a] > 1 and src[a] == dst[a] == REPLICATE and consumer_split[a] and needs_grad:
            steps.append(("grad_all_reduce", a, {}, REPLICATE))
    return steps


# --------------------------------------------------------------------------- the pass


def _operand_slots(node: fx.Node):
    """(container path, Node) for each tensor operand, in ``tensor_operands`` order."""
    slots = []
    for k, a in list(enumerate(node.args)) + [(kk, v) for kk, v in node.kwargs.items()]:
        if isinstance(a, (list, tuple)):
            for j, x in enumerate(a):
                if is_tensor_node(x):
                    slots.append(((k, j), x))
        elif is_tensor_node(a):
            slots.append(((k, None), a))
    return slots


def _replace_operands(node: fx.Node, new: list[fx.Node]) -> None:
    args, kwargs = list(node.args), dict(node.kwargs)
    for ((k, j), _), n in zip(_operand_slots(node), new):
        box = args if isinstance(k, int) else kwargs
        if j is None:
            box[k] = n
        else:
            seq = list(box[k])
            seq[j] = n
            box[k] = type(box[k])(seq) if isinstance(box[k], tuple) else seq
    node.args, node.kwargs = tuple(args), kwargs


class _Lowering:
    def __init__(self, gm: fx.GraphModule, plan, replicate_outputs: bool = True):
        self.gm, self.plan, self.graph = gm, plan, gm.graph
        self.replicate_outputs = replicate_outputs
        try:
            self.mesh = tuple(gm.meta["stpc_mesh"])
            self.groups = list(gm.meta["stpc_groups"])
            self.device = gm.meta["stpc_device"]
            # (a group over each set of axes, where the compiler made them: a split re-cut over
            # several axes is then one redistribution over their joint group)
            self.joint = dict(gm.meta.get("stpc_joint_groups") or {})
        except KeyError:
            raise RuntimeError("insert_collectives: run passes.shard_params on this graph first") from None
        self.mode = fake_mode_of(gm)
        self.needs_grad: set[fx.Node] = set()
        for n in self.graph.nodes:
            np = plan.nodes.get(n.name)
            if (n.op == "placeholder" and np is not None and np.role == "param") or \
                    any(a in self.needs_grad for a in n.all_input_nodes):
                self.needs_grad.add(n)
        # Whether each follower keeps its input's layout, decided on the traced (global)
        # shapes before any value becomes local; the producer's placement is its plan's.
        self.keeps_layout: dict[fx.Node, bool] = {}
        self.src_out: dict[fx.Node, tuple | None] = {}
        self.via_out: dict[fx.Node, tuple | None] = {}
        for n in self.graph.nodes:
            np = plan.nodes.get(n.name)
            if n.op == "call_function" and np is not None and np.role == "follower":
                (src,) = tensor_operands(n)
                sp = plan.nodes.get(src.name)
                local = src.meta["val"]
                src.meta["val"] = src.meta.get("global_val", local)  # placeholders are local already
                self.keeps_layout[n] = sp is not None and follow(n, tuple(sp.out), self.mesh) == tuple(np.out)
                self.src_out[n] = tuple(sp.out) if sp is not None else None
                if np.ins:  # the input placement it reads where it cannot keep its source's
                    self.via_out[n] = follow(n, tuple(np.ins[0]), self.mesh)
                src.meta["val"] = local

    # ------------------------------------------------------------------ edges
    def placement(self, n: fx.Node) -> tuple[str, ...]:
        p = n.meta.get("placement")
        if p is None:
            raise fail(n, "it has no placement yet", "run shard_params first; is the plan for this graph?")
        return tuple(p)

    def reshard(self, src: fx.Node, dst, consumer_split, before: fx.Node, needs_grad=None) -> fx.Node:
        needs_grad = (src in self.needs_grad) if needs_grad is None else needs_grad
        steps = reshard_steps(self.placement(src), tuple(dst), self.mesh, consumer_split, needs_grad,
                              joint=bool(self.joint))
        x, cur = src, list(self.placement(src))
        for fn, a, kw, tok in steps:
            group = self.joint[a] if isinstance(a, tuple) else self.groups[a]
            with self.graph.inserting_before(before):
                x = self.graph.call_function(_FN[fn], (x,), {**kw, "group": group})
            for axis, t in (zip(a, tok) if isinstance(a, tuple) else [(a, tok)]):
                cur[axis] = t
            for a2 in range(len(self.mesh)):  # size-1 axes just take the target's token
                if self.mesh[a2] == 1:
                    cur[a2] = tuple(dst)[a2]
            set_local(x, cur, self.mesh, self.mode, self.device, global_val=src.meta["global_val"])
            x.meta["comm"] = {"op": fn, "axis": a, "group": group, **kw, "edge": (src.name, before.name)}
            x.meta["source"] = before.meta.get("source", "")
            if src in self.needs_grad:
                self.needs_grad.add(x)
        return x

    def local_shape(self, node: fx.Node, placement) -> list[int]:
        return list(local_shape(tuple(node.meta["global_val"].shape), tuple(placement), self.mesh))

    def check(self, node: fx.Node) -> None:
        """Run the (aten) op on local FakeTensors: the shape must be the planned local shape."""
        if not isinstance(node.target, torch._ops.OpOverload):
            return
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        try:
            with self.mode:
                got = node.target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported with the node
            raise fail(node, f"the op fails on its local shards ({type(e).__name__}: {str(e)[:300]})",
                       "this op has no local rewrite for the placement the plan gave it; force a "
                       "replicated strategy for it with stpc.planner.Hints") from e
        want = tuple(node.meta["val"].shape)
        if isinstance(got, torch.Tensor):
            if tuple(got.shape) != want:
                raise fail(node, f"its local result has shape {tuple(got.shape)}, the plan's placement "
                                 f"{fmt(node.meta['placement'])} needs {want}",
                           "add a local rewrite for this op in passes/insert_collectives.py or force a "
                           "replicated strategy with stpc.planner.Hints")
            node.meta["val"] = got

    # ------------------------------------------------------------------ nodes
    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "call_function":
                self.lower(node)
            elif node.op == "output":
                self.lower_output(node)

    def lower(self, node: fx.Node) -> None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            if isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val):
                # A tuple-valued op the planner does not see (its getitem users are planned
                # replicated): it runs on replicated operands, never on shards it would
                # cut in the wrong places.
                rep = (REPLICATE,) * len(self.mesh)
                ops = [o for o in tensor_operands(node) if "placement" in o.meta]
                if any(self.placement(o) != rep for o in ops):
                    _replace_operands(node, [self.reshard(o, rep, (False,) * len(rep), node)
                                             if "placement" in o.meta else o for o in tensor_operands(node)])
            return  # asserts and other non-tensor nodes run as they are
        np = self.plan.nodes.get(node.name)
        if np is None:
            raise fail(node, "the plan has no entry for it", "re-plan: the plan was made for another graph")
        node.meta.setdefault("global_val", val)
        out = tuple(np.out)
        if np.role == "const":
            set_local(node, out, self.mesh, self.mode, self.device)
            return
        if np.role == "follower":
            (src,) = tensor_operands(node)
            p = self.placement(src)
            if not self.keeps_layout[node] or p != self.src_out[node]:
                # it reads its input resharded: to the placement the plan lists (one it can
                # keep, e.g. a batch split through a view merging batch and sequence), or to
                # Replicate
                if np.ins:
                    via, keeps = tuple(np.ins[0]), self.via_out[node] == tuple(out)
                else:
                    via, keeps = out, all(t == REPLICATE for t in out)
                if not keeps:
                    raise fail(node, f"its input is {fmt(p)} and the plan wants {fmt(out)}",
                               "the plan does not belong to this graph; re-plan")
                _replace_operands(node, [self.reshard(src, via, (False,) * len(out), node)])
            self.local_args(node, out)
            set_local(node, out, self.mesh, self.mode, self.device)
            self.check(node)
            return
        # (A contraction-split linear lists its bias as Partial: the planner's OpSpec.additive.)
        s = Strategy(out=out, ins=tuple(tuple(p) for p in np.ins), kind=np.kind, axis=np.axis)
        split = s.split_axes()
        ops = tensor_operands(node)
        if len(ops) != len(s.ins):
            raise fail(node, f"{len(ops)} tensor operands but the plan lists {len(s.ins)}",
                       "re-plan: the plan was made for another graph")
        _replace_operands(node, [self.reshard(o, q, split, node) for o, q in zip(ops, s.ins)])
        if node.target in _GRID_NORMS and any(t[0] == "B" for t in out):
            self.lower_grid_norm(node, out)
        elif node.target is aten.cross_entropy_loss.default and any(t[0] == "B" for t in s.ins[0]):
            self.lower_grid_loss(node, s)
        elif np.kind in ("spatial", "replicate-fallback"):
            self.grid_columns(node, s)
            self.local_args(node, out)
            set_local(node, out, self.mesh, self.mode, self.device)
            self.check(node)
            self.local_scale(node, out)
        elif np.kind == "ag_ring":
            self.lower_ag_ring(node, s)
        elif np.kind == "rs_ring":
            self.lower_rs_ring(node, s)
        elif np.kind == "p2x2":
            self.lower_p2x2(node, s)
        else:
            raise fail(node, f"unknown strategy family {np.kind!r}", "update stpc or re-plan")

    def local_args(self, node: fx.Node, out) -> None:
        """Shape arguments and ops whose meaning changes when their operands are split."""
        t = node.target
        if t in _SHAPE_ARG:
            args = list(node.args)
            args[1] = self.local_shape(node, out)
            node.args = tuple(args)
        elif t is aten.embedding.default:
            w_place = self.placement(node.args[0])
            vocab_axes = [a for a, tok in enumerate(w_place) if tok == "S0" and self.mesh[a] > 1]
            if vocab_axes:
                if len(node.args) > 2 and node.args[2] not in (-1, None):
                    raise fail(node, "a vocabulary-split embedding with padding_idx", "force the "
                               "embedding weight to another placement with Hints.param_force")
                node.target = runtime.vocab_parallel_embedding
                node.args = (node.args[0], node.args[1])
                node.kwargs = {"groups": [self.groups[a] for a in vocab_axes],
                               "vocab": int(node.args[0].meta["global_val"].shape[0])}
        elif t in (aten.add.Tensor, aten.sub.Tensor) and PARTIAL in out:
            # every rank adds its share of a scalar to a partial sum: the sum adds it once
            n = math.prod(m for m, tok in zip(self.mesh, out) if tok == PARTIAL)
            args = list(node.args)
            for i, a in enumerate(args):
                if isinstance(a, numbers.Number) and not isinstance(a, bool):
                    args[i] = a / n
            node.args = tuple(args)

    def local_scale(self, node: fx.Node, out) -> None:
        """A mean over a split dim computes the mean of the local piece: scale by 1/n so
        the partial results sum to the global mean (even splits). A row-split mean
        cross-entropy instead sums its rows and divides by the global count of targets
        that count (``runtime.cross_entropy_count``, all-reduced): ignored targets (HF's
        -100 padding) need not fall evenly."""
        t = node.target
        if PARTIAL not in out:
            return
        axes = [a for a, tok in enumerate(out) if tok == PARTIAL and self.mesh[a] > 1]
        if t is aten.cross_entropy_loss.default:
            args = list(node.args) + [None, 1, -100, 0.0][len(node.args) - 2:]
            args[2:] = [node.kwargs.get(k, v) for k, v in zip(("weight", "reduction", "ignore_index",
                                                                "label_smoothing"), args[2:])]
            if args[3] != 1:
                return  # sum: partial sums add up as they are
            node.args, node.kwargs = tuple(args[:3]) + (2,) + tuple(args[4:]), {}
            with self.graph.inserting_after(node):
                count = self.graph.call_function(runtime.cross_entropy_count, (args[1], args[4]),
                                                 {"weight": args[2], "dtype": node.meta["global_val"].dtype})
            with self.graph.inserting_after(count):
                scaled = self.graph.call_function(aten.div.Tensor, (node, count))
            set_local(count, out, self.mesh, self.mode, self.device, global_val=node.meta["global_val"])
            count.meta["source"] = node.meta.get("source", "")
            den = self.reshard(count, tuple(REPLICATE for _ in out), (False,) * len(out), scaled, needs_grad=False)
            scaled.args = (node, den)
            rewrite = "sum of local rows / global count of counted targets"
        elif t in (aten.mean.dim, aten.mean.default):
            n = math.prod(self.mesh[a] for a in axes)
            with self.graph.inserting_after(node):
                scaled = self.graph.call_function(aten.mul.Tensor, (node, 1.0 / n))
            rewrite = f"mean of {n} local means"
        else:
            return
        node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
        carry_taps(scaled, node)
        scaled.meta.update(global_val=node.meta["global_val"], placement=tuple(out),
                           val=node.meta["val"], source=node.meta.get("source", ""), local_rewrite=rewrite)
        if node in self.needs_grad:
            self.needs_grad.add(scaled)

    # ------------------------------------------------------------------ temporal families
    def _after(self, node, target, args, kwargs, placement, global_val):
        with self.graph.inserting_after(node):
            n = self.graph.call_function(target, args, kwargs)
        set_local(n, placement, self.mesh, self.mode, self.device, global_val=global_val)
        n.meta["source"] = node.meta.get("source", "")
        if node in self.needs_grad or any(a in self.needs_grad for a in n.all_input_nodes):
            self.needs_grad.add(n)
        return n

    def lower_ag_ring(self, node: fx.Node, s: Strategy) -> None:
        a, x = s.axis, node.args[0]
        m = x.meta["global_val"].dim() - 2
        gathered = list(self.placement(x))
        gathered[a] = REPLICATE
        with self.graph.inserting_before(node):
            ag = self.graph.call_function(runtime.all_gather, (x,), {"dim": m, "grad": "rs", "group": self.groups[a]})
        set_local(ag, gathered, self.mesh, self.mode, self.device, global_val=x.meta["global_val"])
        ag.meta["comm"] = {"op": "all_gather", "axis": a, "group": self.groups[a], "dim": m, "grad": "rs",
                           "edge": (x.name, node.name)}
        ag.meta["ring"] = {"kind": "ag_ring", "linear": node.name, "axis": a}
        ag.meta["source"] = node.meta.get("source", "")
        if x in self.needs_grad:
            self.needs_grad.add(ag)
        node.args = (ag,) + tuple(node.args[1:])
        node.meta["ring"] = {"kind": "ag_ring", "axis": a}
        set_local(node, s.out, self.mesh, self.mode, self.device)
        self.check(node)

    def lower_rs_ring(self, node: fx.Node, s: Strategy) -> None:
        a = s.axis
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        m = x.meta["global_val"].dim() - 2
        partial = list(s.out)
        partial[a] = PARTIAL
        node.args = (x, w)
        node.meta["ring"] = {"kind": "rs_ring", "axis": a}
        set_local(node, partial, self.mesh, self.mode, self.device)
        self.check(node)
        gv = node.meta["global_val"]
        rs = self._after(node, runtime.reduce_scatter, (node,), {"dim": m, "group": self.groups[a]}, s.out, gv)
        rs.meta["comm"] = {"op": "reduce_scatter", "axis": a, "group": self.groups[a], "dim": m,
                           "edge": (node.name, node.name)}
        rs.meta["ring"] = {"kind": "rs_ring", "linear": node.name, "axis": a}
        final = rs
        if bias is not None:
            final = self._after(rs, aten.add.Tensor, (rs, bias), {}, s.out, gv)
            self.check(final)
        node.replace_all_uses_with(final, delete_user_cb=lambda u: u is not rs)
        carry_taps(final, node)

    def lower_p2x2(self, node: fx.Node, s: Strategy) -> None:
        a = s.axis
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        node.target = runtime.grid_linear
        node.args = (x, w)
        node.kwargs = {"group": self.groups[a], "rows": parse(s.out[a])[1][0]}
        node.meta["ring"] = {"kind": "p2x2", "axis": a}
        node.meta["comm"] = {"op": "grid_linear", "axis": a, "group": self.groups[a], "edge": (x.name, node.name)}
        set_local(node, s.out, self.mesh, self.mode, self.device)
        if bias is not None:  # whole on the grid axis: each device adds its grid column's slice
            add = self._after(node, runtime.grid_bias_add, (node, bias), {"group": self.groups[a]}, s.out,
                              node.meta["global_val"])
            node.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
            carry_taps(add, node)

    def lower_grid_norm(self, node: fx.Node, out) -> None:
        """A LayerNorm or RMSNorm kept in a grid block layout: ``runtime.grid_layer_norm`` /
        ``grid_rms_norm`` normalises this device's block, its statistics exchanged along the
        grid row (a LayerNorm's weight and bias arrive whole; the op reads its grid
        column's slice)."""
        a = next(i for i, t in enumerate(out) if t[0] == "B")
        rms = node.target is aten.rms_norm.default
        what = "an RMSNorm" if rms else "a LayerNorm"
        x, shape, w, b, eps = (list(node.args) + [None, None, 1e-5][len(node.args) - 2:])[:5]
        if rms:  # rms_norm(x, shape, weight, eps): no bias
            x, shape, w, eps, b = (list(node.args) + [None, None][len(node.args) - 2:])[:4] + [None]
        if len(shape) != 1:
            raise fail(node, f"a grid layout through {what} over more than the last dim",
                       "re-plan: the planner keeps a grid layout only through a norm of the last dim")
        eps = node.kwargs.get("eps", eps)
        if rms and (w is not None or eps is None):
            raise fail(node, "a grid layout through an RMSNorm with its weight fused in, or with no eps",
                       "re-plan: the planner plans RMSNorm as stpc.trace leaves it (its weight's mul a "
                       "node of its own, eps given)")
        name = "grid_rms_norm" if rms else "grid_layer_norm"
        node.target = getattr(runtime, name)
        node.args = (x, eps) if rms else (x, w, b, eps)
        node.kwargs = {"group": self.groups[a]}
        node.meta["comm"] = {"op": name, "axis": a, "group": self.groups[a], "edge": (x.name, node.name)}
        set_local(node, out, self.mesh, self.mode, self.device)

    def lower_grid_loss(self, node: fx.Node, s: Strategy) -> None:
        """A cross-entropy reading its [N, V] logits in a grid block layout:
        ``runtime.grid_cross_entropy`` (row statistics exchanged along the grid row, the
        target whole, each device its rows' share of the loss: Partial on the grid's axis).
        Where another axis splits the rows too, the op sums and the mean divides by the
        count of counted targets summed over those axes, as a row-split loss does."""
        a = next(i for i, t in enumerate(s.ins[0]) if t[0] == "B")
        args = list(node.args) + [None, 1, -100, 0.0][len(node.args) - 2:]
        args[2:] = [node.kwargs.get(k, v) for k, v in zip(("weight", "reduction", "ignore_index",
                                                            "label_smoothing"), args[2:])]
        logits, target, weight, reduction, ignore, smoothing = args[:6]
        if weight is not None or smoothing or reduction not in (1, 2):
            raise fail(node, "a grid layout through a cross-entropy with class weights, label smoothing "
                       "or no reduction", "re-plan: the planner keeps the grid only through a plain mean or sum")
        out = tuple(s.out)
        others = [b for b, tok in enumerate(out) if tok == PARTIAL and b != a and self.mesh[b] > 1]
        mean = reduction == 1
        node.target = runtime.grid_cross_entropy
        node.args = (logits, target)
        node.kwargs = {"group": self.groups[a], "ignore_index": ignore,
                       "reduction": "mean" if mean and not others else "sum"}
        node.meta["comm"] = {"op": "grid_cross_entropy", "axis": a, "group": self.groups[a],
                             "edge": (logits.name, node.name)}
        set_local(node, out, self.mesh, self.mode, self.device)
        if not (mean and others):
            return
        gv = node.meta["global_val"]
        with self.graph.inserting_after(node):
            count = self.graph.call_function(runtime.cross_entropy_count, (target, ignore), {"dtype": gv.dtype})
        with self.graph.inserting_after(count):
            scaled = self.graph.call_function(aten.div.Tensor, (node, count))
        # the count of this rank's targets: whole on the grid's axis, a share on the others
        set_local(count, tuple(REPLICATE if b == a else tok for b, tok in enumerate(out)), self.mesh, self.mode,
                  self.device, global_val=gv)
        count.meta["source"] = node.meta.get("source", "")
        den = self.reshard(count, tuple(REPLICATE for _ in out), (False,) * len(out), scaled, needs_grad=False)
        scaled.args = (node, den)
        node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
        carry_taps(scaled, node)
        scaled.meta.update(global_val=gv, placement=out, val=node.meta["val"], source=node.meta.get("source", ""),
                           local_rewrite="sum of local rows / global count of counted targets")
        if node in self.needs_grad:
            self.needs_grad.add(scaled)

    def grid_columns(self, node: fx.Node, s: Strategy) -> None:
        """An op whose result keeps a grid block layout and one of whose operands runs
        along the block's column dim but not its row dim, whole on the grid's axis
        (RMSNorm's weight along the last dim; an attention mask that varies per head beside
        heads over the grid's columns): that operand becomes its grid column's slice of
        that dim (``runtime.grid_column``), what this device's block broadcasts against."""
        for a, tok in enumerate(s.out):
            if tok[0] != "B":
                continue
            i, j = parse(tok)[1]
            out_shape = node.meta["global_val"].shape
            full = out_shape[j]
            q = math.isqrt(self.mesh[a])
            ops = tensor_operands(node)
            for o, ins in zip(ops, s.ins):
                shape = o.meta["global_val"].shape
                lead = len(out_shape) - len(shape)  # (numpy broadcasting: operands align right)
                d = j - lead
                if ins[a] != REPLICATE or d < 0 or shape[d] != full or full == 1:
                    continue  # whole along the block's columns (broadcast): read whole
                if i - lead >= 0 and shape[i - lead] != 1:
                    raise fail(node, f"operand {o.name} whole on axis {a} beside a grid block, with the "
                               "block's row dim too", "re-plan: the plan does not belong to this graph")
                with self.graph.inserting_before(node):
                    col = self.graph.call_function(runtime.grid_column, (o,), {"group": self.groups[a], "dim": d})
                local = list(o.meta["val"].shape)
                local[d] //= q
                col.meta.update(global_val=o.meta["global_val"], placement=self.placement(o),
                                val=fake(self.mode, tuple(local), o.meta["val"].dtype, self.device),
                                source=node.meta.get("source", ""))
                if o in self.needs_grad:
                    self.needs_grad.add(col)
                node.replace_input_with(o, col)

    def lower_output(self, node: fx.Node) -> None:
        def target(p):
            if self.replicate_outputs:
                return ("R",) * len(p)
            return tuple("R" if t[0] in "PBXW" else t for t in p)  # what DTensor can say: R and S

        def fix(x):
            if is_tensor_node(x) and "placement" in x.meta:
                return self.reshard(x, target(self.placement(x)), (False,) * len(self.mesh), node)
            return x
        node.args = tuple(fx.node.map_aggregate(a, lambda x: fix(x) if isinstance(x, fx.Node) else x)
                          for a in node.args)


def insert_collectives(gm: fx.GraphModule, plan, replicate_outputs: bool = True) -> fx.GraphModule:
    """Insert the resharding collectives and local rewrites; see the module docstring.
    ``replicate_outputs=False`` keeps split (Shard) outputs split; Partial and grid
    outputs are still made Replicate."""
    _Lowering(gm, plan, replicate_outputs).run()
    return finish(gm)
